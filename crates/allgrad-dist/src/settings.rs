//! [`Settings`]: every `ALLGRAD_*` environment variable this crate reads, parsed once, at
//! start-up ([`ProcessGroup::from_env`](crate::ProcessGroup::from_env),
//! [`ProcessGroup::init`](crate::ProcessGroup::init), [`ThreadWorld`](crate::ThreadWorld)),
//! and carried by the group from then on. Nothing reads the environment at the point of use.
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `ALLGRAD_TIMEOUT_S` | 300 | seconds every blocking call may take (positive, fractions allowed) |
//! | `ALLGRAD_JOB_TOKEN` | derived from the job id and MASTER_ADDR/PORT | secret every connection presents |
//! | `ALLGRAD_MAX_MESSAGE_BYTES` | this rank's share of the host's memory (see [`message_cap`]) | largest total a rank accepts in one all_gather or all_to_all whose sizes come from the peers |
//! | `ALLGRAD_BIND_ADDR` | the interface that reaches MASTER_ADDR | IP address the data plane listens on |
//! | `ALLGRAD_SHM` | 1 | `0` keeps this process's groups on TCP; `1` lets same-host groups use shared memory |
//! | `ALLGRAD_SHM_SLOT_BYTES` | 1048576 | bytes each rank moves per shared-memory step (at least 4096; rounded down to pages) |
//! | `ALLGRAD_CUDA_COLLECTIVES` | `auto` | `auto`, `nccl` or `host`: how collectives of CUDA tensors move their data ([`crate::gpu`]) |
//! | `ALLGRAD_TREE_FROM` | 32 | groups of at least this many ranks check calls and run small collectives through a binomial tree (at least 2) |
//! | `ALLGRAD_ON_DEMAND_FROM` | 32 | groups of at least this many ranks connect at formation only along the tree and the ring, and open any other connection when a call first needs it (at least 2) |
//! | `ALLGRAD_PEER_WINDOW` | 64 | connections a rank waiting on shared memory or NCCL looks at each time for a dead or failed peer (at least 1) |
//!
//! An empty value counts as unset. A value that does not parse is an error naming the
//! variable and the value.
//!
//! The defaults are the constants of this module, and [`CudaCollectives`] is the value of
//! ALLGRAD_CUDA_COLLECTIVES (and of a run config's `dist.cuda_collectives`). Settings sit
//! below everything that reads them: this module imports nothing of the crate but its errors.

use std::collections::HashMap;
use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{DistError, DistResult};

/// Default timeout of every blocking distributed call (ALLGRAD_TIMEOUT_S overrides).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
/// Largest total a rank agrees to receive in one all_gather or all_to_all whose sizes come
/// from the peers, where the host's memory cannot be read; otherwise the cap is the rank's
/// share of that memory ([`message_cap`]). ALLGRAD_MAX_MESSAGE_BYTES overrides both.
pub const DEFAULT_MAX_MESSAGE_BYTES: u64 = 64 << 30;
/// Default bytes of one rank's shared-memory slot (ALLGRAD_SHM_SLOT_BYTES overrides).
pub(crate) const DEFAULT_SHM_SLOT_BYTES: usize = 1 << 20;
/// The smallest ALLGRAD_SHM_SLOT_BYTES: one page, the unit the segment's slots are
/// multiples of.
pub(crate) const MIN_SHM_SLOT_BYTES: usize = 4096;
/// Groups of at least this many ranks take the binomial tree (ALLGRAD_TREE_FROM overrides).
pub(crate) const DEFAULT_TREE_FROM: usize = 32;
/// Groups of at least this many ranks connect on demand (ALLGRAD_ON_DEMAND_FROM overrides):
/// below it every call of the direct paths uses every peer anyway.
pub(crate) const DEFAULT_ON_DEMAND_FROM: usize = 32;
/// Connections a rank that waits on shared memory or NCCL looks at each time for a dead or
/// failed peer (ALLGRAD_PEER_WINDOW overrides).
pub(crate) const DEFAULT_PEER_WINDOW: usize = 64;

/// How a group's collectives of CUDA tensors move their data (`dist.cuda_collectives`,
/// `ALLGRAD_CUDA_COLLECTIVES`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CudaCollectives {
    /// NCCL when the build has it and every rank of the group has a GPU of its own; the
    /// host otherwise.
    #[default]
    Auto,
    /// NCCL, always: a group whose ranks share a GPU, or a build without the `nccl`
    /// feature, is an error when the group chooses (at start, in `train`), never a hang.
    Nccl,
    /// Through host memory and the CPU backend, always.
    Host,
}

