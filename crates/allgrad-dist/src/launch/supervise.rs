//! Watching the ranks until they all end: the first failure (or a signal to the launcher)
//! stops the others, SIGTERM first and SIGKILL after the grace period. After a failure the
//! others first get [`SETTLE`] to end on their own: ranks that fail for the same reason then
//! report it themselves (`train` prints an error that is the same on every rank, a config
//! error, on rank 0 only; stopped at once, rank 0 could be killed before it printed, leaving
//! only "rank 1 exited with code 2"), and the survivors of a dead peer name it.

use std::os::unix::process::ExitStatusExt;
use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

use super::signals::SignalGuard;
use super::Outcome;

const POLL: Duration = Duration::from_millis(20);

/// How long the other ranks may take to end on their own after one failed, before SIGTERM.
const SETTLE: Duration = Duration::from_secs(1);

/// The exit code of a status, 128 + the signal number for a process killed by a signal.
pub(crate) fn code_of(status: ExitStatus) -> i32 {
    status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

/// Polls the ranks (global rank, process) until every one has exited, one has failed, or a
/// signal arrived; in the last two cases stops every rank before returning.
pub(crate) fn supervise(children: &mut [(usize, Child)], signals: &SignalGuard, grace: Duration) -> Outcome {
    loop {
        if let Some(sig) = signals.received() {
            eprintln!("launch: received signal {sig}; stopping all ranks");
            stop_all(children, grace);
            return Outcome::Interrupted(sig);
        }
        let mut failed = None;
        let mut running = 0;
        for (rank, child) in children.iter_mut() {
            match child.try_wait() {
                Ok(Some(status)) if !status.success() => {
                    // Of the ranks seen failing in the same poll, one killed by a signal is
                    // the likelier root cause (the others typically failed because of it).
                    let by_signal = status.signal().is_some();
                    match failed {
                        Some((_, _, true)) => {}
                        Some(_) if !by_signal => {}
                        _ => failed = Some((*rank, code_of(status), by_signal)),
                    }
                }
                Ok(Some(_)) => {}
                Ok(None) => running += 1,
                Err(e) => {
                    eprintln!("launch: cannot wait for rank {rank}: {e}");
                    failed.get_or_insert((*rank, 1, false));
                }
            }
        }
        if let Some((rank, code, _)) = failed {
            eprintln!("launch: rank {rank} exited with code {code}; stopping the other ranks");
            let deadline = Instant::now() + SETTLE;
            while Instant::now() < deadline && signals.received().is_none() && any_running(children) {
                std::thread::sleep(POLL);
            }
            stop_all(children, grace);
            return Outcome::RankFailed { rank, code };
        }
        if running == 0 {
            return Outcome::Success;
        }
        std::thread::sleep(POLL);
    }
}

/// Whether a rank has not exited yet.
fn any_running(children: &mut [(usize, Child)]) -> bool {
    children.iter_mut().any(|(_, c)| matches!(c.try_wait(), Ok(None)))
}

/// SIGTERM to every running rank's process group, then SIGKILL to those left after `grace`;
/// returns once every rank has been reaped.
pub(crate) fn stop_all(children: &mut [(usize, Child)], grace: Duration) {
    let signal_all = |children: &mut [(usize, Child)], sig| {
        for (_, c) in children.iter_mut() {
            if matches!(c.try_wait(), Ok(None)) {
                // SAFETY: plain kill(2) on the child's process group (its pgid is its pid).
                unsafe {
                    libc::kill(-(c.id() as libc::pid_t), sig);
                }
            }
        }
    };
    signal_all(children, libc::SIGTERM);
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline && any_running(children) {
        std::thread::sleep(POLL);
    }
    signal_all(children, libc::SIGKILL);
    for (_, c) in children.iter_mut() {
        let _ = c.wait();
    }
}
