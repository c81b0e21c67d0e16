//! The shared-memory path between real processes: this test binary starts copies of itself
//! as ranks (the `child_rank` test, which does nothing unless ALLGRAD_TEST_CHILD is set) with
//! the launcher variables, as torchrun would.
//!
//! - Ranks on one host map one segment whose name is already gone (`/proc/PID/maps` shows it
//!   deleted), and get bitwise the same all_reduce, all_gather and reduce_scatter results as
//!   with ALLGRAD_SHM=0 in their environment (exact data), which keeps them on TCP; one rank
//!   with ALLGRAD_SHM=0 is enough.
//! - A rank killed with SIGKILL while the ranks loop over all_reduce calls makes every other
//!   rank fail within seconds, naming it: large calls through shared memory, large calls over
//!   the TCP ring (ALLGRAD_SHM=0), and small calls on the TCP direct path; W = 2, 3, 4.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use allgrad_dist::{ProcessGroup, ReduceOp};

const N: usize = 1 << 20;

/// A 64-bit digest of `bytes` (the workspace's one hash).
fn fnv(bytes: &[u8]) -> u64 {
    let h = allgrad_rng::hash128(&[bytes]);
    u64::from_le_bytes(h[..8].try_into().unwrap())
}

/// Rank r's input: small integers (every sum exact in f32), different on every rank.
fn input(r: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 31 + r * 17) % 23) as f32 - 11.0).collect()
}

/// What a child rank does, by ALLGRAD_TEST_CHILD. A child helper, not a test: ignored, so
/// that it does not count as a passed test, and run as each rank with `--ignored --exact`.
#[test]
#[ignore = "child helper: run as the ranks of this file's tests"]
fn child_rank() {
    let Ok(mode) = std::env::var("ALLGRAD_TEST_CHILD") else { return };
    let say = |line: String| {
        let mut out = std::io::stdout().lock();
        writeln!(out, "CHILD: {line}").unwrap();
        out.flush().unwrap();
    };
    let pg = ProcessGroup::from_env().expect("joining");
    let (w, r) = (pg.world_size(), pg.rank());
    let res: Result<(), String> = (|| {
        match mode.as_str() {
            "digest" => {
                let mut x = input(r, N);
                pg.all_reduce_slice(&mut x, ReduceOp::Sum).map_err(|e| e.to_string())?;
                let g = pg.all_gather_slice(&input(r, N / 2 + 3)).map_err(|e| e.to_string())?;
                let counts: Vec<usize> = (0..w).map(|j| N / 4 + j).collect();
                let rs =
                    pg.reduce_scatter_slice(&input(r, counts.iter().sum()), ReduceOp::Max, &counts).map_err(|e| e.to_string())?;
                // The same on every rank, and this rank's own block.
                let common = fnv(bytemuck::cast_slice(&x)) ^ fnv(bytemuck::cast_slice(&g)).rotate_left(7);
                let own = fnv(bytemuck::cast_slice(&rs));
                say(format!("digest {common:016x} {own:016x} shm {}", pg.shared_memory()));
                // Wait for the parent to look at this process's mappings.
                let mut line = String::new();
                std::io::stdin().read_line(&mut line).unwrap();
                pg.barrier().map_err(|e| e.to_string())
            }
            "loop" | "loop_small" => {
                let mut x = input(r, if mode == "loop" { 2 * N } else { 4 });
                for k in 0.. {
                    if k == 3 {
                        say("looping".into());
                    }
                    pg.all_reduce_slice(&mut x, ReduceOp::Max).map_err(|e| e.to_string())?;
                }
                Ok(())
            }
            m => panic!("unknown child mode {m}"),
        }
    })();
    if let Err(e) = res {
        say(format!("error {e}"));
        std::process::exit(3);
    }
}

struct Rank {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
}

impl Rank {
    /// The next line the child says, within `limit`.
    fn next(&self, limit: Duration) -> String {
        self.lines.recv_timeout(limit).unwrap_or_else(|_| panic!("child {} said nothing within {limit:?}", self.child.id()))
    }
}

impl Drop for Rank {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `w` ranks in `mode`; `env(r)` adds variables for rank r.
fn start(w: usize, mode: &str, env: impl Fn(usize) -> Vec<(&'static str, &'static str)>) -> Vec<Rank> {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let token = format!("shm-test-{:016x}", fnv(format!("{port}{:?}", Instant::now()).as_bytes()));
    let exe = std::env::current_exe().unwrap();
    (0..w)
        .map(|r| {
            let mut cmd = Command::new(&exe);
            cmd.args(["shm_processes::child_rank", "--ignored", "--exact", "--nocapture", "--test-threads=1"])
                .env_remove("ALLGRAD_SHM")
                .env_remove("ALLGRAD_SHM_SLOT_BYTES")
                .env("ALLGRAD_TEST_CHILD", mode)
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", w.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("LOCAL_WORLD_SIZE", w.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("ALLGRAD_JOB_TOKEN", &token)
                .env("ALLGRAD_TIMEOUT_S", "60")
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::null());
            for (k, v) in env(r) {
                cmd.env(k, v);
            }
            let mut child = cmd.spawn().expect("starting a child rank");
            let stdout = child.stdout.take().unwrap();
            let stdin = child.stdin.take();
            let (tx, lines) = mpsc::channel();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    // The test harness may have printed the test's name on the same line.
                    if let Some(i) = line.find("CHILD: ") {
                        if tx.send(line[i + 7..].to_string()).is_err() {
                            break;
                        }
                    }
                }
            });
            Rank { child, stdin, lines }
        })
        .collect()
}