impl CudaCollectives {
    /// The names a user writes, in the order of the variants.
    pub const NAMES: [&'static str; 3] = ["auto", "nccl", "host"];
}

impl fmt::Display for CudaCollectives {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CudaCollectives::Auto => "auto",
            CudaCollectives::Nccl => "nccl",
            CudaCollectives::Host => "host",
        })
    }
}

impl FromStr for CudaCollectives {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(CudaCollectives::Auto),
            "nccl" => Ok(CudaCollectives::Nccl),
            "host" => Ok(CudaCollectives::Host),
            _ => Err(format!("{s:?} is not one of {}", CudaCollectives::NAMES.join(", "))),
        }
    }
}

/// The `ALLGRAD_*` settings of a process (see the module docs for the table).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// ALLGRAD_TIMEOUT_S: timeout of every blocking call.
    pub timeout: Duration,
    /// ALLGRAD_JOB_TOKEN: the shared secret, when set (else [`WorldInfo`](crate::WorldInfo)
    /// derives one).
    pub job_token: Option<String>,
    /// ALLGRAD_MAX_MESSAGE_BYTES: an explicit cap on peer-announced message totals; `None`
    /// derives it from this host's memory ([`message_cap`]).
    pub max_message_bytes: Option<u64>,
    /// ALLGRAD_BIND_ADDR: the address the data plane listens on; `None` picks the interface
    /// that reaches MASTER_ADDR.
    pub bind_addr: Option<IpAddr>,
    /// ALLGRAD_SHM: whether same-host groups may use shared memory.
    pub shm: bool,
    /// ALLGRAD_SHM_SLOT_BYTES: bytes each rank moves per shared-memory step.
    pub shm_slot_bytes: usize,
    /// ALLGRAD_CUDA_COLLECTIVES: the path of collectives of CUDA tensors, when set (`None`:
    /// `auto`, unless a run config's `dist.cuda_collectives` says otherwise).
    pub cuda_collectives: Option<CudaCollectives>,
    /// ALLGRAD_TREE_FROM: groups of at least this many ranks check every call's header and
    /// run barrier and small all_reduce, all_gather and reduce_scatter calls through a
    /// binomial tree (2 log2(W) rounds, at most 2 log2(W) frames per rank) instead of
    /// one round with every peer (2(W - 1) frames per rank).
    pub tree_from: usize,
    /// ALLGRAD_ON_DEMAND_FROM: groups of at least this many ranks connect at formation only
    /// to their parent and children in the binomial tree and to their neighbours on the ring
    /// (r - 1 and r + 1), and open every other connection when a call first needs it; smaller
    /// groups connect every pair at formation.
    pub on_demand_from: usize,
    /// ALLGRAD_PEER_WINDOW: how many of its connections a rank waiting on shared memory or
    /// NCCL looks at each time for a peer that died or failed, the window moving on at every
    /// look (rank r's k-th look covers group ranks r + 1 + k * window onwards, modulo the
    /// group size), so that each peer is watched by `window` ranks at every look.
    pub peer_window: usize,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            timeout: DEFAULT_TIMEOUT,
            job_token: None,
            max_message_bytes: None,
            bind_addr: None,
            shm: true,
            shm_slot_bytes: DEFAULT_SHM_SLOT_BYTES,
            cuda_collectives: None,
            tree_from: DEFAULT_TREE_FROM,
            on_demand_from: DEFAULT_ON_DEMAND_FROM,
            peer_window: DEFAULT_PEER_WINDOW,
        }
    }
}

impl Settings {
    /// Reads the process environment.
    pub fn from_env() -> DistResult<Settings> {
        Self::from_vars(&std::env::vars().collect())
    }

