//! The launcher and ranks as processes: the torchrun environment, a failing rank stopping
//! the job with its exit code (after the others had a moment to end and report on their own), a killed rank making the others fail with its name, Ctrl-C
//! reaching every rank, and no process left behind in any of these cases; a program that
//! cannot start reported as such; no shared-memory file left by a rank killed while its group
//! was being set up; and, on a terminal, rank 0 drawing there (the trainer's progress bar).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{example, run_with_watchdog};

fn launch_bin() -> &'static str {
    env!("CARGO_BIN_EXE_launch")
}

fn processes_matching(pattern: &str) -> usize {
    let out = Command::new("pgrep").args(["-f", pattern]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).lines().count()
}

#[test]
fn launch_sets_the_torchrun_environment_and_prefixes_output() {
    let (out, _) = run_with_watchdog(
        Command::new(launch_bin()).args([
            "--nproc-per-node",
            "3",
            "sh",
            "-c",
            "echo RANK=$RANK LOCAL_RANK=$LOCAL_RANK WORLD_SIZE=$WORLD_SIZE LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE \
             MASTER_ADDR=$MASTER_ADDR TOKEN=${#ALLGRAD_JOB_TOKEN}",
        ]),
        Duration::from_secs(30),
    );
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    for r in 0..3 {
        let want = format!("[rank{r}]: RANK={r} LOCAL_RANK={r} WORLD_SIZE=3 LOCAL_WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 TOKEN=32");
        assert!(text.lines().any(|l| l == want), "missing {want:?} in\n{text}");
    }
}

#[test]
fn ranks_filter_shows_only_the_chosen_ranks() {
    let (out, _) = run_with_watchdog(
        Command::new(launch_bin()).args(["--nproc-per-node", "3", "--ranks-filter", "1", "sh", "-c", "echo hello from $RANK"]),
        Duration::from_secs(30),
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "[rank1]: hello from 1");
}

#[test]
fn a_failing_rank_stops_the_job_with_its_exit_code_and_leaves_no_process() {
    let marker = "61.4242";
    let script = format!("if [ \"$RANK\" = 1 ]; then sleep 0.3; exit 3; fi; exec sleep {marker}");
    let (out, elapsed) = run_with_watchdog(
        Command::new(launch_bin()).args(["--nproc-per-node", "3", "--grace-s", "2", "sh", "-c", &script]),
        Duration::from_secs(60),
    );
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("rank 1 exited with code 3"));
    assert_eq!(processes_matching(&format!("sleep {marker}")), 0, "ranks left behind");
}

#[test]
fn after_a_failure_the_other_ranks_may_end_on_their_own_and_say_why() {
    // As `train` does with a config error: rank 1 exits at once without a word, rank 0 reports
    // the error a moment later. Stopped at once, rank 0 would never print it.
    let script = "if [ \"$RANK\" = 1 ]; then exit 2; fi; sleep 0.3; echo 'the reason, from rank 0' >&2; exit 2";
    let (out, elapsed) = run_with_watchdog(
        Command::new(launch_bin()).args(["--nproc-per-node", "2", "sh", "-c", script]),
        Duration::from_secs(60),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("rank 1 exited with code 2"), "{err}");
    assert!(err.contains("[rank0]: the reason, from rank 0"), "{err}");
    assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}");
}

#[test]
fn a_rank_that_ignores_sigterm_is_killed_after_the_grace_period() {
    let marker = "62.4242";
    let script = format!("if [ \"$RANK\" = 0 ]; then exit 5; fi; trap '' TERM; sleep {marker}; sleep {marker}");
    let (out, elapsed) = run_with_watchdog(
        Command::new(launch_bin()).args(["--nproc-per-node", "2", "--grace-s", "1", "sh", "-c", &script]),
        Duration::from_secs(60),
    );
    assert_eq!(out.status.code(), Some(5), "{out:?}");
    assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}");
    assert_eq!(processes_matching(&format!("sleep {marker}")), 0, "ranks left behind");
}

