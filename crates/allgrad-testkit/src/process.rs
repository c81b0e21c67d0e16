//! Child processes under a watchdog: every wait of a multi-process test is bounded.
//!
//! [`spawn`] starts a command in a process group of its own with its output read by two
//! threads; [`Watched::wait`] waits for it up to a limit. When the limit passes, the child,
//! its process group and every process descended from it are killed (SIGKILL) and the test
//! fails with a message that says what was running, for how long, and what it had printed.
//! After the child exits, its output must close within [`PIPE_GRACE`]: a descendant that
//! outlives it and keeps the pipes open fails the test the same way (instead of hanging the
//! read, as `wait_with_output` would).

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long the output of an exited child may stay open (held by a surviving descendant).
pub const PIPE_GRACE: Duration = Duration::from_secs(10);

/// Fields 3 onwards of `/proc/<pid>/stat` (after `pid (comm)`, whose command may hold
/// spaces and parentheses): state, ppid, ...
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let close = stat.rfind(')')?;
    Some(stat[close + 1..].split_whitespace().map(String::from).collect())
}

/// When process `pid` started (clock ticks since boot), to tell it from a later process that
/// reuses its id.
fn start_time(pid: u32) -> Option<u64> {
    stat_fields(pid)?.get(19)?.parse().ok()
}

/// The processes descended from `pid` (children, their children, ...), from `/proc`.
pub fn descendants(pid: u32) -> Vec<u32> {
    let mut parent_of = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Some(p) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
            let Some(ppid) = stat_fields(p).and_then(|f| f.get(1)?.parse::<u32>().ok()) else { continue };
            parent_of.push((p, ppid));
        }
    }
    let mut found = vec![pid];
    let mut i = 0;
    while i < found.len() {
        let p = found[i];
        found.extend(parent_of.iter().filter(|(_, pp)| *pp == p).map(|(c, _)| *c));
        i += 1;
    }
    found.remove(0);
    found
}

/// SIGKILLs `pid`, every process descended from it, and its process group when it leads one.
pub fn kill_tree(pid: u32) {
    // SAFETY: getpgid(2) on a process id; no memory is involved.
    let leads = unsafe { libc::getpgid(pid as libc::pid_t) } == pid as libc::pid_t;
    kill_all(pid, leads);
}

/// SIGKILLs `pid`, its descendants, and process group `pid` when `group` (a group outlives
/// its leader: the leader may be gone while processes of its group still run).
fn kill_all(pid: u32, group: bool) {
    let below = descendants(pid);
    // SAFETY: kill(2) on process ids; no memory is involved.
    unsafe {
        if group {
            libc::kill(-(pid as libc::pid_t), libc::SIGKILL);
        }
        libc::kill(pid as libc::pid_t, libc::SIGKILL);
        for p in below {
            libc::kill(p as libc::pid_t, libc::SIGKILL);
        }
    }
}

/// Processes seen descending from a child, by id and start time: after the child exits they
/// are reparented out of its tree, and a process group of their own (as `launch` gives each
/// rank) takes them out of its group, but they may still hold its output.
#[derive(Default)]
struct Seen(Vec<(u32, u64)>);

impl Seen {
    fn look(&mut self, pid: u32) {
        for p in descendants(pid) {
            if !self.0.iter().any(|(q, _)| *q == p) {
                if let Some(t) = start_time(p) {
                    self.0.push((p, t));
                }
            }
        }
    }

    /// SIGKILLs those still running (the same process: same id and start time).
    fn kill(&self) {
        for &(p, t) in &self.0 {
            if start_time(p) == Some(t) {
                // SAFETY: kill(2) on a process id; no memory is involved.
                unsafe { libc::kill(p as libc::pid_t, libc::SIGKILL) };
            }
        }
    }
}

/// A child started by [`spawn`], its stdout and stderr read by threads. Dropped before it was
/// waited for (a test that failed meanwhile), it is killed with everything it started.
pub struct Watched {
    child: Child,
    what: String,
    limit: Duration,
    grace: Duration,
    started: Instant,
    stdout: Receiver<Vec<u8>>,
    stderr: Receiver<Vec<u8>>,
    seen: Seen,
    reaped: bool,
}

impl Drop for Watched {
    fn drop(&mut self) {
        if !self.reaped {
            kill_all(self.child.id(), true);
            self.seen.kill();
            let _ = self.child.wait();
        }
    }
}

fn reader(pipe: Option<impl Read + Send + 'static>) -> Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        if let Some(mut p) = pipe {
            let _ = p.read_to_end(&mut bytes);
        }
        let _ = tx.send(bytes);
    });
    rx
}

/// Starts `cmd` in a process group of its own, stdout and stderr captured (stdin as the
/// command says), to be waited for with [`Watched::wait`] within `limit`. `what` names it in
/// failure messages.
///
/// # Panics
/// When the command cannot be started.
pub fn spawn(cmd: &mut Command, what: &str, limit: Duration) -> Watched {
    let mut child = cmd
        .process_group(0)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
    let (stdout, stderr) = (reader(child.stdout.take()), reader(child.stderr.take()));
    Watched {
        child,
        what: what.to_string(),
        limit,
        grace: PIPE_GRACE,
        started: Instant::now(),
        stdout,
        stderr,
        seen: Seen::default(),
        reaped: false,
    }
}