    /// Reads the given variables (the testable core of [`Settings::from_env`]).
    pub fn from_vars(vars: &HashMap<String, String>) -> DistResult<Settings> {
        let get = |k: &str| vars.get(k).map(|v| v.trim()).filter(|v| !v.is_empty());
        let bad = |k: &str, v: &str, what: &str| DistError::Env(format!("{k}={v:?} is not {what}"));
        let mut s = Settings::default();
        if let Some(v) = get("ALLGRAD_TIMEOUT_S") {
            s.timeout = match v.parse::<f64>() {
                Ok(t) if t > 0.0 && t.is_finite() => Duration::from_secs_f64(t),
                _ => return Err(bad("ALLGRAD_TIMEOUT_S", v, "a positive number of seconds")),
            };
        }
        s.job_token = get("ALLGRAD_JOB_TOKEN").map(String::from);
        if let Some(v) = get("ALLGRAD_MAX_MESSAGE_BYTES") {
            s.max_message_bytes = Some(v.parse().map_err(|_| bad("ALLGRAD_MAX_MESSAGE_BYTES", v, "a number of bytes"))?);
        }
        if let Some(v) = get("ALLGRAD_BIND_ADDR") {
            s.bind_addr = Some(v.parse().map_err(|_| bad("ALLGRAD_BIND_ADDR", v, "an IP address"))?);
        }
        if let Some(v) = get("ALLGRAD_SHM") {
            s.shm = match v {
                "1" => true,
                "0" => false,
                _ => return Err(DistError::Env(format!("ALLGRAD_SHM={v:?} is neither 0 (TCP only) nor 1 (default)"))),
            };
        }
        if let Some(v) = get("ALLGRAD_SHM_SLOT_BYTES") {
            s.shm_slot_bytes = v.parse::<usize>().ok().filter(|b| *b >= MIN_SHM_SLOT_BYTES).ok_or_else(|| {
                bad("ALLGRAD_SHM_SLOT_BYTES", v, &format!("a number of bytes of at least {MIN_SHM_SLOT_BYTES}"))
            })?;
        }
        if let Some(v) = get("ALLGRAD_TREE_FROM") {
            s.tree_from = v
                .parse::<usize>()
                .ok()
                .filter(|n| *n >= 2)
                .ok_or_else(|| bad("ALLGRAD_TREE_FROM", v, "a number of ranks of at least 2"))?;
        }
        if let Some(v) = get("ALLGRAD_ON_DEMAND_FROM") {
            s.on_demand_from = v
                .parse::<usize>()
                .ok()
                .filter(|n| *n >= 2)
                .ok_or_else(|| bad("ALLGRAD_ON_DEMAND_FROM", v, "a number of ranks of at least 2"))?;
        }
        if let Some(v) = get("ALLGRAD_PEER_WINDOW") {
            s.peer_window = v
                .parse::<usize>()
                .ok()
                .filter(|n| *n >= 1)
                .ok_or_else(|| bad("ALLGRAD_PEER_WINDOW", v, "a number of connections of at least 1"))?;
        }
        if let Some(v) = get("ALLGRAD_CUDA_COLLECTIVES") {
            s.cuda_collectives = Some(v.parse().map_err(|e| DistError::Env(format!("ALLGRAD_CUDA_COLLECTIVES={v:?}: {e}")))?);
        }
        Ok(s)
    }
}

/// The default cap on what peers may make this rank allocate in one all_gather or all_to_all
/// whose sizes they announce: this rank's share of the memory of its host (`memory` bytes,
/// shared by `local_ranks` ranks), or [`DEFAULT_MAX_MESSAGE_BYTES`]
/// where the memory is unknown.
///
/// Why this is the largest collective a rank can really be asked for: the output of an
/// all_gather is the same on every rank, so the `local_ranks` ranks of the host each hold a
/// copy and no real call can gather more than `memory / local_ranks` bytes without running
/// the host out of memory. A peer that announces more is refused before anything is
/// allocated, and the group is poisoned. An all_to_all whose outputs are very uneven across
/// the ranks of one host (one rank receiving almost everything) can exceed the share in a
/// real program: set ALLGRAD_MAX_MESSAGE_BYTES for it.
pub fn message_cap(memory: Option<u64>, local_ranks: usize) -> u64 {
    match memory {
        Some(m) if m > 0 => m / local_ranks.max(1) as u64,
        _ => DEFAULT_MAX_MESSAGE_BYTES,
    }
}

