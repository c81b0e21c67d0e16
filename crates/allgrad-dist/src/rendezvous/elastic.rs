//! torchrun's elastic agent: what it tells its workers (run id, restart round, whether it
//! serves a store), and where in that store allgrad publishes its own ([`STORE_ADDR_KEY`]
//! under [`Elastic::round_prefix`]). The rendezvous through the agent's store is in
//! `rendezvous/agent.rs`.

use std::collections::HashMap;

use crate::error::{DistError, DistResult};

/// The key (under the round's prefix) where rank 0 publishes allgrad's store address.
pub const STORE_ADDR_KEY: &str = "allgrad/store_addr";

/// What torchrun's elastic agent tells its workers (`TORCHELASTIC_*`). allgrad's
/// `launch --max-restarts N` sets the same variables (without an agent store), so a restarted
/// rank behaves alike under both.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Elastic {
    /// `TORCHELASTIC_RUN_ID`: the same for every worker of a torchrun job and every restart
    /// (torchrun's `--rdzv-id`; `none` by default with the static rendezvous).
    pub run_id: String,
    /// `TORCHELASTIC_RESTART_COUNT`: 0 for the first start, N for the N-th restart.
    pub restart_count: usize,
    /// `TORCHELASTIC_MAX_RESTARTS`: torchrun's `--max-restarts`.
    pub max_restarts: usize,
    /// `TORCHELASTIC_USE_AGENT_STORE=True`: the agent serves a TCPStore at MASTER_ADDR:MASTER_PORT.
    pub agent_store: bool,
    /// `ALLGRAD_LAUNCHED=1`: the restarts are `launch`'s, not torchrun's (the trainer then
    /// names the run directory after the run id alone).
    pub by_launch: bool,
}

impl Elastic {
    /// Reads the `TORCHELASTIC_*` variables; `None` when the process was not started by
    /// torchrun's agent (no `TORCHELASTIC_RUN_ID` or `TORCHELASTIC_RESTART_COUNT`).
    pub fn from_vars(vars: &HashMap<String, String>) -> DistResult<Option<Elastic>> {
        let get = |k: &str| vars.get(k).map(|v| v.trim()).filter(|v| !v.is_empty());
        let num = |k: &str| -> DistResult<usize> {
            match get(k) {
                None => Ok(0),
                Some(v) => v.parse().map_err(|_| DistError::Env(format!("{k}={v:?} is not a non-negative integer"))),
            }
        };
        if get("TORCHELASTIC_RUN_ID").is_none() && get("TORCHELASTIC_RESTART_COUNT").is_none() {
            return Ok(None);
        }
        Ok(Some(Elastic {
            run_id: get("TORCHELASTIC_RUN_ID").unwrap_or("none").to_string(),
            restart_count: num("TORCHELASTIC_RESTART_COUNT")?,
            max_restarts: num("TORCHELASTIC_MAX_RESTARTS")?,
            agent_store: get("TORCHELASTIC_USE_AGENT_STORE") == Some("True"),
            by_launch: get("ALLGRAD_LAUNCHED") == Some("1"),
        }))
    }

    /// Whether this process is a restarted worker (it should resume its run).
    pub fn is_restart(&self) -> bool {
        self.restart_count > 0
    }

    /// The agent-store key prefix of this restart round: `/worker/attempt_<restart count>`.
    pub fn round_prefix(&self) -> String {
        format!("/worker/attempt_{}", self.restart_count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(kv: &[(&str, &str)]) -> HashMap<String, String> {
        kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn torchelastic_variables() {
        let e = Elastic::from_vars(&vars(&[
            ("TORCHELASTIC_RUN_ID", "job7"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
            ("TORCHELASTIC_MAX_RESTARTS", "3"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(e, Elastic { run_id: "job7".into(), restart_count: 2, max_restarts: 3, agent_store: true, by_launch: false });
        assert!(e.is_restart());
        assert_eq!(e.round_prefix(), "/worker/attempt_2");
    }

    #[test]
    fn absent_or_false_agent_store() {
        assert_eq!(Elastic::from_vars(&vars(&[("RANK", "0")])).unwrap(), None);
        let e = Elastic::from_vars(&vars(&[("TORCHELASTIC_RUN_ID", "r"), ("TORCHELASTIC_USE_AGENT_STORE", "False")]))
            .unwrap()
            .unwrap();
        assert!(!e.agent_store && !e.is_restart() && !e.by_launch);
        let e = Elastic::from_vars(&vars(&[("TORCHELASTIC_RESTART_COUNT", "1"), ("ALLGRAD_LAUNCHED", "1")])).unwrap().unwrap();
        assert!(e.by_launch && e.is_restart() && e.run_id == "none");
    }

    #[test]
    fn bad_restart_count_names_the_variable() {
        let err = Elastic::from_vars(&vars(&[("TORCHELASTIC_RUN_ID", "r"), ("TORCHELASTIC_RESTART_COUNT", "x")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("TORCHELASTIC_RESTART_COUNT=\"x\""), "{err}");
    }
}
