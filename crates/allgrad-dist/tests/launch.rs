//! The launcher as a library, in this process: typed errors that name what failed, and the
//! SIGINT/SIGTERM handlers it installs being in force while it runs and replaced by the
//! previous ones when it returns. (The launcher as a program is tested in the `allgrad`
//! crate's tests/repo/launch.rs.)

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use allgrad_dist::launch::{launch, LaunchConfig, LaunchError, Outcome};

/// The tests of this file change process-wide signal dispositions: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn cfg(nproc_per_node: usize, program: &[&str]) -> LaunchConfig {
    LaunchConfig {
        grace: Duration::from_secs(1),
        ..LaunchConfig::new(nproc_per_node, program.iter().map(|s| s.to_string()).collect())
    }
}

fn handler_of(sig: libc::c_int) -> libc::sighandler_t {
    // SAFETY: queries the action only (null new action); `old` is a valid out-parameter.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        assert_eq!(libc::sigaction(sig, std::ptr::null(), &mut old), 0);
        old.sa_sigaction
    }
}

fn set_handler(sig: libc::c_int, handler: libc::sighandler_t) {
    // SAFETY: installs `handler` (SIG_IGN or `ours`, which only stores to an atomic).
    unsafe {
        let mut new: libc::sigaction = std::mem::zeroed();
        new.sa_sigaction = handler;
        libc::sigemptyset(&mut new.sa_mask);
        assert_eq!(libc::sigaction(sig, &new, std::ptr::null_mut()), 0);
    }
}

static OURS_GOT: AtomicI32 = AtomicI32::new(0);

extern "C" fn ours(sig: libc::c_int) {
    OURS_GOT.store(sig, Ordering::SeqCst);
}

#[test]
fn invalid_configs_and_unstartable_programs_are_typed_errors_naming_them() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let e = launch(&cfg(0, &["true"])).unwrap_err();
    assert!(matches!(e, LaunchError::EmptyWorld { nproc_per_node: 0, nnodes: 1 }), "{e:?}");
    assert_eq!(e.to_string(), "--nproc-per-node (0) and --nnodes (1) must be at least 1");

    let e = launch(&cfg(2, &["/nonexistent/allgrad-program"])).unwrap_err();
    match &e {
        LaunchError::Spawn { rank: 0, program, source } => {
            assert_eq!(program, "/nonexistent/allgrad-program");
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        }
        other => panic!("expected a Spawn error for rank 0, got {other:?}"),
    }
    assert!(e.to_string().starts_with("starting rank 0: /nonexistent/allgrad-program: "), "{e}");
}

#[test]
fn the_launchers_handlers_catch_sigint_while_it_runs_and_the_previous_ones_come_back() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let ours_ptr = ours as extern "C" fn(libc::c_int) as libc::sighandler_t;
    set_handler(libc::SIGINT, ours_ptr);
    set_handler(libc::SIGTERM, libc::SIG_IGN);
    OURS_GOT.store(0, Ordering::SeqCst);

    // The rank's parent is this process: its SIGINT must reach the launcher's handler (which
    // stops the rank), not ours (which would leave the rank sleeping until it ends).
    let outcome = launch(&cfg(1, &["sh", "-c", "kill -INT $PPID; exec sleep 20"])).unwrap();
    assert_eq!(outcome, Outcome::Interrupted(libc::SIGINT));
    assert_eq!(OURS_GOT.load(Ordering::SeqCst), 0, "the previous handler ran while launch was running");

    assert_eq!(handler_of(libc::SIGINT), ours_ptr, "SIGINT handler not restored");
    assert_eq!(handler_of(libc::SIGTERM), libc::SIG_IGN, "SIGTERM disposition not restored");
    // Ours is really back in force.
    // SAFETY: signalling this process; `ours` only stores to an atomic.
    unsafe { libc::raise(libc::SIGINT) };
    assert_eq!(OURS_GOT.load(Ordering::SeqCst), libc::SIGINT);
    set_handler(libc::SIGINT, libc::SIG_DFL);
    set_handler(libc::SIGTERM, libc::SIG_DFL);
}

#[test]
fn a_second_launch_after_an_interrupted_one_is_not_interrupted() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    set_handler(libc::SIGINT, libc::SIG_IGN);
    let first = launch(&cfg(1, &["sh", "-c", "kill -INT $PPID; exec sleep 20"])).unwrap();
    assert_eq!(first, Outcome::Interrupted(libc::SIGINT));
    let second = launch(&cfg(2, &["sh", "-c", "sleep 0.2; exit 0"])).unwrap();
    assert_eq!(second, Outcome::Success);
    set_handler(libc::SIGINT, libc::SIG_DFL);
}

/// The launcher copies every rank's output on one thread: its threads do not grow with the
/// number of ranks (a thread per pipe made it hold two per rank, and each later fork copied
/// the mappings of them all).
#[test]
fn the_launcher_holds_as_many_threads_for_32_ranks_as_for_one() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let threads = || std::fs::read_dir("/proc/self/task").map(|d| d.count()).unwrap_or(0);
    let before = threads();
    let (most, done) = (AtomicUsize::new(0), AtomicBool::new(false));
    std::thread::scope(|s| {
        s.spawn(|| {
            while !done.load(Ordering::SeqCst) {
                most.fetch_max(threads(), Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        let outcome = launch(&cfg(32, &["sh", "-c", "sleep 0.5"]));
        done.store(true, Ordering::SeqCst);
        assert_eq!(outcome.unwrap(), Outcome::Success);
    });
    // The sampling thread, the output thread, and room for a thread of the test harness
    // starting meanwhile; two per rank would be 64 more.
    let grew = most.load(Ordering::SeqCst).saturating_sub(before);
    assert!(grew <= 4, "the launcher of 32 ranks ran with {grew} more threads than before it started");
}
