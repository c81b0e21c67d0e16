//! Groups of 64 and 128 processes on this host: this test binary starts W copies of itself as
//! ranks (the `child_rank` test, which does nothing unless ALLGRAD_TEST_CHILD is set) with the
//! launcher variables, each under a watchdog (`allgrad_testkit::process`). They form one
//! group (both sizes are past the default ALLGRAD_TREE_FROM and ALLGRAD_ON_DEMAND_FROM of 32,
//! so calls are checked and small collectives run through the binomial tree, and each rank
//! connects at formation only to its parent and children in the tree and its two ring
//! neighbours), run a barrier, small and 1 MiB all_reduce calls and an all_gather with their
//! results checked against the closed-form sums, and each rank reports the connections it
//! holds, which must be those of formation (counted here from the tree's and the ring's
//! rules). Rank 0, which serves the store, counts the store connections among its descriptors
//! once the group has formed, and again after calls that need the store (a subgroup of every
//! rank in reverse order, and a permute to rank r + 3, which opens connections on demand): at
//! most log2(W) (the ranks close theirs once formed), where each rank used to keep one open. Then
//! one rank SIGKILLs itself while the others wait in a 4-byte all_reduce: every
//! survivor must fail, naming it, well before the timeout, though most of them hold no
//! connection to it (at W = 128 the victim is known to five ranks, its tree and ring
//! neighbours).
//!
//! `scripts/bench/bench_scale_ranks.sh` measures the same at up to 1,024 ranks; this test holds the
//! behaviour at a size CI can afford.

use std::io::Write;
use std::net::TcpListener;
use std::process::Command;
use std::time::Duration;

use allgrad_dist::{ProcessGroup, ReduceOp};
use allgrad_testkit::process::{spawn, Watched};

const W: usize = 64;
/// The rank that kills itself (an inner node of the tree: its subtree is ranks 40..48).
const VICTIM: usize = 40;
/// Every blocking call's timeout in the children: survivors must fail well before it.
const TIMEOUT_S: u64 = 60;

fn say(line: String) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "CHILD: {line}").unwrap();
    out.flush().unwrap();
}

/// What a child rank does (only when ALLGRAD_TEST_CHILD is set). A child helper, not a test:
/// ignored, so that it does not count as a passed test, and run as each rank with `--ignored
/// --exact`.
#[test]
#[ignore = "child helper: run as the ranks of this file's tests"]
fn child_rank() {
    let Ok(mode) = std::env::var("ALLGRAD_TEST_CHILD") else { return };
    if mode == "limits" {
        // Run under a hard limit of LOW_FILES open files: a launcher of 64 ranks and a group
        // of 2 ranks (which keeps 64 descriptors spare) are refused with the numbers.
        let e = allgrad_dist::launch::launch(&allgrad_dist::launch::LaunchConfig::new(64, vec!["true".into()]))
            .expect_err("64 ranks launched under a tiny file limit");
        say(format!("launch: {e}"));
        let e = allgrad_dist::ThreadWorld::new(2).run(|_| Ok(())).expect_err("a group formed under a tiny file limit");
        say(format!("group: {e}"));
        return;
    }
    let pg = ProcessGroup::from_env().unwrap_or_else(|e| {
        say(format!("error joining: {e}"));
        std::process::exit(3)
    });
    let (w, r) = (pg.world_size(), pg.rank());
    // ALLGRAD_TEST_CHILD names the rank that kills itself.
    let victim: usize = mode.parse().unwrap_or(VICTIM);
    let formed_with = pg.connection_count();
    let res: Result<(), String> = (|| {
        pg.barrier().map_err(|e| e.to_string())?;
        let mut x = [r as f64 + 1.0, 1.0];
        pg.all_reduce_slice(&mut x, ReduceOp::Sum).map_err(|e| e.to_string())?;
        let want = [(w * (w + 1) / 2) as f64, w as f64];
        if x != want {
            return Err(format!("small all_reduce gave {x:?}, expected {want:?}"));
        }
        // 1 MiB: through shared memory where the host offers it, else the TCP paths.
        let mut big: Vec<f32> = (0..1 << 18).map(|i| ((i + r) % 5) as f32).collect();
        pg.all_reduce_slice(&mut big, ReduceOp::Sum).map_err(|e| e.to_string())?;
        if let Some(i) = (0..big.len()).find(|&i| big[i] != (0..w).map(|q| ((i + q) % 5) as f32).sum::<f32>()) {
            return Err(format!("1 MiB all_reduce: element {i} is {}", big[i]));
        }
        let g = pg.all_gather_slice(&[r as u32, 7]).map_err(|e| e.to_string())?;
        if g != (0..w as u32).flat_map(|q| [q, 7]).collect::<Vec<_>>() {
            return Err(format!("all_gather gave {g:?}"));
        }
        let paths = pg.all_reduce_paths();
        let fds = std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0);
        say(format!("formed tree={} fds={fds} conns={formed_with} then={}", paths.tree, pg.connection_count()));
        // Rank 0 serves the store: once every rank has formed (the barrier above), the ranks'
        // connections to it are closed.
        if r == 0 {
            say(format!("store sockets after forming: {}", settled_store_connections(&pg)));
        }
        // The others wait while rank 0 counts: the subgroup below opens their store connections
        // again (and holds them until rank 0 joins it), which the count must not see.
        pg.barrier().map_err(|e| e.to_string())?;
        // Calls that need the store again: a subgroup (its members publish and read addresses
        // there) and connections opened on demand by a permute to rank r + 3 (each higher rank
        // of a new pair reads the lower one's address there).
        let reversed: Vec<usize> = (0..w).rev().collect();
        let sub = pg.new_group(&reversed).map_err(|e| e.to_string())?.ok_or("not a member of the reversed group")?;
        let mut s = [r as f64];
        sub.all_reduce_slice(&mut s, ReduceOp::Sum).map_err(|e| e.to_string())?;
        if s[0] != (w * (w - 1) / 2) as f64 || sub.rank() != w - 1 - r {
            return Err(format!("the reversed subgroup gave {} as rank {}", s[0], sub.rank()));
        }
        let dst_of: Vec<usize> = (0..w).map(|q| (q + 3) % w).collect();
        let got = pg.permute_slice(&[r as u32], &dst_of, 1, &[]).map_err(|e| e.to_string())?;
        if got != [((r + w - 3) % w) as u32] {
            return Err(format!("the permute to rank r + 3 gave {got:?}"));
        }
        say(format!("store calls done conns={}", pg.connection_count()));
        pg.barrier().map_err(|e| e.to_string())?;
        if r == 0 {
            say(format!("store sockets after more calls: {}", settled_store_connections(&pg)));
        }
        pg.barrier().map_err(|e| e.to_string())?;
        if r == victim {
            std::thread::sleep(Duration::from_millis(200));
            // SAFETY: raising a signal against this process.
            unsafe { libc::raise(libc::SIGKILL) };
        }
        let t = std::time::Instant::now();
        let mut y = [1.0f32];
        loop {
            if let Err(e) = pg.all_reduce_slice(&mut y, ReduceOp::Sum) {
                say(format!("failed after {} ms: {e}", t.elapsed().as_millis()));
                return Ok(());
            }
        }
    })();
    if let Err(e) = res {
        say(format!("error {e}"));
        std::process::exit(3);
    }
}

