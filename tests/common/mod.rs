//! Shared by the tests that run the binaries as processes: a watchdog around a child, the
//! path of a built example, and the small vectors run they train.

#![allow(dead_code)] // each test file uses a different subset

use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The 96-sample vectors run the process tests train (2-rank, 3-rank and resumed runs must
/// end where one rank does), followed by `rest`: its `train`, `checkpoint` and `log` sections.
pub fn vectors_config(rest: &str) -> String {
    format!(
        "seed: 5\n\
         method: vectors\n\
         data: {{kind: vectors, samples: 96, dim: 8, clusters: 4, view_noise: 0.5}}\n\
         model: {{kind: mlp, hidden: 16, out: 8}}\n\
         loss: {{kind: nt_xent, temperature: 0.3}}\n\
         optim: {{kind: lars, lr: 0.4, weight_decay: 0.0001}}\n\
         schedule: {{warmup_steps: 2}}\n\
         {rest}"
    )
}

/// Waits for `child` with a watchdog: kills it and fails the test after `limit` (without
/// reading its pipes, which a surviving grandchild could hold open). Returns its output and
/// how long it ran.
pub fn wait_with_watchdog(mut child: Child, what: &str, limit: Duration) -> (Output, Duration) {
    let t = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return (child.wait_with_output().unwrap(), t.elapsed());
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            panic!("watchdog: {what} still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs `cmd` (stdout and stderr captured) under [`wait_with_watchdog`].
pub fn run_with_watchdog(cmd: &mut Command, limit: Duration) -> (Output, Duration) {
    let child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    wait_with_watchdog(child, &format!("{cmd:?}"), limit)
}

/// A built example: examples are built next to the test binaries' directory,
/// target/<profile>/examples.
pub fn example(name: &str) -> PathBuf {
    let mut p = std::env::current_exe().unwrap();
    p.pop();
    p.pop();
    p.push("examples");
    p.push(name);
    assert!(p.exists(), "{} is not built (cargo test builds examples; run `cargo build --examples`)", p.display());
    p
}
