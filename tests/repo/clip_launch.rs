//! `method: clip` as processes: `configs/clip.yaml` (shrunk: 36 pairs, global batch 12, 3
//! steps, f64) on 2 and 3 ranks under `launch` ends with the parameters of 1 rank, for CLIP's
//! loss (plain, and tiled with gradient caching) and SigLIP's (gathered and ring); `export-hf`
//! writes the run as a Hugging Face CLIP folder that reads back to the trained parameters.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use allgrad::models::clip::ClipFolder;
use candle_core::{DType, Device, Tensor};

use crate::common;

fn config() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/configs/clip.yaml"))
}

const SMALL: [&str; 8] = [
    "dtype=f64",
    "data.limit=36",
    "train.global_batch=12",
    "train.max_steps=3",
    "train.eval=false",
    "log.progress=quiet",
    "log.plot=false",
    "schedule.warmup_steps=1",
];

fn args(extra: &[&str], out: &Path) -> Vec<String> {
    let mut a = vec!["--config".to_string(), config().display().to_string()];
    for s in SMALL.iter().chain(extra) {
        a.push("--set".into());
        a.push(s.to_string());
    }
    a.push("--output-dir".into());
    a.push(out.display().to_string());
    a
}

fn ok(out: &Output) {
    assert!(
        out.status.success(),
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn latest(run_dir: &Path) -> HashMap<String, Tensor> {
    let name = std::fs::read_to_string(run_dir.join("checkpoints/latest")).expect("checkpoints/latest");
    candle_core::safetensors::load(run_dir.join("checkpoints").join(name.trim()).join("model.safetensors"), &Device::Cpu).unwrap()
}

fn flat(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap()
}

/// Largest `|a - b| / max(|b|_∞, 1e-2)` over the parameters, without the attention key
/// biases (their true gradient is 0; AdamW turns the rounding noise into full-size steps).
fn max_rel(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>) -> (f64, String) {
    let mut worst = (0.0, String::new());
    assert_eq!(a.len(), b.len(), "different parameter sets");
    for (name, t) in b {
        if name.ends_with("k_proj.bias") {
            continue;
        }
        let (x, y) = (flat(&a[name]), flat(t));
        let scale = y.iter().fold(1e-2f64, |s, v| s.max(v.abs()));
        let d = x.iter().zip(&y).fold(0f64, |m, (p, q)| m.max((p - q).abs() / scale));
        if d > worst.0 {
            worst = (d, name.clone());
        }
    }
    worst
}

#[test]
fn clip_and_siglip_on_2_and_3_launched_ranks_end_where_1_rank_does_and_export() {
    let d = tempfile::tempdir().unwrap();
    let limit = Duration::from_secs(300);
    for (tag, extra) in [
        ("clip", vec!["loss={kind: clip}"]),
        ("clip-tiled-cached", vec!["loss={kind: clip, tile: 4}", "train.cache_chunk=2"]),
        ("siglip-gather", vec!["loss={kind: siglip_gather}"]),
        ("siglip-ring", vec!["loss={kind: siglip_ring}"]),
    ] {
        let dir = |w: usize| d.path().join(format!("{tag}-w{w}"));
        let mut one = Command::new(env!("CARGO_BIN_EXE_train"));
        one.args(args(&extra, &dir(1)));
        ok(&common::run_with_watchdog(&mut one, limit).0);
        let reference = latest(&dir(1));
        for w in [2, 3] {
            let mut c = Command::new(env!("CARGO_BIN_EXE_launch"));
            c.args(["--nproc-per-node", &w.to_string(), env!("CARGO_BIN_EXE_train")]).args(args(&extra, &dir(w)));
            ok(&common::run_with_watchdog(&mut c, limit).0);
            let (e, name) = max_rel(&latest(&dir(w)), &reference);
            assert!(e <= 1e-10, "{tag} W={w}: parameters differ from 1 rank's by {e:.2e} (relative) in {name}");
        }
    }
    // The trained CLIP run as a Hugging Face folder, read back.
    let out = d.path().join("hf");
    let mut export = Command::new(env!("CARGO_BIN_EXE_export-hf"));
    export.args(["--run", &d.path().join("clip-w2").display().to_string(), "--out", &out.display().to_string()]);
    ok(&common::run_with_watchdog(&mut export, limit).0);
    let trained = latest(&d.path().join("clip-w2"));
    let written = candle_core::safetensors::load(out.join("model.safetensors"), &Device::Cpu).unwrap();
    for (name, t) in &trained {
        let w = written.get(name).unwrap_or_else(|| panic!("{name} missing from the export"));
        let a = flat(t);
        let b = flat(w);
        // f64 parameters exported as f32.
        let scale = a.iter().fold(1e-6f64, |s, v| s.max(v.abs()));
        assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() <= 1e-7 * scale), "{name}: exported values differ");
    }
    ClipFolder::open(&out).unwrap().model(DType::F32, &Device::Cpu).unwrap();
}
