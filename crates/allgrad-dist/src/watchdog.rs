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
    Aborted { what: String },
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
        let thread = std::thread::Builder::new()
            .name("allgrad-watchdog".into())
            .spawn(move || watch(&s, comm.as_ref(), &name))
            .map_err(|e| DistError::io(format!("starting the watchdog of group {group}"), e))?;
        Ok(Watchdog { shared, group: group.to_string(), timeout, thread: Some(thread) })
    }

    /// Arms the watchdog for the call described by `what`, which is about to be launched.
    /// Fails at once, naming the call that timed out, when the communicator was aborted.
    pub(crate) fn arm(&self, what: &str) -> DistResult<Armed<'_>> {
        let mut st = self.shared.lock();
        match &st.phase {
            Phase::Aborted { what: first } => return Err(self.poisoned(first)),
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
            Phase::Aborted { what } => Some(what.clone()),
            _ => None,
        }
    }

    fn poisoned(&self, first: &str) -> DistError {
        DistError::Poisoned {
            group: self.group.clone(),
            first: format!("{first} timed out after {:?} and the watchdog aborted the communicator", self.timeout),
        }
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
    /// Polls `done` (is the call complete? it may also report the communicator's own errors)
    /// until it says yes, or until the watchdog aborted the communicator: then the error is a
    /// [`DistError::Timeout`] naming the call. `done` runs under the watchdog's lock, so the
    /// communicator cannot be aborted while `done` is using it.
    pub(crate) fn wait(self, mut done: impl FnMut() -> DistResult<bool>) -> DistResult<()> {
        loop {
            {
                let st = self.dog.shared.lock();
                if let Phase::Aborted { what } = &st.phase {
                    return Err(self.dog.timed_out(what));
                }
                if done()? {
                    return Ok(());
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
fn watch<C: Abort + ?Sized>(shared: &Shared, comm: &C, group: &str) {
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
                    st.phase = Phase::Aborted { what: what.clone() };
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
        assert!(e.to_string().contains(CALL) && e.to_string().contains("world/1"), "{e}");
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
    fn an_error_reported_while_waiting_is_returned_and_disarms() {
        let comm = Arc::new(Hanging::default());
        let dog = Watchdog::start(comm.clone(), "world", Duration::from_millis(100)).unwrap();
        let e = dog.arm(CALL).unwrap().wait(|| Err(DistError::Invalid("remote error".into()))).unwrap_err();
        assert_eq!(e.to_string(), "remote error");
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(comm.aborts.load(Ordering::SeqCst), 0, "a call that ended with an error must be disarmed");
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
        assert_eq!(Arc::strong_count(&comm), 2);
        drop(dog);
        assert_eq!(Arc::strong_count(&comm), 1);
        assert_eq!(comm.aborts.load(Ordering::SeqCst), 0);
    }
}
