//! A watchdog for a communicator whose calls cannot time out by themselves (NCCL's: a peer
//! that never joins a collective leaves the others' kernels spinning forever).
//!
//! One thread per communicator. A call is *armed* with a deadline (the group's timeout, i.e.
//! ALLGRAD_TIMEOUT_S) before it is launched and disarmed when it completes. If the deadline
//! passes while the call is armed, the thread marks the communicator aborted and calls
//! [`Abort::abort`] (`ncclCommAbort`), which makes the blocked call return; the waiting
//! caller fails with [`DistError::Timeout`] naming the call, and every later call on the
//! communicator fails at once, naming the call that timed out. The watchdog never aborts
//! between calls, and never before a call's own deadline: each call gets the full timeout.
//! A call whose wait reports an error (the communicator's own, or a peer's failure seen on
//! the TCP mesh) also aborts the communicator, since the collective can no longer complete.
//!
//! It is generic over [`Abort`] so that its state machine is tested on any build, against a
//! fake communicator that hangs (the tests below); the NCCL backend implements [`Abort`] for
//! its communicator.

// Used by the NCCL backend (feature `nccl`); tested in every build.
#![cfg_attr(not(feature = "nccl"), allow(dead_code))]

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{DistError, DistResult};

/// A communicator the watchdog can abort from its own thread while another thread is blocked
/// in it.
pub(crate) trait Abort: Send + Sync + 'static {
    /// Aborts every pending operation; the communicator is unusable afterwards.
    fn abort(&self) -> Result<(), String>;
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Phase {
    Idle,
    Armed { what: String, deadline: Instant },
    Aborted { what: String, why: String },
}

struct State {
    phase: Phase,
    stop: bool,
}

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The watchdog of one communicator (see the module docs). Dropping it stops its thread.
pub(crate) struct Watchdog {
    shared: Arc<Shared>,
    group: String,
    timeout: Duration,
    comm: Arc<dyn Abort>,
    thread: Option<JoinHandle<()>>,
}

/// How long [`Armed::wait`] sleeps between two polls of a call that has not completed.
const POLL_INTERVAL: Duration = Duration::from_micros(50);

impl Watchdog {
    /// Starts the watchdog of `comm`, which belongs to group `group`; calls may take `timeout`.
    pub(crate) fn start<C: Abort>(comm: Arc<C>, group: &str, timeout: Duration) -> DistResult<Watchdog> {
        let shared = Arc::new(Shared { state: Mutex::new(State { phase: Phase::Idle, stop: false }), wake: Condvar::new() });
        let s = shared.clone();
        let name = group.to_string();
        let watched = comm.clone();
        let thread = std::thread::Builder::new()
            .name("allgrad-watchdog".into())
            .spawn(move || watch(&s, watched.as_ref(), &name, timeout))
            .map_err(|e| DistError::io(format!("starting the watchdog of group {group}"), e))?;
        Ok(Watchdog { shared, group: group.to_string(), timeout, comm, thread: Some(thread) })
    }

