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
//! - The same at W = 8 with ALLGRAD_PEER_WINDOW=2 in every rank's environment (each rank
//!   reports that its group carries it): the killed rank is named by every other rank when
//!   they wait at shared-memory barriers (looking at two connections at a time), and in calls
//!   over TCP, through the binomial tree (ALLGRAD_TREE_FROM=2) or with every peer. That a
//!   waiter's window moves on: the ranks whose first look covers the rank to be killed are
//!   stopped (SIGSTOP) first, so that the running ranks, waiting at a shared-memory barrier,
//!   find it only on later looks (also with thread ranks, `src/cpu/shm/path_tests.rs`).

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
            "loop" | "loop_small" | "loop_pieces" => {
                let n = match mode.as_str() {
                    "loop" => 2 * N,
                    "loop_pieces" => N / 16,
                    _ => 4,
                };
                let mut x = input(r, n);
                for k in 0.. {
                    if k == 3 {
                        say(format!("looping, peer window {}, first look {:?}", pg.peer_window(), pg.peer_look(0)));
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
                .env_remove("ALLGRAD_PEER_WINDOW")
                .env_remove("ALLGRAD_TREE_FROM")
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
            killed_mid_collective(w, victim, path, mode, env, 64);
        }
    }
}

#[test]
fn with_a_peer_window_of_two_a_process_killed_mid_collective_is_named_by_every_other_rank() {
    // 8 ranks: rank 4 is an inner node of the tree (its subtree is ranks 4..8), and the first
    // looks of ranks 2 and 3 only cover it. 8 MiB calls wait at shared-memory barriers;
    // 16-byte calls go over TCP, through the tree or with every peer.
    let paths: [(&str, &str, &Env); 3] = [
        ("shared memory", "loop", &[("ALLGRAD_PEER_WINDOW", "2")]),
        ("TCP tree", "loop_small", &[("ALLGRAD_PEER_WINDOW", "2"), ("ALLGRAD_TREE_FROM", "2")]),
        ("TCP direct", "loop_small", &[("ALLGRAD_PEER_WINDOW", "2")]),
    ];
    for (path, mode, env) in paths {
        if path == "shared memory" && !std::path::Path::new("/dev/shm").is_dir() {
            allgrad_testkit::skip(allgrad_testkit::Need::DevShm, "no /dev/shm: the shared-memory case does not run");
            continue;
        }
        killed_mid_collective(8, 4, path, mode, env, 2);
    }
}

