//! A torchrun-style launcher: starts the ranks of one node as child processes.
//!
//! Each child gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
//! and ALLGRAD_JOB_TOKEN; its output lines are prefixed with its rank. When one rank fails
//! the others are stopped (SIGTERM, then SIGKILL after a grace period) and the launcher exits
//! with the failing rank's code. SIGINT/SIGTERM sent to the launcher reach every rank. Each
//! rank runs in its own process group (so its own children are stopped with it) and is
//! killed by the kernel if the launcher itself dies, so no process is ever left behind.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What to launch, and where this node sits in the job.
#[derive(Clone, Debug)]
pub struct LaunchConfig {
    /// Ranks to start on this node.
    pub nproc_per_node: usize,
    /// Nodes in the job.
    pub nnodes: usize,
    /// This node's index, `0..nnodes`.
    pub node_rank: usize,
    /// Host of rank 0 (its rendezvous store).
    pub master_addr: String,
    /// Port of rank 0's rendezvous store; 0 picks a free one (single node only).
    pub master_port: u16,
    /// Local ranks whose output is shown (all when `None`).
    pub ranks_filter: Option<Vec<usize>>,
    /// Prefix each output line with `[rankN]: `.
    pub prefix: bool,
    /// Time between SIGTERM and SIGKILL when stopping ranks.
    pub grace: Duration,
    /// The program and its arguments.
    pub program: Vec<String>,
}

/// Signal received by the launcher (0 = none), set by the handler.
static SIGNALLED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    SIGNALLED.store(sig, Ordering::SeqCst);
}

/// How the job ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Every rank exited with status 0.
    Success,
    /// A rank failed first; the others were stopped.
    RankFailed {
        /// Global rank of the first failing process.
        rank: usize,
        /// Its exit code (128 + signal number when killed by a signal).
        code: i32,
    },
    /// The launcher was interrupted by a signal and stopped every rank.
    Interrupted(i32),
}

impl Outcome {
    /// The launcher's exit code.
    pub fn exit_code(&self) -> i32 {
        match self {
            Outcome::Success => 0,
            Outcome::RankFailed { code, .. } => (*code).max(1),
            Outcome::Interrupted(sig) => 128 + sig,
        }
    }
}

fn code_of(status: ExitStatus) -> i32 {
    status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

/// Starts the ranks and supervises them until they all end; see the module docs.
pub fn launch(cfg: &LaunchConfig) -> anyhow::Result<Outcome> {
    use anyhow::{bail, Context};
    if cfg.nproc_per_node == 0 || cfg.nnodes == 0 {
        bail!("--nproc-per-node and --nnodes must be at least 1");
    }
    if cfg.node_rank >= cfg.nnodes {
        bail!("--node-rank {} is not below --nnodes {}", cfg.node_rank, cfg.nnodes);
    }
    let Some((prog, args)) = cfg.program.split_first() else { bail!("no program to launch") };
    let world = cfg.nproc_per_node * cfg.nnodes;
    let port = if cfg.master_port != 0 {
        cfg.master_port
    } else if cfg.nnodes == 1 {
        free_port()?
    } else {
        bail!("--master-port is required with more than one node")
    };
    let token = match std::env::var("ALLGRAD_JOB_TOKEN") {
        Ok(t) if !t.is_empty() => Some(t),
        _ if cfg.nnodes == 1 => Some(format!("{:032x}", rand::random::<u128>())),
        _ => {
            eprintln!("launch: ALLGRAD_JOB_TOKEN is not set; with several nodes every node needs the same secret, so ranks will derive a weak one (set ALLGRAD_JOB_TOKEN on every node)");
            None
        }
    };

    // SAFETY: installing an async-signal-safe handler (one atomic store).
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }

    let out_lock = Arc::new(Mutex::new(()));
    let mut children: Vec<(usize, Child)> = Vec::with_capacity(cfg.nproc_per_node);
    let mut pumps = Vec::new();
    for local in 0..cfg.nproc_per_node {
        let rank = cfg.node_rank * cfg.nproc_per_node + local;
        let mut cmd = Command::new(prog);
        cmd.args(args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_WORLD_SIZE", cfg.nproc_per_node.to_string())
            .env("GROUP_RANK", cfg.node_rank.to_string())
            .env("MASTER_ADDR", &cfg.master_addr)
            .env("MASTER_PORT", port.to_string())
            .env("ALLGRAD_LAUNCHED", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(t) = &token {
            cmd.env("ALLGRAD_JOB_TOKEN", t);
        }
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                // Own process group: the whole tree of this rank can be signalled at once.
                libc::setpgid(0, 0);
                // Die with the launcher, even if it is killed with SIGKILL.
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                if libc::getppid() == 1 {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
        let mut child = match cmd.spawn().with_context(|| format!("starting rank {rank}: {prog}")) {
            Ok(c) => c,
            Err(e) => {
                stop_all(&mut children, cfg.grace);
                return Err(e);
            }
        };
        let show = cfg.ranks_filter.as_ref().map(|f| f.contains(&local)).unwrap_or(true);
        let stdout = child.stdout.take().expect("piped");
        let stderr = child.stderr.take().expect("piped");
        let prefix = if cfg.prefix { format!("[rank{rank}]: ") } else { String::new() };
        pumps.push(pump(stdout, prefix.clone(), show, false, out_lock.clone()));
        pumps.push(pump(stderr, prefix, show, true, out_lock.clone()));
        children.push((rank, child));
    }

    let outcome = loop {
        let sig = SIGNALLED.load(Ordering::SeqCst);
        if sig != 0 {
            eprintln!("launch: received signal {sig}; stopping all ranks");
            stop_all(&mut children, cfg.grace);
            break Outcome::Interrupted(sig);
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
            stop_all(&mut children, cfg.grace);
            break Outcome::RankFailed { rank, code };
        }
        if running == 0 {
            break Outcome::Success;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    for p in pumps {
        let _ = p.join();
    }
    Ok(outcome)
}

/// SIGTERM to every running rank's process group, then SIGKILL to those left after `grace`.
fn stop_all(children: &mut [(usize, Child)], grace: Duration) {
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
    while Instant::now() < deadline && children.iter_mut().any(|(_, c)| matches!(c.try_wait(), Ok(None))) {
        std::thread::sleep(Duration::from_millis(20));
    }
    signal_all(children, libc::SIGKILL);
    for (_, c) in children.iter_mut() {
        let _ = c.wait();
    }
}

/// Copies a child's output to ours, a line at a time, after `prefix`.
fn pump(
    src: impl Read + Send + 'static,
    prefix: String,
    show: bool,
    is_err: bool,
    lock: Arc<Mutex<()>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(src);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) if !show => {}
                Ok(_) => {
                    if !line.ends_with(b"\n") {
                        line.push(b'\n');
                    }
                    let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
                    let res = if is_err {
                        let mut e = std::io::stderr().lock();
                        e.write_all(prefix.as_bytes()).and_then(|_| e.write_all(&line))
                    } else {
                        let mut o = std::io::stdout().lock();
                        o.write_all(prefix.as_bytes()).and_then(|_| o.write_all(&line)).and_then(|_| o.flush())
                    };
                    if res.is_err() {
                        return;
                    }
                }
            }
        }
    })
}

/// A free TCP port on loopback (bound, read, released).
pub fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}