#[test]
fn sigint_to_the_launcher_reaches_every_rank() {
    let marker = "63.4242";
    let mut child = Command::new(launch_bin())
        .args(["--nproc-per-node", "2", "--grace-s", "2", "sh", "-c", &format!("exec sleep {marker}")])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while processes_matching(&format!("sleep {marker}")) < 2 {
        assert!(t.elapsed() < Duration::from_secs(20), "watchdog: ranks did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t.elapsed() > Duration::from_secs(30) {
            allgrad_testkit::process::kill_tree(child.id());
            panic!("watchdog: launch did not stop after SIGINT (killed it and its ranks)");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(130));
    assert_eq!(processes_matching(&format!("sleep {marker}")), 0, "ranks left behind");
}

#[test]
fn a_killed_rank_makes_the_others_fail_naming_it_within_seconds() {
    let (out, elapsed) = run_with_watchdog(
        Command::new(launch_bin()).args(["--nproc-per-node", "3"]).arg(example("failure_drill")).arg("1"),
        Duration::from_secs(60),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}: {err}");
    // The launcher saw rank 1 killed by SIGKILL (128 + 9), and a survivor named it.
    assert!(err.contains("rank 1 exited with code 137"), "{err}");
    assert!(err.lines().any(|l| (l.starts_with("[rank0]") || l.starts_with("[rank2]")) && l.contains("rank 1")), "{err}");
}

#[test]
fn the_seed_examples_print_the_documented_gradients() {
    for (name, want) in [
        (
            "seed_gather",
            vec![
                "[rank0]: rank 0: y.grad = 12 (sum rule), 6 (loss / W)",
                "[rank1]: rank 1: y.grad = 18 (sum rule), 9 (loss / W)",
            ],
        ),
        (
            "seed_all_reduce",
            vec!["[rank0]: rank 0: prod, loss (rank+2)*s: x.grad = 30", "[rank1]: rank 1: sum, loss s*s: x.grad = 60"],
        ),
    ] {
        let (out, _) = run_with_watchdog(
            Command::new(launch_bin()).args(["--nproc-per-node", "2"]).arg(example(name)),
            Duration::from_secs(60),
        );
        assert!(out.status.success(), "{name}: {out:?}");
        let text = String::from_utf8_lossy(&out.stdout);
        for w in want {
            assert!(text.lines().any(|l| l == w), "{name}: missing {w:?} in\n{text}");
        }
    }
}

#[test]
fn the_custom_loss_example_checks_invariance_and_trains_on_2_ranks() {
    // The example is the `train` command with one more method: same arguments. The second run
    // computes its uniformity term in 7 x 7 blocks (`allgrad::models::tiled`).
    for sets in [&[][..], &["--set", "points.tile=7", "--set", "train.epochs=1"][..]] {
        let run_dir = std::env::temp_dir().join(format!("allgrad-custom-loss-{}-{}", std::process::id(), sets.len()));
        let (out, _) = run_with_watchdog(
            Command::new(launch_bin())
                .args(["--nproc-per-node", "2"])
                .arg(example("custom_loss"))
                .args(["--config", "examples/custom_loss.yaml", "--output-dir"])
                .arg(&run_dir)
                .args(sets),
            Duration::from_secs(120),
        );
        let _ = std::fs::remove_dir_all(&run_dir);
        assert!(out.status.success(), "{sets:?}: {out:?}");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("[rank0]: uniformity is world-size invariant at W = 4"), "{text}");
        let steps = if sets.is_empty() { "32 of 32" } else { "8 of 8" };
        assert!(text.contains(&format!("[rank0]: trained {steps} steps on 2 rank(s)")), "{sets:?}: {text}");
    }
}

