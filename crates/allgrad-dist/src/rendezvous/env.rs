//! The launcher contract: which rank this process is, how many there are, and where rank 0's
//! rendezvous store listens.
//!
//! Read from the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
//! MASTER_ADDR, MASTER_PORT), falling back to SLURM's (SLURM_PROCID, SLURM_NTASKS,
//! SLURM_LOCALID, SLURM_NTASKS_PER_NODE) so that `srun` works. Without any of them the
//! process is a world of size 1.

use std::collections::HashMap;
use std::time::Duration;

use crate::error::{DistError, DistResult};
use crate::rendezvous::elastic::Elastic;
use crate::settings::Settings;
pub use crate::settings::DEFAULT_TIMEOUT;

/// Default port of the rendezvous store when MASTER_PORT is unset (torchrun's default).
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Where this process sits in the job, and how to reach the others.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorldInfo {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Number of ranks in the job.
    pub world_size: usize,
    /// Rank on this node (picks the GPU).
    pub local_rank: usize,
    /// Ranks on this node.
    pub local_world_size: usize,
    /// Host of rank 0's rendezvous store.
    pub master_addr: String,
    /// Port of rank 0's rendezvous store.
    pub master_port: u16,
    /// Shared secret checked at every connection handshake.
    pub token: String,
    /// Timeout of every blocking call.
    pub timeout: Duration,
    /// Set when torchrun's elastic agent started this process: run id, restart round, and
    /// whether its store serves MASTER_PORT (then rank 0 does not bind it; see [`crate::rendezvous::elastic`]).
    pub elastic: Option<Elastic>,
}

impl WorldInfo {
    /// A world of one process, needing no network.
    pub fn single() -> Self {
        WorldInfo {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            master_addr: "127.0.0.1".into(),
            master_port: DEFAULT_MASTER_PORT,
            token: String::new(),
            timeout: DEFAULT_TIMEOUT,
            elastic: None,
        }
    }

    /// Reads the process environment.
    pub fn from_env() -> DistResult<Self> {
        Self::from_vars(&std::env::vars().collect())
    }