/// Bytes of memory this process may use: the physical memory, or the cgroup (v2) limit where
/// that is lower; `None` where neither can be read.
pub(crate) fn host_memory() -> Option<u64> {
    // SAFETY: sysconf has no preconditions.
    let (pages, page) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    let physical = (pages > 0 && page > 0).then(|| (pages as u64).saturating_mul(page as u64));
    let cgroup = std::fs::read_to_string("/sys/fs/cgroup/memory.max").ok().and_then(|s| s.trim().parse::<u64>().ok());
    match (physical, cgroup) {
        (Some(p), Some(c)) => Some(p.min(c)),
        (p, c) => p.or(c),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(kv: &[(&str, &str)]) -> HashMap<String, String> {
        kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn unset_variables_give_the_defaults() {
        let s = Settings::from_vars(&vars(&[])).unwrap();
        assert_eq!(s, Settings::default());
        assert_eq!((s.timeout, s.shm, s.shm_slot_bytes), (Duration::from_secs(300), true, 1 << 20));
        assert_eq!((s.max_message_bytes, s.bind_addr, s.job_token), (None, None, None));
        assert_eq!(s.cuda_collectives, None);
        assert_eq!(s.tree_from, 32);
        assert_eq!(s.on_demand_from, 32);
        assert_eq!(s.peer_window, 64);
    }

    #[test]
    fn every_variable_is_read() {
        let s = Settings::from_vars(&vars(&[
            ("ALLGRAD_TIMEOUT_S", "2.5"),
            ("ALLGRAD_JOB_TOKEN", "s3cret"),
            ("ALLGRAD_MAX_MESSAGE_BYTES", " 1024 "),
            ("ALLGRAD_BIND_ADDR", "10.1.2.3"),
            ("ALLGRAD_SHM", "0"),
            ("ALLGRAD_SHM_SLOT_BYTES", "65536"),
            ("ALLGRAD_CUDA_COLLECTIVES", "host"),
            ("ALLGRAD_TREE_FROM", "5"),
            ("ALLGRAD_ON_DEMAND_FROM", "7"),
            ("ALLGRAD_PEER_WINDOW", "2"),
        ]))
        .unwrap();
        assert_eq!(s.timeout, Duration::from_millis(2500));
        assert_eq!(s.job_token.as_deref(), Some("s3cret"));
        assert_eq!(s.max_message_bytes, Some(1024));
        assert_eq!(s.bind_addr, Some("10.1.2.3".parse().unwrap()));
        assert!(!s.shm);
        assert_eq!(s.shm_slot_bytes, 65536);
        assert_eq!(s.cuda_collectives, Some(CudaCollectives::Host));
        assert_eq!(s.tree_from, 5);
        assert_eq!(s.on_demand_from, 7);
        assert_eq!(s.peer_window, 2);
    }

    #[test]
    fn bad_values_are_errors_naming_the_variable_and_value() {
        for (k, v) in [
            ("ALLGRAD_TIMEOUT_S", "-1"),
            ("ALLGRAD_TIMEOUT_S", "inf"),
            ("ALLGRAD_MAX_MESSAGE_BYTES", "64G"),
            ("ALLGRAD_BIND_ADDR", "eth0"),
            ("ALLGRAD_SHM", "yes"),
            ("ALLGRAD_SHM_SLOT_BYTES", "12"),
            ("ALLGRAD_SHM_SLOT_BYTES", "1M"),
            ("ALLGRAD_CUDA_COLLECTIVES", "gloo"),
            ("ALLGRAD_TREE_FROM", "1"),
            ("ALLGRAD_TREE_FROM", "many"),
            ("ALLGRAD_ON_DEMAND_FROM", "1"),
            ("ALLGRAD_ON_DEMAND_FROM", "all"),
            ("ALLGRAD_PEER_WINDOW", "0"),
            ("ALLGRAD_PEER_WINDOW", "two"),
            ("ALLGRAD_PEER_WINDOW", "-3"),
        ] {
            let e = Settings::from_vars(&vars(&[(k, v)])).unwrap_err().to_string();
            assert!(e.contains(k) && e.contains(&format!("{v:?}")), "{k}={v}: {e}");
        }
    }

    #[test]
    fn message_cap_is_the_hosts_memory_shared_by_its_ranks() {
        assert_eq!(message_cap(Some(64 << 30), 4), 16 << 30);
        assert_eq!(message_cap(Some(1000), 3), 333);
        assert_eq!(message_cap(Some(1000), 0), 1000);
        assert_eq!(message_cap(None, 4), 64 << 30);
        assert_eq!(message_cap(Some(0), 4), 64 << 30);
    }

    #[test]
    fn modes_parse_from_their_names_only() {
        for (s, m) in CudaCollectives::NAMES.iter().zip([CudaCollectives::Auto, CudaCollectives::Nccl, CudaCollectives::Host]) {
            assert_eq!(s.parse::<CudaCollectives>().unwrap(), m);
            assert_eq!(m.to_string(), *s);
        }
        let e = "NCCL".parse::<CudaCollectives>().unwrap_err();
        assert!(e.contains("\"NCCL\"") && e.contains("auto, nccl, host"), "{e}");
    }
}