#[test]
fn a_program_that_cannot_start_is_a_launch_error_with_exit_code_2() {
    let (out, _) = run_with_watchdog(
        Command::new(launch_bin()).args(["--nproc-per-node", "2", "/nonexistent/allgrad-program", "x"]),
        Duration::from_secs(30),
    );
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.lines().any(|l| l.starts_with("launch: error: starting rank 0: /nonexistent/allgrad-program: ")
            && l.contains("No such file or directory")),
        "{err}"
    );
}

// ------------------------------------------------------------ shared memory left behind

/// What a child rank does, by ALLGRAD_TEST_CHILD (nothing without it): `die_in_shm_setup`
/// joins the group while a thread watches `/dev/shm` for the job's segment; rank 0 kills
/// itself with SIGKILL as soon as the segment exists, that is while the group is still being
/// set up (rank 0 reserves and maps 256 MiB, and rank 1 maps them, before the name goes).
/// A child helper, not a test: ignored, so that it does not count as a passed test, and run
/// as each rank with `--ignored --exact`.
#[test]
#[ignore = "child helper: run as the ranks of launch::a_rank_killed_during_shared_memory_setup_leaves_no_segment_after_launch_exits"]
fn child_rank() {
    let Ok(mode) = std::env::var("ALLGRAD_TEST_CHILD") else { return };
    assert_eq!(mode, "die_in_shm_setup");
    let prefix = allgrad::dist::shm_job_prefix(&std::env::var("ALLGRAD_JOB_TOKEN").unwrap());
    if std::env::var("RANK").as_deref() == Ok("0") {
        std::thread::spawn(move || loop {
            let entries = std::fs::read_dir("/dev/shm").unwrap();
            if let Some(e) = entries.flatten().find(|e| e.file_name().to_string_lossy().starts_with(&prefix)) {
                println!("segment {} exists; dying", e.path().display());
                use std::io::Write;
                std::io::stdout().flush().unwrap();
                // SAFETY: raising a signal against ourselves.
                unsafe { libc::raise(libc::SIGKILL) };
            }
            std::thread::yield_now();
        });
    }
    match allgrad::dist::ProcessGroup::from_env() {
        Ok(pg) => println!("setup completed first (shared memory {})", pg.shared_memory()),
        Err(e) => println!("joining failed: {e}"),
    }
    std::process::exit(3);
}

fn job_files(prefix: &str) -> Vec<String> {
    let entries = std::fs::read_dir("/dev/shm").unwrap();
    entries.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| n.starts_with(prefix)).collect()
}

#[test]
fn a_rank_killed_during_shared_memory_setup_leaves_no_segment_after_launch_exits() {
    if !std::path::Path::new("/dev/shm").is_dir() {
        return allgrad_testkit::skip(allgrad_testkit::Need::DevShm, "no /dev/shm on this host");
    }
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    let token = format!("shm-cleanup-test-{}-{nanos}", std::process::id());
    let prefix = allgrad::dist::shm_job_prefix(&token);
    let (out, _) = run_with_watchdog(
        Command::new(launch_bin())
            .args(["--nproc-per-node", "2", "--grace-s", "1"])
            .arg(std::env::current_exe().unwrap())
            .args(["launch::child_rank", "--ignored", "--exact", "--nocapture", "--test-threads", "1"])
            .env("ALLGRAD_TEST_CHILD", "die_in_shm_setup")
            .env("ALLGRAD_JOB_TOKEN", &token)
            // The largest segment (256 MiB): its setup lasts long enough for the watcher.
            .env("ALLGRAD_SHM_SLOT_BYTES", (64 << 20).to_string())
            .env_remove("ALLGRAD_SHM"),
        Duration::from_secs(60),
    );
    let (text, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    // Rank 0 died while its segment existed (the case the cleanup is for).
    let seen: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("[rank0]: "))
        .filter_map(|l| l.split("segment ").nth(1)?.strip_suffix(" exists; dying"))
        .collect();
    assert_eq!(seen.len(), 1, "rank 0 did not die during setup:\n{text}\n{err}");
    assert!(seen[0].starts_with(&format!("/dev/shm/{prefix}")), "{}", seen[0]);
    assert_eq!(out.status.code(), Some(137), "{text}\n{err}");
    assert!(err.contains("rank 0 exited with code 137"), "{err}");
    // The launcher removed it, said so, and nothing of the job is left.
    assert!(err.contains(&format!("launch: removed shared-memory files left by the job's ranks: {}", seen[0])), "{err}");
    assert_eq!(job_files(&prefix), Vec::<String>::new());
}

