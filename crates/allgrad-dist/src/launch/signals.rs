//! SIGINT and SIGTERM while the launcher runs: a handler that only records the signal is
//! installed for the duration of [`launch`](super::launch), and whatever was installed
//! before is put back when it returns (the guard's `Drop`). Launches running at the same
//! time in one process share one installation: the first installs, the last restores.

use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Mutex;

use super::LaunchError;

/// The signals the launcher forwards to its ranks.
pub(crate) const SIGNALS: [libc::c_int; 2] = [libc::SIGINT, libc::SIGTERM];

/// Signal received (0 = none), set by the handler.
static SIGNALLED: AtomicI32 = AtomicI32::new(0);

/// Launches holding the handlers, and the actions they replaced.
struct Installed {
    users: usize,
    previous: Vec<(libc::c_int, libc::sigaction)>,
}

static INSTALLED: Mutex<Installed> = Mutex::new(Installed { users: 0, previous: Vec::new() });

extern "C" fn on_signal(sig: libc::c_int) {
    SIGNALLED.store(sig, Ordering::SeqCst);
}

/// Holds the launcher's handlers; dropping the last guard restores the previous ones.
pub(crate) struct SignalGuard(());

impl SignalGuard {
    /// Installs the handlers (or joins an installation already in place).
    pub(crate) fn install() -> Result<Self, LaunchError> {
        let mut st = INSTALLED.lock().unwrap_or_else(|p| p.into_inner());
        if st.users == 0 {
            SIGNALLED.store(0, Ordering::SeqCst);
            for sig in SIGNALS {
                // SAFETY: a zeroed sigaction is valid; the handler is async-signal-safe (one
                // atomic store) and the structs outlive the calls.
                let prev = unsafe {
                    let mut new: libc::sigaction = std::mem::zeroed();
                    new.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
                    new.sa_flags = libc::SA_RESTART;
                    libc::sigemptyset(&mut new.sa_mask);
                    let mut prev: libc::sigaction = std::mem::zeroed();
                    if libc::sigaction(sig, &new, &mut prev) != 0 {
                        let source = std::io::Error::last_os_error();
                        restore(&mut st.previous);
                        return Err(LaunchError::SignalHandler { signal: sig, source });
                    }
                    prev
                };
                st.previous.push((sig, prev));
            }
        }
        st.users += 1;
        Ok(SignalGuard(()))
    }

    /// The signal received since the handlers were installed, if any.
    pub(crate) fn received(&self) -> Option<i32> {
        Some(SIGNALLED.load(Ordering::SeqCst)).filter(|s| *s != 0)
    }
}

impl Drop for SignalGuard {
    fn drop(&mut self) {
        let mut st = INSTALLED.lock().unwrap_or_else(|p| p.into_inner());
        st.users -= 1;
        if st.users == 0 {
            restore(&mut st.previous);
        }
    }
}

/// Puts back the saved actions, latest first.
fn restore(previous: &mut Vec<(libc::c_int, libc::sigaction)>) {
    while let Some((sig, prev)) = previous.pop() {
        // SAFETY: `prev` is the action sigaction(2) returned for this signal.
        unsafe { libc::sigaction(sig, &prev, std::ptr::null_mut()) };
    }
}
