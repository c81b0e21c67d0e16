//! What one measured step holds: its figures by name (`Sample`), taken from this process's
//! usage before and after it, with the CPU time other processes used meanwhile and allgrad's
//! host traffic; a step benchmark's both sides (allgrad here, PyTorch through the peer) give
//! one per step.

use crate::machine::{busy_cpu_seconds, summary, Usage};

/// The figures of one measured step, by name: `wall`, `user`, `sys` (seconds), `minflt`
/// (minor page faults), `fwd`, `bwd`, `opt` (seconds of the phases), `others` (CPU seconds
/// other processes used meanwhile, added by [`measured`]).
pub type Sample = std::collections::BTreeMap<String, f64>;

/// The sample of a step that ran between `start` and `end`, with its phase times.
pub fn sample(start: Usage, end: Usage, phases: [(&str, f64); 3]) -> Sample {
    let mut s = Sample::new();
    s.insert("wall".into(), end.at.duration_since(start.at).as_secs_f64());
    s.insert("user".into(), end.user - start.user);
    s.insert("sys".into(), end.sys - start.sys);
    s.insert("minflt".into(), end.minflt - start.minflt);
    for (k, v) in phases {
        s.insert(k.into(), v);
    }
    s
}

/// `f`'s sample with `others`: CPU seconds that other processes used while it ran.
pub fn measured(f: impl FnOnce() -> anyhow::Result<Sample>) -> anyhow::Result<Sample> {
    let before = busy_cpu_seconds();
    let mut s = f()?;
    if let (Some(a), Some(b)) = (before, busy_cpu_seconds()) {
        let own = s.get("user").unwrap_or(&0.0) + s.get("sys").unwrap_or(&0.0);
        s.insert("others".into(), (b - a - own).max(0.0));
    }
    Ok(s)
}

/// min, median and max of `key` over `samples`.
pub fn stat(samples: &[Sample], key: &str) -> Option<(f64, f64, f64)> {
    summary(&samples.iter().filter_map(|s| s.get(key).copied()).collect::<Vec<_>>())
}

/// Adds allgrad's host traffic of a step to its sample, from snapshots of
/// [`allgrad_nn::host_traffic`] at its start and after its forward, backward and optimizer:
/// device→host reads per phase, host→device uploads and cuDNN heuristic queries (on the CPU
/// they count only with `--device-path`, the code path of a GPU).
pub fn insert_traffic(s: &mut Sample, [start, fwd, bwd, opt]: [allgrad_nn::HostTraffic; 4]) {
    s.insert("reads_fwd".into(), (fwd - start).reads as f64);
    s.insert("reads_bwd".into(), (bwd - fwd).reads as f64);
    s.insert("reads_opt".into(), (opt - bwd).reads as f64);
    s.insert("uploads".into(), (opt - start).uploads as f64);
    s.insert("cudnn_queries".into(), (opt - start).heuristic_queries as f64);
}