/// The launchers of a job's other nodes may share this `/dev/shm` (nodes on one host, or
/// network namespaces and containers over one tmpfs) and be setting up a group right then: a
/// launcher removes the files its own ranks created and leaves another process's files of the
/// same job alone (it once removed every file of the job, and a two-node run on one host then
/// lost a node's segment between its creation and its mapping).
#[test]
fn launch_removes_its_own_ranks_segments_only() {
    if !std::path::Path::new("/dev/shm").is_dir() {
        return allgrad_testkit::skip(allgrad_testkit::Need::DevShm, "no /dev/shm on this host");
    }
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    let token = format!("shm-own-files-test-{}-{nanos}", std::process::id());
    // A segment of the same job that another node's rank (here: this test process) is setting up.
    let other = format!("/dev/shm/{}left-by-another-node", allgrad::dist::shm_rank_prefix(&token, std::process::id()));
    std::fs::write(&other, b"x").unwrap();
    // Each rank leaves a file named as a segment it created would be ($$ is the rank's pid:
    // `sh` is the program the launcher starts).
    let prefix = allgrad::dist::shm_job_prefix(&token);
    let script = format!("touch /dev/shm/{prefix}$$-left-by-rank-$RANK && echo $$");
    let (out, _) = run_with_watchdog(
        Command::new(launch_bin()).args(["--nproc-per-node", "2", "sh", "-c", &script]).env("ALLGRAD_JOB_TOKEN", &token),
        Duration::from_secs(60),
    );
    let (text, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let kept = std::path::Path::new(&other).exists();
    let _ = std::fs::remove_file(&other);
    assert!(out.status.success(), "{text}\n{err}");
    assert!(kept, "the launcher removed another node's segment {other}:\n{err}");
    let mut left = job_files(&prefix);
    left.sort();
    assert_eq!(left, Vec::<String>::new(), "the ranks' own files were not all removed:\n{err}");
    for rank in 0..2 {
        let pid = text.lines().find_map(|l| l.strip_prefix(&format!("[rank{rank}]: "))).expect("each rank prints its pid");
        let name = format!("/dev/shm/{prefix}{pid}-left-by-rank-{rank}");
        assert!(err.contains(&name), "the launcher did not report removing {name}:\n{err}");
    }
}

// ------------------------------------------------------------------- on a terminal

/// Runs `program args` with stdout and stderr on a new pseudo-terminal (stdin closed) under
/// a watchdog; returns its exit status and everything written to the terminal, without the
/// carriage returns the terminal adds.
fn run_on_a_terminal(program: &str, args: &[&str], limit: Duration) -> (std::process::ExitStatus, String) {
    use std::io::Read;
    use std::os::fd::FromRawFd;
    let (mut master, mut slave) = (-1, -1);
    // SAFETY: openpty writes two descriptors; the other arguments may be null (null_mut fits
    // both the const pointers of glibc and the mut ones of the BSDs).
    let rc = unsafe { libc::openpty(&mut master, &mut slave, std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut()) };
    assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: both descriptors were just opened and are owned here alone.
    let (mut master, slave) = unsafe { (std::fs::File::from_raw_fd(master), std::fs::File::from_raw_fd(slave)) };
    let mut child = {
        let mut cmd = Command::new(program);
        cmd.args(args).stdin(Stdio::null()).stdout(slave.try_clone().unwrap()).stderr(slave);
        cmd.spawn().unwrap()
        // `cmd` (holding the last copies of the terminal's slave side here) is dropped here, so
        // reading the master side ends once the child and its ranks have closed theirs.
    };
    let (tx, terminal) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = master.read_to_end(&mut bytes); // ends with EIO once every slave is closed
        let _ = tx.send(bytes);
    });
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t.elapsed() > limit {
            allgrad_testkit::process::kill_tree(child.id());
            panic!("watchdog: {program} still running after {limit:?} (killed it and its ranks)");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // A process that outlived it (a rank's child) could hold the terminal open: bounded.
    let what = format!("reading the terminal of {program} after it exited (a process it started still holds it)");
    let bytes = allgrad_testkit::process::recv_within(&terminal, &what, Duration::from_secs(10));
    (status, String::from_utf8_lossy(&bytes).replace('\r', ""))
}

