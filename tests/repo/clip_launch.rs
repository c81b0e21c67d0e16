//! `method: clip` as processes: `configs/clip.yaml` (shrunk: 36 pairs, global batch 12, 3
//! steps, f64) on 2 and 3 ranks under `launch` ends with the parameters of 1 rank, for CLIP's
//! loss (plain, tiled with gradient caching, and the ring tiled with gradient caching) and
//! SigLIP's (gathered and ring), and the rings on 3 ranks end where the gather forms on 1 do;
//! `export-hf`
//! writes the run as a Hugging Face CLIP folder that reads back to the trained parameters, and
//! that transformers' `CLIPModel` loads and computes allgrad's logits from (ALLGRAD_PYTHON);
//! `configs/clip_shards.yaml` (shrunk) trains from shards `write-shards --captions` wrote, on 2
//! ranks as on 1, and a run of it (CLIP's loss and SigLIP's) stopped in the middle of an epoch
//! resumes from its saved stream position (`stream.json`), on 2 ranks or on 3 or 1, and ends
//! where the uninterrupted run does.

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
        ("clip-ring-tiled-cached", vec!["loss={kind: clip_ring, tile: 3}", "train.cache_chunk=2"]),
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
    // The ring forms end where the gather forms do (the gather on 1 rank, the ring on 3).
    for (ring, gather) in [("clip-ring-tiled-cached", "clip"), ("siglip-ring", "siglip-gather")] {
        let (e, name) = max_rel(&latest(&d.path().join(format!("{ring}-w3"))), &latest(&d.path().join(format!("{gather}-w1"))));
        assert!(e <= 1e-10, "{ring} W=3 vs {gather} W=1: parameters differ by {e:.2e} (relative) in {name}");
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

/// The JSON `clip_features` prints for a CLIP folder: allgrad's features, logits and loss on
/// fixed inputs.
fn clip_features(dir: &Path) -> serde_json::Value {
    let mut c = Command::new(common::example("clip_features"));
    c.arg(dir);
    let (out, _) = common::run_with_watchdog(&mut c, Duration::from_secs(120));
    ok(&out);
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("clip_features {}: {e}", dir.display()))
}

fn json_floats(v: &serde_json::Value) -> Vec<f64> {
    match v {
        serde_json::Value::Array(a) => a.iter().flat_map(json_floats).collect(),
        v => vec![v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))],
    }
}

