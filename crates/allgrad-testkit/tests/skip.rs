//! A skip is printed and recorded, and fails the test where its need is required; a child
//! process that outlives its limit, or leaves a descendant holding its output, fails the
//! wait instead of hanging it.

use std::process::Command;
use std::time::Duration;

use allgrad_testkit::process;

/// What a child does, by ALLGRAD_TESTKIT_CHILD (nothing without it): `skip` skips for want
/// of /dev/shm. A child helper, not a test: ignored, so that it does not count as a passed
/// test, and run with `--ignored --exact`.
#[test]
#[ignore = "child helper: run by a_skip_is_printed_and_recorded_and_fails_where_required"]
fn child() {
    if std::env::var("ALLGRAD_TESTKIT_CHILD").as_deref() == Ok("skip") {
        allgrad_testkit::skip(allgrad_testkit::Need::DevShm, "pretending /dev/shm is absent");
    }
}

fn run_child(log: &std::path::Path, require: Option<&str>) -> std::process::Output {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["child", "--ignored", "--exact", "--test-threads", "1"])
        .env("ALLGRAD_TESTKIT_CHILD", "skip")
        .env("ALLGRAD_SKIP_LOG", log)
        .env_remove("ALLGRAD_REQUIRE");
    if let Some(r) = require {
        cmd.env("ALLGRAD_REQUIRE", r);
    }
    process::run(&mut cmd, "the child test", Duration::from_secs(60)).0
}

#[test]
fn a_skip_is_printed_and_recorded_and_fails_where_required() {
    let log = std::env::temp_dir().join(format!("allgrad-testkit-skips-{}", std::process::id()));
    let _ = std::fs::remove_file(&log);
    let line = "SKIPPED skip::child [shm]: pretending /dev/shm is absent (runs when: the host has a /dev/shm directory)";

    let out = run_child(&log, None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.lines().any(|l| l == line), "{err}");
    assert_eq!(std::fs::read_to_string(&log).unwrap(), format!("{line}\n"));

    // Listed in ALLGRAD_REQUIRE: the test fails, saying what was missing, and records nothing.
    for require in ["netns,shm", "all"] {
        let out = run_child(&log, Some(require));
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(!out.status.success(), "ALLGRAD_REQUIRE={require}: the skip passed:\n{text}");
        assert!(text.contains("skip::child cannot run: pretending /dev/shm is absent"), "{text}");
    }
    assert_eq!(std::fs::read_to_string(&log).unwrap(), format!("{line}\n"));
    let _ = std::fs::remove_file(&log);
}

#[test]
#[should_panic(expected = "still running after")]
fn a_child_past_its_limit_is_killed_and_fails_the_test() {
    process::run(Command::new("sleep").arg("30"), "sleep 30", Duration::from_millis(300));
}

#[test]
fn a_descendant_holding_the_output_open_fails_the_wait_and_is_killed() {
    // The shell exits at once; the `sleep` it leaves in the background keeps stdout open.
    let marker = "71.4242";
    let r = std::panic::catch_unwind(|| {
        let mut sh = Command::new("sh");
        sh.args(["-c", &format!("sleep {marker} & echo started")]);
        process::spawn(&mut sh, "sh", Duration::from_secs(30)).pipe_grace(Duration::from_millis(500)).wait()
    });
    let msg = r.expect_err("the wait returned although a descendant held the output open");
    let msg = msg.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(msg.contains("its output was still open"), "{msg}");
    std::thread::sleep(Duration::from_millis(200));
    let left = Command::new("pgrep").args(["-f", &format!("sleep {marker}")]).output().unwrap();
    assert!(left.stdout.is_empty(), "the descendant survived: {}", String::from_utf8_lossy(&left.stdout));
}