#[test]
fn on_a_terminal_rank_0_gets_it_as_stderr_and_the_other_ranks_stay_prefixed() {
    let script =
        "if [ -t 2 ]; then t=terminal; else t=pipe; fi; echo \"rank $RANK stderr: $t\"; echo \"rank $RANK on stderr\" >&2";
    let (status, text) = run_on_a_terminal(launch_bin(), &["--nproc-per-node", "3", "sh", "-c", script], Duration::from_secs(30));
    assert!(status.success(), "{status:?}\n{text}");
    let lines: Vec<&str> = text.lines().collect();
    for want in [
        "[rank0]: rank 0 stderr: terminal",
        "rank 0 on stderr",
        "[rank1]: rank 1 stderr: pipe",
        "[rank1]: rank 1 on stderr",
        "[rank2]: rank 2 stderr: pipe",
        "[rank2]: rank 2 on stderr",
    ] {
        assert!(lines.contains(&want), "missing {want:?} in\n{text}");
    }
}

#[test]
fn prefixed_lines_stay_whole_beside_rank_0_writing_to_the_same_terminal() {
    // Rank 0 writes to the terminal directly while the launcher copies the other ranks'
    // lines there: a prefix must never land on a line of rank 0's, nor a line lose its prefix.
    let script = "i=0; while [ $i -lt 3000 ]; do echo \"rank $RANK line $i\" >&2; i=$((i+1)); done";
    let (status, text) = run_on_a_terminal(launch_bin(), &["--nproc-per-node", "3", "sh", "-c", script], Duration::from_secs(30));
    assert!(status.success(), "{status:?}\n{text}");
    let mut counts = [0usize; 3];
    for line in text.lines() {
        let (rank, rest) = match line.strip_prefix("[rank1]: ").or_else(|| line.strip_prefix("[rank2]: ")) {
            Some(rest) => (if line.starts_with("[rank1]") { 1 } else { 2 }, rest),
            None => (0, line),
        };
        let ok = rest.strip_prefix(&format!("rank {rank} line ")).is_some_and(|n| n.parse::<u32>().is_ok());
        assert!(ok, "a torn line {line:?} in\n{text}");
        counts[rank] += 1;
    }
    assert_eq!(counts, [3000, 3000, 3000], "lines per rank, in\n{text}");
}

#[test]
fn train_under_launch_on_a_terminal_draws_the_progress_bar_on_rank_0() {
    let out_dir = tempfile::tempdir().unwrap();
    let out = out_dir.path().to_str().unwrap();
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/configs/vectors.yaml");
    let args = ["--nproc-per-node", "2", env!("CARGO_BIN_EXE_train"), "--config", config];
    let args: Vec<&str> = args.into_iter().chain(["--set", "train.epochs=1", "--output-dir", out]).collect();
    let (status, text) = run_on_a_terminal(launch_bin(), &args, Duration::from_secs(120));
    assert!(status.success(), "{status:?}\n{text}");
    // The bar's template is "{bar} {pos}/{len} steps ..."; periodic lines read "step N/8".
    assert!(text.contains("/8 steps"), "no progress bar in\n{text}");
    assert!(!text.lines().any(|l| l.contains("step 8/8")), "periodic lines instead of the bar:\n{text}");
}
