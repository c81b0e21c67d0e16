//! File descriptors: a group of W ranks holds a connection to each of the other W - 1 on every
//! rank (and, while it forms, a listener), so a process that cannot open that many would fail
//! half-way through connecting with "Too many open files", leaving its peers waiting. Before
//! connecting, the need is checked against RLIMIT_NOFILE: a soft limit that is too low is
//! raised up to the hard limit (as the soft limit of 1024 that many systems set for
//! compatibility with `select(2)` would stop a group at about a thousand ranks), and a hard
//! limit that is too low is an error naming the numbers and the fix.

use crate::error::{DistError, DistResult};

/// Descriptors kept free beyond the group's connections: its listener, the shared-memory
/// segment while it is mapped, files the program opens meanwhile.
const SPARE: u64 = 64;

/// What to do about a limit, for a process holding `open` descriptors that is about to open
/// `add` more, under soft limit `soft` and hard limit `hard`: `Ok(None)` when it fits,
/// `Ok(Some(new_soft))` when the soft limit must be raised, `Err(need)` when even the hard
/// limit is too low.
pub(crate) fn plan(open: u64, add: u64, soft: u64, hard: u64) -> Result<Option<u64>, u64> {
    let need = open.saturating_add(add).saturating_add(SPARE);
    if need <= soft {
        Ok(None)
    } else if need <= hard {
        // Room for a few more groups of the same size, within the hard limit.
        Ok(Some(need.saturating_mul(2).min(hard)))
    } else {
        Err(need)
    }
}

/// Descriptors this process has open now (`None` where /proc cannot tell).
fn open_now() -> Option<u64> {
    std::fs::read_dir("/proc/self/fd").ok().map(|d| d.count() as u64)
}

/// Why a process cannot open the descriptors it is about to need.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Shortfall {
    /// Descriptors open now.
    pub open: u64,
    /// Descriptors needed (open, to be opened, and [`SPARE`]).
    pub need: u64,
    /// The soft limit (ulimit -n).
    pub soft: u64,
    /// The hard limit.
    pub hard: u64,
}

impl Shortfall {
    /// A limit to suggest: a power of two above the need, at least 4096.
    pub(crate) fn suggest(&self) -> u64 {
        self.need.next_power_of_two().max(4096)
    }
}

/// Makes room for `add` more descriptors in this process, raising the soft limit within the
/// hard one when needed.
pub(crate) fn make_room(add: u64) -> Result<(), Shortfall> {
    let Some(open) = open_now() else { return Ok(()) };
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Ok(());
    }
    let (soft, hard): (u64, u64) = (lim.rlim_cur, lim.rlim_max);
    match plan(open, add, soft, hard) {
        Ok(None) => Ok(()),
        Ok(Some(new_soft)) => {
            let raised = libc::rlimit { rlim_cur: new_soft, rlim_max: lim.rlim_max };
            // SAFETY: setrlimit reads the struct it is given; raising the soft limit up to the
            // hard one needs no privilege.
            if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
                return Err(Shortfall { open, need: open + add + SPARE, soft, hard });
            }
            tracing::debug!("raised the soft limit on open files from {soft} to {new_soft} for {add} more");
            Ok(())
        }
        Err(need) => Err(Shortfall { open, need, soft, hard }),
    }
}

/// Makes room for the connections of group `group` of `ranks` ranks, or says why it cannot.
pub(crate) fn ensure_room(group: &str, ranks: usize) -> DistResult<()> {
    make_room(ranks.saturating_sub(1) as u64 + 1).map_err(|s| too_few(group, ranks, s.open, s.need, s.soft, s.hard))
}

fn too_few(group: &str, ranks: usize, open: u64, need: u64, soft: u64, hard: u64) -> DistError {
    DistError::Env(format!(
        "group {group} of {ranks} ranks needs about {need} file descriptors on every rank (a connection to each of \
         the {} others, {open} open already, {SPARE} spare), but this process may open at most {soft} (ulimit -n; \
         hard limit {hard}): raise the limit, e.g. `ulimit -n {}` in the shell that starts the job, or \
         LimitNOFILE= / limits.conf for services",
        ranks.saturating_sub(1),
        Shortfall { open, need, soft, hard }.suggest()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_limit_is_raised_within_the_hard_one_and_a_low_hard_limit_is_refused() {
        // 1,024 ranks under the common 1024 / 524288 limits: raised.
        assert_eq!(plan(10, 1024, 1024, 524_288), Ok(Some(2 * (10 + 1024 + SPARE))));
        // Raised no further than the hard limit.
        assert_eq!(plan(10, 1024, 1024, 1500), Ok(Some(1500)));
        // Enough already.
        assert_eq!(plan(10, 64, 1024, 1024), Ok(None));
        // The hard limit too low: the need is reported.
        assert_eq!(plan(10, 1024, 1024, 1024), Err(10 + 1024 + SPARE));
    }

    #[test]
    fn the_error_names_the_group_the_numbers_and_the_fix() {
        let e = too_few("world", 1024, 10, 1098, 1024, 1024).to_string();
        for want in ["group world of 1024 ranks", "about 1098 file descriptors", "1023 others", "at most 1024", "ulimit -n 4096"]
        {
            assert!(e.contains(want), "{want:?} missing in {e}");
        }
    }
}
