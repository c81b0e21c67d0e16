//! TensorBoard's events file of a `train` run: TensorBoard's own reader returns every scalar of
//! metrics.jsonl at its step, also after a crash and a resume; rank 0 alone writes one, and
//! `log.tensorboard: false` writes none.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use crate::common;

fn config(rest: &str) -> String {
    common::vectors_config(&format!(
        "train: {{global_batch: 24, epochs: 2}}\ncheckpoint: {{every: 2, keep_last: 2}}\nlog: {{every: 1, progress: lines{rest}}}\n"
    ))
}

fn ok(out: &Output) {
    assert!(
        out.status.success(),
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn events_files(run: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(run)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("events.out.tfevents."))
        .collect();
    names.sort();
    names
}

/// Every scalar of metrics.jsonl by (tag, step), rounded to f32 as the events file stores it;
/// `step` and `epoch` are coordinates, `host_traffic`'s fields are `host_traffic/<field>`.
fn metrics_scalars(run: &Path) -> BTreeMap<(String, u64), f32> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let step = v["step"].as_u64().unwrap();
        let mut put = |tag: String, x: &serde_json::Value| {
            let x = x.as_f64().unwrap_or_else(|| panic!("{tag} at step {step} is not a number: {line}"));
            assert!(out.insert((tag.clone(), step), x as f32).is_none(), "{tag} twice at step {step} in metrics.jsonl");
        };
        for (k, x) in v.as_object().unwrap() {
            match k.as_str() {
                "step" | "epoch" => {}
                "host_traffic" => x.as_object().unwrap().iter().for_each(|(f, y)| put(format!("host_traffic/{f}"), y)),
                _ => put(k.clone(), x),
            }
        }
    }
    out
}

/// A run trained to step 2, resumed and crashed while saving step 4 (metrics.jsonl and the
/// events file then hold steps 3 and 4, with an evaluation at 4, past the checkpoint), then
/// resumed to the end: TensorBoard's `EventAccumulator` (`scripts/reference/tb_read.py`,
/// tensorboard 2.21.0 through ALLGRAD_PYTHON) returns exactly the scalars of metrics.jsonl,
/// every tag at every step once, each value equal to metrics.jsonl's rounded to f32 (the
/// events file's `simple_value`; exact equality, no tolerance). The crashed run's steps 3 and
/// 4 differ in samples/s from the resumed run's, so a reader that kept them (no restart
/// marker: seen failing, steps 3 and 4 twice) or a writer that lost a line fails.
#[test]
fn tensorboards_reader_returns_every_scalar_of_metrics_jsonl_after_a_crash_and_resume() {
    let Some(python) = std::env::var_os("ALLGRAD_PYTHON").filter(|p| !p.is_empty()) else {
        return allgrad_testkit::skip(
            allgrad_testkit::Need::Torch,
            "ALLGRAD_PYTHON is not set: no Python with tensorboard to read the events file",
        );
    };
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("run.yaml"), config("")).unwrap();
    let limit = Duration::from_secs(120);
    let run = d.path().join("run");
    let train = |args: &[&str]| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_train"));
        c.arg("--config").arg(d.path().join("run.yaml")).args(args).arg("--output-dir").arg(&run);
        c
    };
    ok(&common::run_with_watchdog(&mut train(&["--stop-after", "2"]), limit).0);
    let crashed = common::run_with_watchdog(train(&["--resume"]).env("ALLGRAD_FAULT", "checkpoint:model"), limit).0;
    assert!(!crashed.status.success(), "the fault did not fire");
    ok(&common::run_with_watchdog(&mut train(&["--resume"]), limit).0);
    assert!(!events_files(&run).is_empty(), "no events file in {}", run.display());

    let out = common::run_with_watchdog(
        Command::new(python).arg(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/reference/tb_read.py")).arg(&run),
        limit,
    )
    .0;
    ok(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    let mut read: BTreeMap<(String, u64), f32> = BTreeMap::new();
    let mut dups = Vec::new();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let Some(tag) = v["tag"].as_str() else { continue };
        let (step, value) = (v["step"].as_u64().unwrap(), v["value"].as_f64().unwrap());
        // Python's float of an f32 holds it exactly: the cast back loses nothing.
        if read.insert((tag.to_string(), step), value as f32).is_some() {
            dups.push(format!("{tag}@{step}"));
        }
    }
    assert!(dups.is_empty(), "TensorBoard's reader returned these (tag, step) more than once: {dups:?}");
    let want = metrics_scalars(&run);
    // Steps 1..=8 with loss, lr, samples/s and gradient norm, and the evaluations at 0, 4, 8.
    assert_eq!(want.len(), 8 * 4 + 3, "{want:?}");
    assert_eq!(read, want);
}

/// Under `launch` with 2 ranks, the run directory holds rank 0's records alone: one version
/// record and one record per metrics.jsonl line (both ranks share a host, so a second writer
/// in the same second would append to the same file name: the records are counted, not the
/// files; seen failing with every rank writing); with `log.tensorboard: false`, no file.
#[test]
fn rank_0_alone_writes_the_events_file_and_log_tensorboard_false_writes_none() {
    let d = tempfile::tempdir().unwrap();
    let limit = Duration::from_secs(120);
    for (name, rest, want) in [("on", "", 1), ("off", ", tensorboard: false", 0)] {
        let cfg = d.path().join(format!("{name}.yaml"));
        std::fs::write(&cfg, config(rest)).unwrap();
        let run = d.path().join(name);
        let mut c = Command::new(env!("CARGO_BIN_EXE_launch"));
        c.args(["--nproc-per-node", "2", env!("CARGO_BIN_EXE_train"), "--config"]).arg(&cfg).arg("--output-dir").arg(&run);
        ok(&common::run_with_watchdog(&mut c, limit).0);
        let files = events_files(&run);
        assert_eq!(files.len(), want, "{name}: {files:?}");
        if want > 0 {
            let lines = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap().lines().count();
            let records: usize = files.iter().map(|f| records(&std::fs::read(run.join(f)).unwrap())).sum();
            assert_eq!(records, 1 + lines, "records of {files:?} against {lines} metrics lines");
        }
    }
}

/// The number of records of an events file, walking their length fields.
fn records(bytes: &[u8]) -> usize {
    let (mut at, mut n) = (0, 0);
    while at + 8 <= bytes.len() {
        at += 16 + u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
        n += 1;
    }
    assert_eq!(at, bytes.len(), "a truncated record");
    n
}
