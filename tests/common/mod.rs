//! Shared by the tests that run the binaries as processes: a watchdog around a child, the
//! path of a built example, and the small vectors run they train.

#![allow(dead_code)] // each test file uses a different subset

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::Duration;

pub use allgrad_testkit::process::Watched;

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

/// Starts `cmd` (stdout and stderr captured) in a process group of its own under a watchdog
/// (`allgrad_testkit::process`): waiting past `limit`, or for output that a surviving
/// descendant holds open, kills it and everything it started and fails the test.
pub fn spawn_watched(cmd: &mut Command, what: &str, limit: Duration) -> Watched {
    allgrad_testkit::process::spawn(cmd, what, limit)
}

/// Runs `cmd` under [`spawn_watched`]; returns its output and how long it ran.
pub fn run_with_watchdog(cmd: &mut Command, limit: Duration) -> (Output, Duration) {
    let what = format!("{cmd:?}");
    spawn_watched(cmd, &what, limit).wait()
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