    /// Arms the watchdog for the call described by `what`, which is about to be launched.
    /// Fails at once, naming the call that timed out, when the communicator was aborted.
    pub(crate) fn arm(&self, what: &str) -> DistResult<Armed<'_>> {
        let mut st = self.shared.lock();
        match &st.phase {
            Phase::Aborted { what: first, why } => return Err(self.poisoned(first, why)),
            Phase::Armed { what: other, .. } => {
                return Err(DistError::Invalid(format!(
                    "{what} on group {}: the communicator is still running {other} (one call at a time)",
                    self.group
                )))
            }
            Phase::Idle => {}
        }
        st.phase = Phase::Armed { what: what.to_string(), deadline: Instant::now() + self.timeout };
        self.shared.wake.notify_all();
        Ok(Armed { dog: self })
    }

    /// The call that timed out and made the watchdog abort the communicator, if any.
    #[cfg(test)]
    pub(crate) fn aborted(&self) -> Option<String> {
        match &self.shared.lock().phase {
            Phase::Aborted { what, .. } => Some(what.clone()),
            _ => None,
        }
    }

    fn poisoned(&self, first: &str, why: &str) -> DistError {
        DistError::Poisoned { group: self.group.clone(), first: format!("{first} {why}, and its NCCL communicator was aborted") }
    }

    fn timed_out(&self, what: &str) -> DistError {
        DistError::Timeout {
            what: format!("in {what} on group {} (the watchdog aborted the communicator)", self.group),
            timeout: self.timeout,
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.wake.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// An armed call: [`Armed::wait`] waits for it; dropping it disarms the watchdog.
pub(crate) struct Armed<'a> {
    dog: &'a Watchdog,
}

impl Armed<'_> {
    /// Polls `done` (is the call complete? it may also report the communicator's errors or a
    /// peer's failure) until it says yes, or until the watchdog aborted the communicator:
    /// then the error is a [`DistError::Timeout`] naming the call. When `done` reports an
    /// error, the communicator is aborted and the error returned. `done` runs under the
    /// watchdog's lock, so the communicator cannot be aborted while `done` is using it.
    pub(crate) fn wait(self, mut done: impl FnMut() -> DistResult<bool>) -> DistResult<()> {
        loop {
            {
                let mut st = self.dog.shared.lock();
                let what = match &st.phase {
                    Phase::Aborted { what, .. } => return Err(self.dog.timed_out(what)),
                    Phase::Armed { what, .. } => what.clone(),
                    Phase::Idle => String::new(),
                };
                match done() {
                    Ok(true) => return Ok(()),
                    Ok(false) => {}
                    Err(e) => {
                        // Marked first, under the lock: no caller touches the communicator after.
                        st.phase = Phase::Aborted { what, why: format!("failed ({e})") };
                        drop(st);
                        if let Err(a) = self.dog.comm.abort() {
                            tracing::error!("group {}: aborting the communicator failed: {a}", self.dog.group);
                        }
                        return Err(e);
                    }
                }
            }
            std::thread::sleep(POLL_INTERVAL);
        }
    }
}

impl Drop for Armed<'_> {
    fn drop(&mut self) {
        let mut st = self.dog.shared.lock();
        if matches!(st.phase, Phase::Armed { .. }) {
            st.phase = Phase::Idle;
        }
    }
}

/// The watchdog thread: sleeps until the armed call's deadline, then aborts.
fn watch<C: Abort + ?Sized>(shared: &Shared, comm: &C, group: &str, timeout: Duration) {
    let mut st = shared.lock();
    loop {
        if st.stop {
            return;
        }
        match &st.phase {
            Phase::Armed { what, deadline } => {
                let now = Instant::now();
                if now >= *deadline {
                    let what = what.clone();
                    // Marked first, under the lock: no caller touches the communicator after.
                    st.phase = Phase::Aborted { what: what.clone(), why: format!("timed out after {timeout:?}") };
                    drop(st);
                    tracing::error!("group {group}: {what} passed its deadline; aborting the communicator");
                    if let Err(e) = comm.abort() {
                        tracing::error!("group {group}: aborting the communicator failed: {e}");
                    }
                    st = shared.lock();
                } else {
                    let wait = *deadline - now;
                    st = shared.wake.wait_timeout(st, wait).unwrap_or_else(|p| p.into_inner()).0;
                }
            }
            Phase::Idle | Phase::Aborted { .. } => st = shared.wake.wait(st).unwrap_or_else(|p| p.into_inner()),
        }
    }
}