    /// Reads the given variables (the testable core of [`WorldInfo::from_env`]); the
    /// `ALLGRAD_*` ones through [`Settings::from_vars`], so a bad value of any is an error here.
    pub fn from_vars(vars: &HashMap<String, String>) -> DistResult<Self> {
        let get = |k: &str| vars.get(k).map(|v| v.trim()).filter(|v| !v.is_empty());
        let num = |k: &str| -> DistResult<Option<usize>> {
            match get(k) {
                None => Ok(None),
                Some(v) => {
                    v.parse::<usize>().map(Some).map_err(|_| DistError::Env(format!("{k}={v:?} is not a non-negative integer")))
                }
            }
        };
        // The ALLGRAD_* variables, parsed once; the timeout and token come from them.
        let settings = Settings::from_vars(vars)?;
        let timeout = settings.timeout;

        // torchrun first, then SLURM, else a single process.
        let (source, rank, world, local_rank, local_world) = if get("RANK").is_some() || get("WORLD_SIZE").is_some() {
            let rank = num("RANK")?.ok_or_else(|| DistError::Env("WORLD_SIZE is set but RANK is not".into()))?;
            let world = num("WORLD_SIZE")?.ok_or_else(|| DistError::Env("RANK is set but WORLD_SIZE is not".into()))?;
            ("torchrun", rank, world, num("LOCAL_RANK")?, num("LOCAL_WORLD_SIZE")?)
        } else if get("SLURM_PROCID").is_some() {
            let rank = num("SLURM_PROCID")?.unwrap_or(0);
            let world =
                num("SLURM_NTASKS")?.ok_or_else(|| DistError::Env("SLURM_PROCID is set but SLURM_NTASKS is not".into()))?;
            // SLURM_NTASKS_PER_NODE can read "4(x2)"; take the leading number.
            let per_node = get("SLURM_NTASKS_PER_NODE")
                .and_then(|v| v.split(|c: char| !c.is_ascii_digit()).next().and_then(|d| d.parse().ok()));
            ("SLURM", rank, world, num("SLURM_LOCALID")?, per_node)
        } else {
            let mut single = Self::single();
            single.timeout = timeout;
            return Ok(single);
        };

        if world == 0 {
            return Err(DistError::Env(format!("world size from {source} is 0")));
        }
        if rank >= world {
            return Err(DistError::Env(format!("rank {rank} from {source} is not below the world size {world}")));
        }
        let local_rank = local_rank.unwrap_or(rank);
        let local_world_size = local_world.unwrap_or(world);
        if local_rank >= local_world_size {
            return Err(DistError::Env(format!(
                "local rank {local_rank} from {source} is not below the local world size {local_world_size}"
            )));
        }
        // Under srun without MASTER_ADDR/MASTER_PORT: the first host of the step (else job) and a
        // port from the job id (crate::rendezvous::slurm).
        let slurm_nodes = get("SLURM_STEP_NODELIST").or(get("SLURM_JOB_NODELIST"));
        let master_addr = match get("MASTER_ADDR") {
            Some(a) => a.to_string(),
            None if world == 1 => "127.0.0.1".to_string(),
            None if source == "SLURM" && slurm_nodes.is_some() => {
                crate::rendezvous::slurm::first_host(slurm_nodes.unwrap_or_default())?
            }
            None => {
                return Err(DistError::Env(format!(
                    "MASTER_ADDR is not set: {source} gives {world} ranks, and they meet at rank 0's address \
                     (set MASTER_ADDR to rank 0's host name or IP, and MASTER_PORT to a free port)"
                )))
            }
        };
        let master_port = match get("MASTER_PORT") {
            None if source == "SLURM" && get("SLURM_JOB_ID").is_some() => {
                crate::rendezvous::slurm::port_from_job_id(get("SLURM_JOB_ID").unwrap_or_default())?
            }
            None => DEFAULT_MASTER_PORT,
            Some(p) => p
                .parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| DistError::Env(format!("MASTER_PORT={p:?} is not a port number (1-65535)")))?,
        };
        let token = match settings.job_token {
            Some(t) => t,
            None => {
                // Ranks started by torchrun or srun directly share no secret; derive one from what
                // they do share, which keeps stray connections out but is no protection against
                // someone who can read the job's environment. The launcher always sets a random one.
                let job = get("TORCHELASTIC_RUN_ID").or(get("SLURM_JOB_ID")).unwrap_or("none");
                if world > 1 && rank == 0 {
                    tracing::warn!(
                        "ALLGRAD_JOB_TOKEN is not set: connections are checked against a token derived from \
                         the job id and MASTER_ADDR/PORT only; set ALLGRAD_JOB_TOKEN to a random secret"
                    );
                }
                format!("derived:{job}:{master_addr}:{master_port}")
            }
        };
        let elastic = Elastic::from_vars(vars)?;
        Ok(WorldInfo { rank, world_size: world, local_rank, local_world_size, master_addr, master_port, token, timeout, elastic })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(kv: &[(&str, &str)]) -> HashMap<String, String> {
        kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn empty_environment_is_a_single_process() {
        let w = WorldInfo::from_vars(&vars(&[])).unwrap();
        assert_eq!((w.rank, w.world_size, w.local_rank), (0, 1, 0));
    }

    #[test]
    fn torchrun_variables() {
        let w = WorldInfo::from_vars(&vars(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "1234"),
            ("ALLGRAD_JOB_TOKEN", "s3cret"),
            ("ALLGRAD_TIMEOUT_S", "2.5"),
        ]))
        .unwrap();
        assert_eq!((w.rank, w.world_size, w.local_rank, w.local_world_size), (5, 8, 1, 4));
        assert_eq!((w.master_addr.as_str(), w.master_port, w.token.as_str()), ("node0", 1234, "s3cret"));
        assert_eq!(w.timeout, Duration::from_millis(2500));
    }

    #[test]
    fn slurm_fallback() {
        let w = WorldInfo::from_vars(&vars(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS_PER_NODE", "2(x2)"),
            ("MASTER_ADDR", "10.0.0.1"),
        ]))
        .unwrap();
        assert_eq!((w.rank, w.world_size, w.local_rank, w.local_world_size), (3, 4, 1, 2));
        assert_eq!(w.master_port, DEFAULT_MASTER_PORT);
    }

    #[test]
    fn bad_values_name_the_variable() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[("RANK", "x"), ("WORLD_SIZE", "2")], "RANK=\"x\""),
            (&[("RANK", "2"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")], "rank 2"),
            (&[("RANK", "0"), ("WORLD_SIZE", "2")], "MASTER_ADDR is not set"),
            (&[("RANK", "0")], "WORLD_SIZE"),
            (&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "70000")], "MASTER_PORT"),
            (&[("ALLGRAD_TIMEOUT_S", "-1")], "ALLGRAD_TIMEOUT_S"),
        ];
        for (kv, needle) in cases {
            let err = WorldInfo::from_vars(&vars(kv)).unwrap_err().to_string();
            assert!(err.contains(needle), "{kv:?}: {err:?} does not mention {needle:?}");
        }
    }
}