/// A CLIP run trained from `data/clip-tiny`'s weights (3 AdamW steps, so every weight moved)
/// and exported by `export-hf` loads in transformers' `CLIPModel` and `CLIPTokenizer`
/// (`scripts/reference/check_clip_export.py`, through ALLGRAD_PYTHON) and gives the token ids,
/// features, logits and loss that allgrad computes from the same folder (`clip_features`),
/// all in f32. An export that wrote the initial weights fails twice over: the weights are
/// checked to have moved, and the trained logits to differ from the initial ones by far more
/// than the tolerance.
#[test]
fn a_trained_clip_export_loads_in_transformers_and_gives_allgrads_logits() {
    let Some(python) = std::env::var_os("ALLGRAD_PYTHON").filter(|p| !p.is_empty()) else {
        return allgrad_testkit::skip(
            allgrad_testkit::Need::Torch,
            "ALLGRAD_PYTHON is not set: no Python with torch and transformers to load the export",
        );
    };
    let d = tempfile::tempdir().unwrap();
    let limit = Duration::from_secs(300);
    let init = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/data/clip-tiny"));
    let run = d.path().join("run");
    let model = format!("model={{dir: {}, pretrained: true}}", init.display());
    let mut train = Command::new(env!("CARGO_BIN_EXE_train"));
    train.args(args(&[&model, "loss={kind: clip}"], &run));
    ok(&common::run_with_watchdog(&mut train, limit).0);
    let out = d.path().join("hf");
    let mut export = Command::new(env!("CARGO_BIN_EXE_export-hf"));
    export.args(["--run", &run.display().to_string(), "--out", &out.display().to_string()]);
    ok(&common::run_with_watchdog(&mut export, limit).0);

    // Training moved the weights: each exported tensor against the one it started from, its
    // largest change over max(its largest value, 1e-2) (the biases start at 0). Measured: 1.9e-3
    // (logit_scale) to 0.5 (biases), three AdamW steps of lr 2e-3. The attention key biases are
    // left out: their true gradient is 0 (the softmax does not see them), and they moved by 1e-7
    // relative, through rounding alone.
    let before = candle_core::safetensors::load(init.join("model.safetensors"), &Device::Cpu).unwrap();
    let after = candle_core::safetensors::load(out.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut unmoved = Vec::new();
    let mut checked = 0;
    for (name, t) in &before {
        if !t.dtype().is_float() || name.ends_with("k_proj.bias") {
            continue;
        }
        let a = flat(after.get(name).unwrap_or_else(|| panic!("{name} missing from the export")));
        let b = flat(t);
        let scale = b.iter().fold(1e-2f64, |s, v| s.max(v.abs()));
        let moved = a.iter().zip(&b).fold(0f64, |m, (x, y)| m.max((x - y).abs())) / scale;
        checked += 1;
        if moved < 1e-3 {
            unmoved.push(format!("{name} ({moved:.1e})"));
        }
    }
    assert!(checked >= 70, "only {checked} tensors in data/clip-tiny");
    assert!(unmoved.is_empty(), "tensors training did not move: {unmoved:?}");

    let ours = clip_features(&out);
    let initial = clip_features(&init);
    let logits = json_floats(&ours["logits_per_image"]);
    // Measured: 2.1 (norm-wise); a tenth of that still stands far above the tolerance below.
    let moved = allgrad_testkit::close::rel_err(&logits, &json_floats(&initial["logits_per_image"]));
    assert!(moved > 0.2, "the trained logits differ from the initial ones by only {moved:.2e} (relative)");
    let json = d.path().join("allgrad.json");
    std::fs::write(&json, ours.to_string()).unwrap();
    let mut check = Command::new(python);
    check.arg(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/reference/check_clip_export.py")).arg(&out).arg(&json);
    let (res, _) = common::run_with_watchdog(&mut check, limit);
    let text = format!("{}{}", String::from_utf8_lossy(&res.stdout), String::from_utf8_lossy(&res.stderr));
    assert!(res.status.success(), "check_clip_export.py:\n{text}");
    assert!(text.lines().any(|l| l == "token ids equal: True"), "{text}");
    // Norm-wise, f32 on both sides. Measured: image features 2.3e-7, text features 2.0e-7,
    // logits 4.1e-7, loss 2e-16; the bound is ten times the largest.
    let tol = 4e-6;
    let mut seen = 0;
    for line in text.lines() {
        let Some((what, e)) =
            line.strip_prefix("allgrad vs transformers CLIPModel, ").and_then(|l| l.split_once(": relative error "))
        else {
            continue;
        };
        let e: f64 = e.trim().parse().unwrap_or_else(|_| panic!("not an error: {line}"));
        allgrad_testkit::close::report(&format!("trained export, {what}"), e, tol);
        assert!(e <= tol, "trained CLIP export, {what}: transformers against allgrad, relative error {e:e} > {tol:e}\n{text}");
        seen += 1;
    }
    assert_eq!(seen, 4, "check_clip_export.py printed {seen} errors, not 4:\n{text}");
}

/// `configs/clip_shards.yaml` (shrunk: 48 pairs of captioned shards written by `write-shards
/// --captions configs/clip.yaml`, global batch 12, 3 steps, f64) on 2 ranks under `launch` ends
/// with the parameters of 1 rank: the stream of shards gives every rank its part of the same
/// global batches, decoded, randomly cropped and tokenized on the loader's threads.
#[test]
fn clip_from_captioned_shards_on_2_launched_ranks_ends_where_1_rank_does() {
    let d = tempfile::tempdir().unwrap();
    let limit = Duration::from_secs(300);
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let shards = d.path().join("shards");
    let mut write = Command::new(env!("CARGO_BIN_EXE_write-shards"));
    write.args(["--format", "idx", "--dir"]).arg(repo.join("data/fashion-mnist"));
    write.args(["--captions"]).arg(repo.join("configs/clip.yaml")).args(["--out"]).arg(&shards);
    write.args(["--per-shard", "12", "--limit", "48"]);
    let (out, _) = common::run_with_watchdog(&mut write, limit);
    ok(&out);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "train-{000000..000003}.tar");
    let run = |w: usize| {
        let dir = d.path().join(format!("w{w}"));
        let sets = [
            "dtype=f64".to_string(),
            format!("data.shards={}", shards.display()),
            "data.webdataset={train: [\"train-{000000..000003}.tar\"], epoch_samples: 48, streams: 4, shuffle_buffer: 6, resampled: false}".into(),
            "train.global_batch=12".into(),
            "train.max_steps=3".into(),
            "train.eval=false".into(),
            "log.progress=quiet".into(),
            "log.plot=false".into(),
            "schedule.warmup_steps=1".into(),
        ];
        let mut a = vec!["--config".to_string(), repo.join("configs/clip_shards.yaml").display().to_string()];
        for s in sets {
            a.push("--set".into());
            a.push(s);
        }
        a.push("--output-dir".into());
        a.push(dir.display().to_string());
        let mut c = if w == 1 {
            Command::new(env!("CARGO_BIN_EXE_train"))
        } else {
            let mut c = Command::new(env!("CARGO_BIN_EXE_launch"));
            c.args(["--nproc-per-node", &w.to_string(), env!("CARGO_BIN_EXE_train")]);
            c
        };
        c.args(a);
        ok(&common::run_with_watchdog(&mut c, limit).0);
        latest(&dir)
    };
    let one = run(1);
    let (e, name) = max_rel(&run(2), &one);
    assert!(e <= 1e-10, "shards W=2: parameters differ from 1 rank's by {e:.2e} (relative) in {name}");
}

/// Captioned shards of the bundled Fashion-MNIST, as `write-shards --captions configs/clip.yaml`
/// writes them: the first `n` training pairs, 12 per shard, in `dir`.
fn captioned_shards(dir: &Path, n: usize, limit: Duration) -> String {
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut write = Command::new(env!("CARGO_BIN_EXE_write-shards"));
    write.args(["--format", "idx", "--dir"]).arg(repo.join("data/fashion-mnist"));
    write.args(["--captions"]).arg(repo.join("configs/clip.yaml")).args(["--out"]).arg(dir);
    write.args(["--per-shard", "12", "--limit", &n.to_string()]);
    let (out, _) = common::run_with_watchdog(&mut write, limit);
    ok(&out);
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The model and optimizer state of a run's newest checkpoint, by file and name.
fn final_state(run_dir: &Path) -> HashMap<String, Tensor> {
    let name = std::fs::read_to_string(run_dir.join("checkpoints/latest")).expect("checkpoints/latest");
    let ck = run_dir.join("checkpoints").join(name.trim());
    let mut out = HashMap::new();
    for file in ["model", "optimizer"] {
        let tensors: HashMap<String, Tensor> =
            candle_core::safetensors::load(ck.join(format!("{file}.safetensors")), &Device::Cpu).unwrap();
        out.extend(tensors.into_iter().map(|(n, t)| (format!("{file}/{n}"), t)));
    }
    out.insert(
        "step".into(),
        Tensor::new(&[name.trim().trim_start_matches("step_").parse::<f64>().unwrap()], &Device::Cpu).unwrap(),
    );
    out
}

/// `configs/clip_shards.yaml` shrunk: 96 captioned pairs in 8 shards read by 6 streams (so
/// that 1, 2 and 3 ranks divide them), epochs of 48 pairs (4 steps of 12), two epochs, f64,
/// random crops on (each sample's crop is keyed by its place in the stream), a checkpoint
/// after every step. Stopped on 2 ranks in the middle of the first epoch (step 2) and of the
/// second (step 6), then resumed from the saved stream position on 2 ranks, on 3 or on 1: the
/// parameters and AdamW's state end where the uninterrupted 2-rank run's end (bit for bit on
/// 2 ranks; on 3 and 1 only the rounding of sums split over other ranks differs, f64 relative
/// 1e-10). Once for CLIP's loss, once for SigLIP's.
#[test]
fn clip_and_siglip_from_shards_stopped_mid_epoch_resume_at_the_saved_stream_position_on_2_3_and_1_ranks() {
    let d = tempfile::tempdir().unwrap();
    let limit = Duration::from_secs(300);
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let shards = d.path().join("shards");
    assert_eq!(captioned_shards(&shards, 96, limit), "train-{000000..000007}.tar");
    for loss in ["clip", "siglip_gather"] {
        let sets: Vec<String> = [
            "dtype=f64".to_string(),
            format!("data.shards={}", shards.display()),
            "data.webdataset={train: [\"train-{000000..000007}.tar\"], epoch_samples: 48, streams: 6, shuffle_buffer: 6, resampled: false}".into(),
            format!("loss={{kind: {loss}}}"),
            "train.global_batch=12".into(),
            "train.epochs=2".into(),
            "train.eval=false".into(),
            "checkpoint={every: 1, keep_last: 2}".into(),
            "log.progress=quiet".into(),
            "log.plot=false".into(),
            "schedule.warmup_steps=1".into(),
        ]
        .into_iter()
        .flat_map(|s| ["--set".to_string(), s])
        .collect();
        let job = |w: usize, out: &Path, extra: &[&str]| {
            let mut c = if w == 1 {
                Command::new(env!("CARGO_BIN_EXE_train"))
            } else {
                let mut c = Command::new(env!("CARGO_BIN_EXE_launch"));
                c.args(["--nproc-per-node", &w.to_string(), env!("CARGO_BIN_EXE_train")]);
                c
            };
            c.arg("--config").arg(repo.join("configs/clip_shards.yaml")).args(&sets).arg("--output-dir").arg(out);
            c.args(extra).env("ALLGRAD_LOG", "info").env("ALLGRAD_TIMEOUT_S", "60");
            let (res, _) = common::run_with_watchdog(&mut c, limit);
            ok(&res);
            String::from_utf8_lossy(&res.stderr).into_owned()
        };
        let straight = d.path().join(format!("{loss}-straight"));
        job(2, &straight, &[]);
        let want = final_state(&straight);
        assert_eq!(flat(&want["step"]), vec![8.0]);
        let cases: &[(usize, usize)] = if loss == "clip" { &[(2, 2), (6, 3), (2, 1)] } else { &[(6, 2), (2, 3)] };
        for &(stop, w) in cases {
            let out = d.path().join(format!("{loss}-stop{stop}-w{w}"));
            job(2, &out, &["--stop-after", &stop.to_string()]);
            let saved = out.join(format!("checkpoints/step_{stop}/stream.json"));
            assert!(saved.exists(), "{loss}: no stream position saved at step {stop} ({})", saved.display());
            let err = job(w, &out, &["--resume"]);
            assert!(err.contains("the stream resumes at its saved position"), "{loss}: the saved position was not used:\n{err}");
            assert!(err.contains(&format!("at step {stop}")), "{loss}: not resumed at step {stop}:\n{err}");
            let got = final_state(&out);
            assert_eq!(got.len(), want.len(), "{loss}: different state sets");
            let mut worst = (0f64, String::new());
            for (name, t) in &want {
                let (x, y) = (flat(&got[name]), flat(t));
                if w == 2 {
                    // The same ranks read the same streams: bit for bit.
                    assert!(
                        x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits()),
                        "{loss}, stop {stop}, W=2: {name} differs"
                    );
                    continue;
                }
                // The attention key biases are left out on other W: their true gradient is 0,
                // and AdamW turns rounding noise into full-size steps (as the W tests above).
                if name.contains("k_proj.bias") {
                    continue;
                }
                let scale = y.iter().fold(1e-2f64, |s, v| s.max(v.abs()));
                let e = x.iter().zip(&y).fold(0f64, |m, (p, q)| m.max((p - q).abs() / scale));
                if e > worst.0 {
                    worst = (e, name.clone());
                }
            }
            assert!(
                worst.0 <= 1e-10,
                "{loss}: stopped at step {stop} on 2 ranks, resumed on {w}: largest relative difference {:.2e} in {}",
                worst.0,
                worst.1
            );
        }
    }
}
