//! The launcher and ranks as processes: the torchrun environment, a failing rank stopping
//! the job with its exit code, a killed rank making the others fail with its name, Ctrl-C
//! reaching every rank, and no process left behind in any of these cases.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn launch_bin() -> &'static str {
    env!("CARGO_BIN_EXE_launch")
}

fn example(name: &str) -> PathBuf {
    // Examples are built next to the test binaries' directory: target/<profile>/examples.
    let mut p = std::env::current_exe().unwrap();
    p.pop();
    p.pop();
    p.push("examples");
    p.push(name);
    assert!(p.exists(), "{} is not built (cargo test builds examples; run `cargo build --examples`)", p.display());
    p
}

/// Runs a command with a watchdog: kills it and fails the test after `limit`.
fn run_with_watchdog(cmd: &mut Command, limit: Duration) -> (Output, Duration) {
    let t = Instant::now();
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    loop {
        if child.try_wait().unwrap().is_some() {
            return (child.wait_with_output().unwrap(), t.elapsed());
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            panic!("watchdog: {cmd:?} still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
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
            let _ = child.kill();
            panic!("watchdog: launch did not stop after SIGINT");
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
    // The example is the `train` command with one more method: same arguments.
    let run_dir = std::env::temp_dir().join(format!("allgrad-custom-loss-{}", std::process::id()));
    let (out, _) = run_with_watchdog(
        Command::new(launch_bin())
            .args(["--nproc-per-node", "2"])
            .arg(example("custom_loss"))
            .args(["--config", "examples/custom_loss.yaml", "--output-dir"])
            .arg(&run_dir),
        Duration::from_secs(120),
    );
    let _ = std::fs::remove_dir_all(&run_dir);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("[rank0]: uniformity is world-size invariant at W = 4"), "{text}");
    assert!(text.contains("[rank0]: trained 32 of 32 steps on 2 rank(s)"), "{text}");
}
