//! `ALLGRAD_DEVICE_PATH=1` end to end: `train` under `launch` on 2 ranks, with the CPU run
//! through the code path CUDA tensors take and its host traffic counted where it happens (in
//! Candle's copy functions, `candle_core::host_traffic`, on every thread of each rank's
//! process). For SimCLR, SimCSE, the face head and CLIP, each with what it supports of tiled
//! losses (`loss.tile`), a queue of past keys (`loss.queue`), gradient caching
//! (`train.cache_chunk`) and a learned temperature (CLIP's `logit_scale`), every step after the
//! first (which builds the per-shape constants) makes, on rank 0:
//! - no read and no synchronisation in its forward, backward, gradient sync and optimizer
//!   (`host_traffic.step_reads` of `metrics.jsonl`);
//! - exactly one read in the whole process during the step, the loss and the gradient norm after
//!   the update (`host_traffic.reads`), and no synchronisation.
//!
//! Uploads (a batch's inputs and labels, dropout masks, sampled rows) are printed, not asserted
//! here; `crates/allgrad-train/tests/train/device_path.rs` pins the SimCLR step's exactly.
//!
//! A read added anywhere on the step path (a `to_scalar` in a loss, a `to_vec1` in a layer, on any
//! thread) breaks the second figure.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use crate::common;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// One method's run: its config and its `--set`s.
struct Case {
    tag: &'static str,
    config: PathBuf,
    sets: Vec<String>,
}

fn cases() -> Vec<Case> {
    let common = |extra: &[&str]| -> Vec<String> {
        ["train.max_steps=4", "train.eval=false", "log.every=1", "log.progress=quiet", "log.plot=false", "checkpoint.every=0"]
            .iter()
            .chain(extra)
            .map(|s| s.to_string())
            .collect()
    };
    let tiny_bert = repo().join("crates/allgrad-models/tests/data/tiny-bert");
    vec![
        Case {
            tag: "simclr",
            config: repo().join("configs/simclr.yaml"),
            sets: common(&[
                "train.global_batch=16",
                "loss={kind: nt_xent, temperature: 0.5, tile: 6, queue: 2}",
                "train.cache_chunk=4",
            ]),
        },
        Case {
            tag: "simcse",
            config: repo().join("configs/simcse.yaml"),
            sets: common(&[
                &format!("model.dir={}", tiny_bert.display()),
                "model.max_len=12",
                "data.limit=64",
                "train.global_batch=16",
                "loss={temperature: 0.05, tile: 6, queue: 2}",
                "train.cache_chunk=4",
            ]),
        },
        Case { tag: "face", config: repo().join("configs/face.yaml"), sets: common(&["train.global_batch=16"]) },
        Case {
            tag: "clip",
            config: repo().join("configs/clip.yaml"),
            sets: common(&["data.limit=36", "train.global_batch=12", "loss={kind: clip, tile: 4}", "train.cache_chunk=2"]),
        },
    ]
}

/// The `host_traffic` of each step line of a run's `metrics.jsonl`, by step.
fn traffic(run: &Path) -> Vec<(u64, Value)> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).expect("metrics.jsonl");
    text.lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .filter(|v| v.get("loss").is_some())
        .map(|v| {
            let t = v.get("host_traffic").cloned().unwrap_or_else(|| panic!("no host_traffic on the device path: {v}"));
            (v["step"].as_u64().unwrap(), t)
        })
        .collect()
}

#[test]
fn on_the_device_path_four_methods_read_once_per_step_after_the_update_and_never_inside_it() {
    let d = tempfile::tempdir().unwrap();
    for case in cases() {
        let out = d.path().join(case.tag);
        let mut c = Command::new(env!("CARGO_BIN_EXE_launch"));
        c.args(["--nproc-per-node", "2", env!("CARGO_BIN_EXE_train"), "--config", &case.config.display().to_string()]);
        for s in &case.sets {
            c.args(["--set", s]);
        }
        c.args(["--output-dir", &out.display().to_string()]).env("ALLGRAD_DEVICE_PATH", "1");
        let (o, _) = common::run_with_watchdog(&mut c, Duration::from_secs(300));
        assert!(
            o.status.success(),
            "{}: stdout:\n{}\nstderr:\n{}",
            case.tag,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        let steps = traffic(&out);
        assert_eq!(steps.iter().map(|s| s.0).collect::<Vec<_>>(), [1, 2, 3, 4], "{}: the step lines", case.tag);
        for (step, t) in steps.iter().skip(1) {
            println!("{} step {step}: {t}", case.tag);
            let n = |k: &str| t[k].as_u64().unwrap_or_else(|| panic!("{}: no {k} in {t}", case.tag));
            assert_eq!(n("step_reads"), 0, "{} step {step}: the step read inside its regions: {t}", case.tag);
            assert_eq!(n("reads"), 1, "{} step {step}: the process read other than the step's figures: {t}", case.tag);
            assert_eq!(n("syncs"), 0, "{} step {step}: the process synchronised: {t}", case.tag);
        }
    }
}
