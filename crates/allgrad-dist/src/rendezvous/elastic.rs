//! torchrun's elastic agent: what it tells its workers (run id, restart round, the store it
//! serves), and the rendezvous through that store.
//!
//! torchrun's agent already serves a PyTorch TCPStore at MASTER_ADDR:MASTER_PORT and says so
//! with `TORCHELASTIC_USE_AGENT_STORE=True`, so rank 0 cannot bind that port. Instead rank 0
//! starts allgrad's own (authenticated) store on a free port of the MASTER_ADDR interface and
//! publishes its address in the agent's store under the restart round's prefix
//! (`/worker/attempt_<restart count>`, the prefix PyTorch's env:// rendezvous used for
//! agent stores); every other rank reads it there. From then on the job proceeds as without
//! torchrun: every rank connects to allgrad's store and the authenticated mesh is built.

use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};

use crate::error::{DistError, DistResult};
use crate::rendezvous::env::WorldInfo;
use crate::rendezvous::store::StoreServer;
use crate::rendezvous::torch_store::TorchStore;

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

/// When torchrun's agent serves the store, rendezvous through it: rank 0 starts allgrad's
/// store on a free port and publishes the address; the returned world info points every rank
/// at that store. `None` when there is no agent store (or a world of one rank).
pub(crate) fn rendezvous_via_agent(info: &WorldInfo) -> DistResult<Option<(WorldInfo, Option<StoreServer>)>> {
    let Some(elastic) = info.elastic.as_ref().filter(|e| e.agent_store && info.world_size > 1) else {
        return Ok(None);
    };
    let agent_addr = format!("{}:{}", info.master_addr, info.master_port);
    let agent = TorchStore::connect(&agent_addr, info.timeout)?.with_prefix(&elastic.round_prefix());
    let (addr, server) = if info.rank == 0 {
        let ip = (info.master_addr.as_str(), 0)
            .to_socket_addrs()
            .map_err(|e| DistError::io(format!("resolving MASTER_ADDR {}", info.master_addr), e))?
            .next()
            .ok_or_else(|| DistError::Env(format!("MASTER_ADDR {} resolves to no address", info.master_addr)))?;
        let server = StoreServer::start(ip, &info.token)?;
        let addr = server.addr();
        agent.set(STORE_ADDR_KEY, addr.to_string().as_bytes())?;
        (addr, Some(server))
    } else {
        let raw = agent.get(STORE_ADDR_KEY)?;
        let text = String::from_utf8_lossy(&raw);
        let addr: SocketAddr = text.parse().map_err(|_| {
            DistError::Store(format!(
                "{:?} in torchrun's TCPStore at {agent_addr} is not an address: {text:?}",
                agent.wire_key(STORE_ADDR_KEY)
            ))
        })?;
        (addr, None)
    };
    tracing::debug!("rank {}: torchrun's agent store at {agent_addr} points at allgrad's store {addr}", info.rank);
    let mut joined = info.clone();
    joined.master_addr = addr.ip().to_string();
    joined.master_port = addr.port();
    Ok(Some((joined, server)))
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