/// The connections rank 0's store serves now, counted from this process's descriptors: the
/// sockets in /proc/self/fd whose local port is the store's (MASTER_PORT), the listener apart,
/// as /proc/self/net/tcp and tcp6 list them; and how many listeners on that port it holds.
fn store_server_sockets(port: u16) -> (usize, usize) {
    let inodes: std::collections::HashSet<u64> = std::fs::read_dir("/proc/self/fd")
        .expect("listing /proc/self/fd")
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| l.to_str()?.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok())
        .collect();
    let (mut n, mut listeners) = (0, 0);
    for table in ["/proc/self/net/tcp", "/proc/self/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else { continue };
        for line in text.lines().skip(1) {
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            let cols: Vec<&str> = line.split_whitespace().collect();
            let Some(local_port) = cols.get(1).and_then(|a| a.rsplit(':').next()) else { continue };
            let (Ok(local_port), Some(inode)) = (u16::from_str_radix(local_port, 16), cols.get(9)) else { continue };
            let listening = cols.get(3) == Some(&"0A");
            if local_port == port && inode.parse().is_ok_and(|i: u64| inodes.contains(&i)) {
                if listening {
                    listeners += 1;
                } else {
                    n += 1;
                }
            }
        }
    }
    (n, listeners)
}

/// Rank 0's store connections once they have had time to close (the peers close theirs and the
/// store's side follows): waits up to 10 s for none to be left, and returns what is left, by
/// the server's own count of the connections it serves (a thread each), with the sockets in
/// this process on the store's port beside it (and the store's listener among them: the count
/// sees the store).
fn settled_store_connections(pg: &ProcessGroup) -> String {
    let port: u16 = std::env::var("MASTER_PORT").expect("MASTER_PORT").parse().expect("MASTER_PORT is a port");
    let until = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let served = pg.store_connections().expect("rank 0 serves the store");
        let (sockets, listeners) = store_server_sockets(port);
        assert_eq!(listeners, 1, "rank 0 holds no listener on the store's port {port}");
        if served == 0 || std::time::Instant::now() >= until {
            return format!("(sockets on the port {sockets}) {served}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Whether `msg` names rank `r` ("rank 4", not "rank 40").
fn names_rank(msg: &str, r: usize) -> bool {
    let needle = format!("rank {r}");
    msg.match_indices(&needle).any(|(i, _)| !msg[i + needle.len()..].starts_with(|c: char| c.is_ascii_digit()))
}

/// The hard limit on open files of the `limits` child.
const LOW_FILES: u64 = 40;

#[test]
fn too_low_a_limit_on_open_files_is_refused_at_start_with_the_numbers() {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["many_processes::child_rank", "--ignored", "--exact", "--nocapture", "--test-threads=1"])
        .env("ALLGRAD_TEST_CHILD", "limits");
    // SAFETY: only setrlimit, async-signal-safe, between fork and exec.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
            let lim = libc::rlimit { rlim_cur: LOW_FILES, rlim_max: LOW_FILES };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let (out, _) = spawn(&mut cmd, "a child under a low file limit", Duration::from_secs(60)).wait();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let said = |what: &str| text.lines().find_map(|l| l.split_once(&format!("CHILD: {what}: ")).map(|(_, m)| m.to_string()));
    let launch = said("launch").unwrap_or_else(|| panic!("{text}"));
    for want in ["64 ranks need about", "at most 40", "hard limit 40", "ulimit -n 4096"] {
        assert!(launch.contains(want), "{want:?} missing in {launch}");
    }
    let group = said("group").unwrap_or_else(|| panic!("{text}"));
    for want in ["group world of 2 ranks needs about", "at most 40", "hard limit 40", "ulimit -n"] {
        assert!(group.contains(want), "{want:?} missing in {group}");
    }
}

/// Starts `w` ranks, of which `victim` kills itself once the group has run its calls, and
/// checks every rank's report.
fn form_and_kill(w: usize, victim: usize, watchdog: Duration) {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let token = format!("many-{port}-{}", std::process::id());
    let exe = std::env::current_exe().unwrap();
    let ranks: Vec<Watched> = (0..w)
        .map(|r| {
            let mut cmd = Command::new(&exe);
            cmd.args(["many_processes::child_rank", "--ignored", "--exact", "--nocapture", "--test-threads=1"])
                .env("ALLGRAD_TEST_CHILD", victim.to_string())
                .env_remove("ALLGRAD_TREE_FROM")
                .env_remove("ALLGRAD_ON_DEMAND_FROM")
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", w.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("LOCAL_WORLD_SIZE", w.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("ALLGRAD_JOB_TOKEN", &token)
                .env("ALLGRAD_TIMEOUT_S", TIMEOUT_S.to_string());
            spawn(&mut cmd, &format!("rank {r} of {w}"), watchdog)
        })
        .collect();
    for (r, rank) in ranks.into_iter().enumerate() {
        let (out, _) = rank.wait();
        let text = String::from_utf8_lossy(&out.stdout);
        let said: Vec<&str> = text.lines().filter_map(|l| l.find("CHILD: ").map(|i| &l[i + 7..])).collect();
        if r == victim {
            assert_eq!(out.status.code(), None, "rank {r} should have died of SIGKILL: {said:?}");
            continue;
        }
        assert!(out.status.success(), "rank {r}: {:?}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
        let formed = said.iter().find(|l| l.starts_with("formed ")).unwrap_or_else(|| panic!("rank {r} never formed: {said:?}"));
        // Past ALLGRAD_TREE_FROM the small all_reduce went through the tree.
        assert!(formed.starts_with("formed tree=1 "), "rank {r}: {formed}");
        // Past ALLGRAD_ON_DEMAND_FROM the rank connected to its tree and ring neighbours only,
        // and the calls (tree, shared memory or the ring) opened no other connection.
        let want = crate::on_demand::formation_peers(r, w).len();
        assert!(formed.ends_with(&format!(" conns={want} then={want}")), "rank {r} (expected {want} connections): {formed}");
        assert!(
            said.iter().any(|l| l.starts_with("store calls done ")),
            "rank {r} never finished the calls that need the store: {said:?}"
        );
        if r == 0 {
            // O(log W) at most (none once they have closed): about W - 1 while every rank kept its
            // connection to the store open for the life of the job.
            let bound = w.ilog2() as usize;
            for when in ["after forming", "after more calls"] {
                let line =
                    said.iter().find(|l| l.starts_with(&format!("store sockets {when}: "))).unwrap_or_else(|| panic!("{said:?}"));
                let n: usize = line.rsplit(' ').next().unwrap().parse().unwrap();
                assert!(n <= bound, "rank 0 serves {n} store connections {when} (at most {bound} expected at W = {w})");
            }
        }
        let failed = said.iter().find(|l| l.starts_with("failed after ")).unwrap_or_else(|| panic!("rank {r}: {said:?}"));
        assert!(names_rank(failed, victim), "rank {r}'s error does not name rank {victim}: {failed}");
        let ms: u64 = failed["failed after ".len()..].split(' ').next().unwrap().parse().unwrap();
        assert!(ms < TIMEOUT_S * 1000 / 3, "rank {r} took {ms} ms to notice (timeout {TIMEOUT_S} s): {failed}");
    }
}

#[test]
fn sixty_four_processes_form_a_group_and_every_survivor_names_a_killed_rank() {
    form_and_kill(W, VICTIM, Duration::from_secs(150));
}

#[test]
fn a_hundred_and_twenty_eight_processes_connected_on_demand_all_name_a_killed_rank() {
    // Rank 72: parent 64, children 73, 74 and 76, ring neighbours 71 and 73; the other 122
    // survivors hold no connection to it.
    form_and_kill(128, 72, Duration::from_secs(300));
}