impl Watched {
    /// The child's process id (also its process group id).
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// How long the output may stay open after the child exited ([`PIPE_GRACE`] unless set).
    pub fn pipe_grace(mut self, grace: Duration) -> Watched {
        self.grace = grace;
        self
    }

    /// The child, for its stdin.
    pub fn child_mut(&mut self) -> &mut Child {
        &mut self.child
    }

    /// Waits for the child and its output; see [`Watched::wait_ticking`].
    pub fn wait(self) -> (Output, Duration) {
        self.wait_ticking(|_| {})
    }

    /// Waits for the child to exit and its output to close, running `tick(pid)` every few
    /// milliseconds meanwhile. Returns the output and how long the child ran.
    ///
    /// # Panics
    /// When the child runs past the limit, or its output stays open [`PIPE_GRACE`] after it
    /// exited: everything it started is killed first, and the message holds what it printed.
    pub fn wait_ticking(mut self, mut tick: impl FnMut(u32)) -> (Output, Duration) {
        let pid = self.child.id();
        let mut looked = Instant::now();
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap_or_else(|e| panic!("waiting for {}: {e}", self.what)) {
                self.reaped = true;
                break s;
            }
            if looked.elapsed() > Duration::from_millis(100) {
                self.seen.look(pid);
                looked = Instant::now();
            }
            if self.started.elapsed() > self.limit {
                kill_all(pid, true);
                self.seen.kill();
                let _ = self.child.wait();
                self.reaped = true;
                let out = self.collect(Duration::from_secs(2));
                panic!(
                    "watchdog: {} (pid {pid}) still running after {:?}; killed it and its processes\n{out}",
                    self.what, self.limit
                );
            }
            tick(pid);
            std::thread::sleep(Duration::from_millis(5));
        };
        let ran = self.started.elapsed();
        let deadline = Instant::now() + self.grace;
        let left = || deadline.saturating_duration_since(Instant::now());
        let stdout = self.stdout.recv_timeout(left());
        let stderr = self.stderr.recv_timeout(left());
        match (stdout, stderr) {
            (Ok(stdout), Ok(stderr)) => (Output { status, stdout, stderr }, ran),
            _ => {
                // The child is reaped (its id may be reused): only its group and the processes
                // seen under it, by start time.
                // SAFETY: kill(2) on a process group id; no memory is involved.
                unsafe { libc::kill(-(pid as libc::pid_t), libc::SIGKILL) };
                self.seen.kill();
                panic!(
                    "watchdog: {} (pid {pid}) exited with {status}, but its output was still open {:?} later: \
                     processes it started outlived it (killed now, with its process group)",
                    self.what, self.grace
                );
            }
        }
    }

    /// What the reader threads hold within `limit` (after the child was killed), as text.
    fn collect(&self, limit: Duration) -> String {
        let get = |rx: &Receiver<Vec<u8>>| match rx.recv_timeout(limit) {
            Ok(b) => String::from_utf8_lossy(&b).into_owned(),
            Err(RecvTimeoutError::Timeout) => "(still open)".into(),
            Err(RecvTimeoutError::Disconnected) => "(lost)".into(),
        };
        format!("stdout:\n{}\nstderr:\n{}", get(&self.stdout), get(&self.stderr))
    }
}

/// Spawns `cmd` with [`spawn`] and waits with [`Watched::wait`].
pub fn run(cmd: &mut Command, what: &str, limit: Duration) -> (Output, Duration) {
    spawn(cmd, what, limit).wait()
}

/// Waits for a child the test started itself, up to `limit`; past it, kills the child and
/// everything it started and fails the test naming `what`.
pub fn wait_exit(child: &mut Child, what: &str, limit: Duration) -> ExitStatus {
    let t = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap_or_else(|e| panic!("waiting for {what}: {e}")) {
            return s;
        }
        if t.elapsed() > limit {
            kill_tree(child.id());
            let _ = child.wait();
            panic!("watchdog: {what} (pid {}) still running after {limit:?}; killed it", child.id());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Receives from `rx` within `limit`, or fails the test naming `what` (a bounded join of a
/// thread that sends its result).
pub fn recv_within<T>(rx: &Receiver<T>, what: &str, limit: Duration) -> T {
    match rx.recv_timeout(limit) {
        Ok(v) => v,
        Err(RecvTimeoutError::Timeout) => panic!("watchdog: {what} not done after {limit:?}"),
        Err(RecvTimeoutError::Disconnected) => panic!("{what} ended without a result (its thread panicked)"),
    }
}

/// Kills process `pid` and everything it started if it is still running after `limit`,
/// unless dropped first: for a child whose output the test reads itself.
pub struct Watchdog(Arc<AtomicBool>);

impl Watchdog {
    /// Starts watching `pid` (named `what` in the message printed when it fires).
    pub fn start(pid: u32, what: &str, limit: Duration) -> Watchdog {
        let done = Arc::new(AtomicBool::new(false));
        let d = done.clone();
        let what = what.to_string();
        std::thread::spawn(move || {
            let t = Instant::now();
            while !d.load(Ordering::SeqCst) {
                if t.elapsed() > limit {
                    eprintln!("watchdog: killing {what} (pid {pid}) and its processes after {limit:?}");
                    kill_tree(pid);
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        Watchdog(done)
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}