#[test]
fn with_a_peer_window_of_two_a_killed_process_is_found_by_ranks_whose_first_look_misses_it() {
    // 8 ranks with ALLGRAD_PEER_WINDOW=2 loop over 256 KiB all_reduce calls in 4 KiB slots (65
    // barriers a call: the first is the exchange of call headers over TCP, the other 64 wait
    // on shared memory). Each rank reports its first look (by the rule its waits use); the ranks
    // whose first look covers rank 4 are stopped (SIGSTOP), so the others soon all wait for
    // them, and rank 4 is killed (SIGKILL). The running ranks can find it only by moving their
    // windows on: each must fail within 5 s, naming it. Then the stopped ranks go on (SIGCONT)
    // and must name it too.
    if !std::path::Path::new("/dev/shm").is_dir() {
        return allgrad_testkit::skip(allgrad_testkit::Need::DevShm, "no /dev/shm: no shared-memory barrier to wait at");
    }
    const W: usize = 8;
    const VICTIM: usize = 4;
    // When the stop lands between two calls, the running ranks wait in the exchange of call
    // headers, which has heard from rank 4 already and looks at it no more: nobody fails until
    // the stopped ranks go on. That is rare (one barrier in 65); such a run is tried again. With
    // windows that do not move, every run is such a run, and the test fails after 3.
    for attempt in 1..=3 {
        let env: &Env = &[("ALLGRAD_PEER_WINDOW", "2"), ("ALLGRAD_SHM_SLOT_BYTES", "4096")];
        let mut ranks = start(W, "loop_pieces", |_| env.to_vec());
        let first_looks: Vec<Vec<usize>> = ranks
            .iter()
            .map(|k| {
                let line = k.next(Duration::from_secs(60));
                let look =
                    line.strip_prefix("looping, peer window 2, first look ").unwrap_or_else(|| panic!("a child said {line:?}"));
                look.trim_matches(['[', ']']).split(", ").map(|p| p.parse().unwrap()).collect()
            })
            .collect();
        let held: Vec<usize> = (0..W).filter(|&r| r != VICTIM && first_looks[r].contains(&VICTIM)).collect();
        assert_eq!(held, [2, 3], "first looks {first_looks:?}");
        let pids: Vec<libc::pid_t> = ranks.iter().map(|k| k.child.id() as libc::pid_t).collect();
        let signal = |r: usize, sig: libc::c_int| {
            // SAFETY: kill(2) on a child of this process, which has not been waited for.
            assert_eq!(unsafe { libc::kill(pids[r], sig) }, 0, "signal {sig} to rank {r}");
        };
        for &r in &held {
            signal(r, libc::SIGSTOP);
        }
        // The running ranks (rank 4 among them) are soon all waiting for the stopped ones.
        std::thread::sleep(Duration::from_millis(200));
        let killed = Instant::now();
        ranks[VICTIM].child.kill().unwrap();
        let running: Vec<usize> = (0..W).filter(|r| *r != VICTIM && !held.contains(r)).collect();
        let mut failed = Vec::new();
        for &r in &running {
            let left = Duration::from_secs(5).saturating_sub(killed.elapsed());
            if let Ok(line) = ranks[r].lines.recv_timeout(left) {
                assert!(line.starts_with("error") && line.contains(&format!("rank {VICTIM} ")), "rank {r} said {line:?}");
                failed.push(r);
            }
        }
        for &r in &held {
            signal(r, libc::SIGCONT);
        }
        if failed != running && attempt < 3 {
            // The stop landed between two calls (see above), for all the running ranks or for
            // some (a rank already past the call's last barrier waits in the next call's header
            // exchange; seen once for rank 7 on a loaded 2-core machine): tried again. Every
            // running rank must name the victim in one of the three runs.
            continue;
        }
        assert_eq!(failed, running, "the running ranks that named rank {VICTIM} within 5 s (attempt {attempt})");
        let resumed = Instant::now();
        for &r in &held {
            let line = ranks[r].next(Duration::from_secs(10));
            assert!(resumed.elapsed() < Duration::from_secs(5), "stopped rank {r} took {:?} to fail: {line}", resumed.elapsed());
            assert!(line.starts_with("error") && line.contains(&format!("rank {VICTIM} ")), "stopped rank {r} said {line:?}");
        }
        for (r, k) in ranks.iter_mut().enumerate().filter(|(r, _)| *r != VICTIM) {
            let status = allgrad_testkit::process::wait_exit(&mut k.child, "a surviving child rank", Duration::from_secs(30));
            assert_eq!(status.code(), Some(3), "rank {r}");
        }
        return;
    }
}

/// Environment variables of a child rank.
type Env = [(&'static str, &'static str)];

/// Starts `w` ranks looping over all_reduce calls in `mode`, kills rank `victim` (SIGKILL),
/// and checks that every other rank fails within 5 s, naming it; every rank's group must carry
/// a peer window of `window` connections.
fn killed_mid_collective(w: usize, victim: usize, path: &str, mode: &str, env: &Env, window: usize) {
    let mut ranks = start(w, mode, |_| env.to_vec());
    for k in &ranks {
        let line = k.next(Duration::from_secs(60));
        assert!(line.starts_with(&format!("looping, peer window {window}, ")), "{path} W={w}: {line}");
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