/// Runs `call`, a blocking call that has no timeout of its own and that no abort can end
/// (NCCL's `ncclCommInitRank`: it waits for every member of the communicator), on a thread of
/// its own, and waits for it at most `timeout`, asking `peer_failed` meanwhile whether a peer
/// has already failed. On time-out or a peer's failure the caller gets the error at once; the
/// call's thread is left blocked (it holds only what `call` owns), and whatever `call` returns
/// later is dropped. The caller's group is poisoned by the error, as for any failed call.
pub(crate) fn bounded<T: Send + 'static>(
    what: &str,
    group: &str,
    timeout: Duration,
    mut peer_failed: impl FnMut() -> Option<DistError>,
    call: impl FnOnce() -> DistResult<T> + Send + 'static,
) -> DistResult<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("allgrad-bounded".into())
        .spawn(move || {
            // The receiver is gone when the caller gave up waiting: nothing left to tell.
            let _ = tx.send(call());
        })
        .map_err(|e| DistError::io(format!("starting a thread for {what} on group {group}"), e))?;
    let deadline = Instant::now() + timeout;
    loop {
        match rx.recv_timeout(Duration::from_millis(20)) {
            Ok(result) => return result,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Err(DistError::Invalid(format!("{what} on group {group}: the call's thread ended without a result")))
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
        }
        if let Some(e) = peer_failed() {
            return Err(e);
        }
        if Instant::now() >= deadline {
            return Err(DistError::Timeout { what: format!("in {what} on group {group} (the call is left blocked)"), timeout });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A communicator whose calls never complete by themselves: they end only when aborted.
    #[derive(Default)]
    struct Hanging {
        aborts: AtomicUsize,
    }
    impl Abort for Hanging {
        fn abort(&self) -> Result<(), String> {
            self.aborts.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
    }

    const CALL: &str = "all_reduce(Sum) of F32 [4]";

    #[test]
    fn a_hung_call_is_aborted_at_its_deadline_and_fails_naming_the_call() {
        let comm = Arc::new(Hanging::default());
        let dog = Watchdog::start(comm.clone(), "world", Duration::from_millis(200)).unwrap();
        let t0 = Instant::now();
        let e = dog.arm(CALL).unwrap().wait(|| Ok(false)).unwrap_err();
        let waited = t0.elapsed();
        assert!(matches!(e, DistError::Timeout { .. }), "{e:?}");
        let msg = e.to_string();
        assert!(msg.contains(CALL) && msg.contains("group world") && msg.contains("ALLGRAD_TIMEOUT_S"), "{msg}");
        assert!(waited >= Duration::from_millis(200), "aborted after {waited:?}, before the deadline");
        assert_eq!(comm.aborts.load(Ordering::SeqCst), 1);
        assert_eq!(dog.aborted().as_deref(), Some(CALL));
    }

    #[test]
    fn after_an_abort_every_later_call_fails_at_once_naming_the_call_that_hung() {
        let comm = Arc::new(Hanging::default());
        let dog = Watchdog::start(comm.clone(), "world/1", Duration::from_millis(50)).unwrap();
        assert!(dog.arm(CALL).unwrap().wait(|| Ok(false)).is_err());
        let e = dog.arm("broadcast(src 0) of F32 [2]").err().expect("an aborted communicator takes no call");
        assert!(matches!(e, DistError::Poisoned { .. }), "{e:?}");
        assert!(e.to_string().contains(CALL) && e.to_string().contains("world/1") && e.to_string().contains("timed out"), "{e}");
        // The communicator is aborted once, not once per call.
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(comm.aborts.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn calls_that_complete_in_time_are_never_aborted_and_each_gets_the_whole_timeout() {
        let comm = Arc::new(Hanging::default());
        let timeout = Duration::from_millis(300);
        let dog = Watchdog::start(comm.clone(), "world", timeout).unwrap();
        let t0 = Instant::now();
        // Six calls of 100 ms each: together twice the timeout, each well within it.
        for i in 0..6 {
            let started = Instant::now();
            dog.arm(&format!("call {i}")).unwrap().wait(|| Ok(started.elapsed() >= Duration::from_millis(100))).unwrap();
        }
        assert!(t0.elapsed() >= 2 * timeout);
        // Idle time between calls does not count either.
        std::thread::sleep(timeout + Duration::from_millis(100));
        assert_eq!(comm.aborts.load(Ordering::SeqCst), 0);
        assert_eq!(dog.aborted(), None);
        dog.arm("after a long idle").unwrap().wait(|| Ok(true)).unwrap();
    }

    #[test]
    fn an_error_seen_while_waiting_aborts_at_once_and_poisons_later_calls() {
        let comm = Arc::new(Hanging::default());
        let dog = Watchdog::start(comm.clone(), "world", Duration::from_secs(3600)).unwrap();
        let t0 = Instant::now();
        let mut polls = 0;
        let e = dog
            .arm(CALL)
            .unwrap()
            .wait(|| {
                polls += 1;
                if polls < 20 {
                    Ok(false)
                } else {
                    Err(DistError::PeerAborted { peer: 1, group: "world".into(), reason: "rank 1 failed: out of memory".into() })
                }
            })
            .unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(60), "the error must not wait for the deadline");
        assert!(e.to_string().contains("out of memory"), "{e}");
        // The hung collective cannot complete: the communicator is aborted, once.
        assert_eq!(comm.aborts.load(Ordering::SeqCst), 1);
        let later = dog.arm("barrier").err().expect("an aborted communicator takes no call").to_string();
        assert!(later.contains(CALL) && later.contains("out of memory"), "{later}");
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(comm.aborts.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_second_call_while_one_is_armed_is_refused_naming_both() {
        let dog = Watchdog::start(Arc::new(Hanging::default()), "world", Duration::from_secs(10)).unwrap();
        let first = dog.arm(CALL).unwrap();
        let e = dog.arm("barrier").err().unwrap().to_string();
        assert!(e.contains("barrier") && e.contains(CALL), "{e}");
        drop(first);
        dog.arm("barrier").unwrap().wait(|| Ok(true)).unwrap();
    }

    #[test]
    fn dropping_the_watchdog_stops_its_thread_and_releases_the_communicator() {
        let comm = Arc::new(Hanging::default());
        let dog = Watchdog::start(comm.clone(), "world", Duration::from_secs(3600)).unwrap();
        dog.arm(CALL).unwrap().wait(|| Ok(true)).unwrap();
        // This test's, the watchdog's and its thread's.
        assert_eq!(Arc::strong_count(&comm), 3);
        drop(dog);
        assert_eq!(Arc::strong_count(&comm), 1);
        assert_eq!(comm.aborts.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_bounded_call_that_returns_gives_its_result() {
        let r = bounded("ncclCommInitRank", "g", Duration::from_secs(5), || None, || Ok(7));
        assert_eq!(r.unwrap(), 7);
        let e =
            bounded::<()>("ncclCommInitRank", "g", Duration::from_secs(5), || None, || Err(DistError::Invalid("refused".into())));
        assert!(e.unwrap_err().to_string().contains("refused"));
    }

    #[test]
    fn a_bounded_call_that_never_returns_times_out_naming_it() {
        let start = Instant::now();
        let e = bounded::<()>(
            "ncclCommInitRank",
            "world",
            Duration::from_millis(300),
            || None,
            || {
                std::thread::sleep(Duration::from_secs(3600));
                Ok(())
            },
        )
        .unwrap_err();
        let waited = start.elapsed();
        assert!(waited >= Duration::from_millis(300) && waited < Duration::from_secs(10), "waited {waited:?}");
        assert!(matches!(e, DistError::Timeout { .. }), "{e:?}");
        let msg = e.to_string();
        assert!(msg.contains("ncclCommInitRank") && msg.contains("group world") && msg.contains("ALLGRAD_TIMEOUT_S"), "{msg}");
    }

    #[test]
    fn a_bounded_call_ends_at_once_when_a_peer_failed() {
        let start = Instant::now();
        let mut polls = 0;
        let e = bounded::<()>(
            "ncclCommInitRank",
            "world",
            Duration::from_secs(3600),
            || {
                polls += 1;
                (polls == 3).then(|| DistError::Invalid("rank 1 failed".into()))
            },
            || {
                std::thread::sleep(Duration::from_secs(3600));
                Ok(())
            },
        )
        .unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(10), "waited {:?}", start.elapsed());
        assert!(e.to_string().contains("rank 1 failed"), "{e}");
    }
}