/// The segment mappings of a process: (path, deleted).
fn shm_mappings(pid: u32) -> Vec<(String, bool)> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    maps.lines()
        .filter_map(|l| l.find("/dev/shm/allgrad-").map(|i| &l[i..]))
        .map(|p| (p.trim_end_matches(" (deleted)").to_string(), p.ends_with("(deleted)")))
        .collect()
}

/// Runs the `digest` mode; returns each rank's (digest, shared memory) and segment mappings.
fn digests(w: usize, env: impl Fn(usize) -> Vec<(&'static str, &'static str)>) -> Vec<(String, Vec<(String, bool)>)> {
    let mut ranks = start(w, "digest", env);
    let out: Vec<(String, Vec<(String, bool)>)> = ranks
        .iter()
        .map(|k| {
            let line = k.next(Duration::from_secs(60));
            assert!(line.starts_with("digest"), "a child said {line:?}");
            (line, shm_mappings(k.child.id()))
        })
        .collect();
    for k in &mut ranks {
        writeln!(k.stdin.as_mut().unwrap(), "done").unwrap();
    }
    for k in &mut ranks {
        let status = allgrad_testkit::process::wait_exit(&mut k.child, "a child rank", Duration::from_secs(60));
        assert!(status.success(), "a child rank exited with {status}");
    }
    out
}

#[test]
fn processes_on_one_host_share_an_unlinked_segment_and_agree_with_tcp() {
    if !std::path::Path::new("/dev/shm").is_dir() {
        return allgrad_testkit::skip(allgrad_testkit::Need::DevShm, "no /dev/shm on this host");
    }
    for w in [2, 3] {
        let shm = digests(w, |_| vec![]);
        let tcp = digests(w, |_| vec![("ALLGRAD_SHM", "0")]);
        let one_declines = digests(w, |r| if r == w - 1 { vec![("ALLGRAD_SHM", "0")] } else { vec![] });
        let common = shm[0].0.split(' ').nth(1).unwrap().to_string();
        let own = |r: usize| shm[r].0.split(' ').nth(2).unwrap().to_string();
        for (r, (line, maps)) in shm.iter().enumerate() {
            assert_eq!(line, &format!("digest {common} {} shm true", own(r)), "W={w} rank {r}");
            // One segment, mapped and already unlinked; the same file on every rank.
            assert_eq!(maps.len(), 1, "W={w} rank {r}: mappings {maps:?}");
            assert!(maps[0].1, "W={w} rank {r}: the segment {} still has a name", maps[0].0);
            assert_eq!(maps[0].0, shm[0].1[0].0, "W={w} rank {r}: another segment than rank 0's");
            assert!(!std::path::Path::new(&maps[0].0).exists());
        }
        for (case, runs) in [("ALLGRAD_SHM=0", &tcp), ("ALLGRAD_SHM=0 on one rank", &one_declines)] {
            for (r, (line, maps)) in runs.iter().enumerate() {
                assert_eq!(line, &format!("digest {common} {} shm false", own(r)), "W={w} {case}: rank {r}");
                assert!(maps.is_empty(), "W={w} {case}: rank {r} maps {maps:?}");
            }
        }
    }
}

#[test]
fn a_process_killed_mid_collective_is_named_by_every_other_rank() {
    // (path, child mode, environment): 8 MiB calls spend nearly all their time in the
    // shared-memory phases, or on the TCP ring without shared memory; 16-byte calls take the
    // TCP direct path.
    let paths: [(&str, &str, &Env); 3] =
        [("shared memory", "loop", &[]), ("TCP ring", "loop", &[("ALLGRAD_SHM", "0")]), ("TCP direct", "loop_small", &[])];
    for (path, mode, env) in paths {
        if path == "shared memory" && !std::path::Path::new("/dev/shm").is_dir() {
            allgrad_testkit::skip(allgrad_testkit::Need::DevShm, "no /dev/shm: the shared-memory cases do not run");
            continue;
        }
        for (w, victim) in [(2, 1), (3, 1), (3, 0), (4, 2)] {
            killed_mid_collective(w, victim, path, mode, env);
        }
    }
}

/// Environment variables of a child rank.
type Env = [(&'static str, &'static str)];

fn killed_mid_collective(w: usize, victim: usize, path: &str, mode: &str, env: &Env) {
    let mut ranks = start(w, mode, |_| env.to_vec());
    for k in &ranks {
        assert_eq!(k.next(Duration::from_secs(60)), "looping", "{path} W={w}");
    }
    // Mid-way through the stream of calls.
    std::thread::sleep(Duration::from_millis(50));
    let killed = Instant::now();
    ranks[victim].child.kill().unwrap();
    for (r, k) in ranks.iter_mut().enumerate() {
        if r == victim {
            continue;
        }
        let line = k.next(Duration::from_secs(10));
        let took = killed.elapsed();
        assert!(took < Duration::from_secs(5), "{path} W={w}: rank {r} took {took:?} to fail: {line}");
        assert!(line.starts_with("error") && line.contains(&format!("rank {victim} ")), "{path} W={w}: rank {r} said {line:?}");
        let status = allgrad_testkit::process::wait_exit(&mut k.child, "a surviving child rank", Duration::from_secs(30));
        assert_eq!(status.code(), Some(3), "{path} W={w}: rank {r}");
    }
}
