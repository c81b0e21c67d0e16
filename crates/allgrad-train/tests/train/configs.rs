//! Every shipped config in `configs/` loads, validates for 1 and 2 ranks, and trains one small
//! step on 2 thread-ranks with its own loss and data (data paths are relative to the
//! repository root, where the README's commands run) and its own model, except that the SimCSE
//! configs' pretrained BERT (all-MiniLM-L6-v2, fetched by scripts/data/get_minilm.sh) is replaced by
//! the committed tiny BERT; a second test steps the SimCSE configs on all-MiniLM-L6-v2 itself,
//! and skips when it has not been fetched; a third runs the CLIP config's evaluation (zero-shot
//! classification and retrieval) before and after a step.

use std::path::{Path, PathBuf};

use allgrad_dist::run_threads;
use allgrad_train::{run, RunConfig};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn shipped() -> Vec<PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(root().join("configs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 3, "expected the shipped configs, found {files:?}");
    files
}

/// Loads, validates for 1 and 2 ranks, and trains one step at a small batch on 2 thread-ranks;
/// `model` replaces the SimCSE model's folder (with its sequence limit).
fn load_validate_and_step(path: &Path, model: Option<&Path>) {
    let root = root();
    let mut fixed = Vec::new();
    let cfg = RunConfig::load(path, &[]).unwrap_or_else(|e| panic!("{e}"));
    if cfg.method == "simcse" {
        // SimCSE checks that its files exist: the paths from the root.
        fixed = simcse_paths(&cfg, &root);
        if let Some(dir) = model {
            fixed.push(format!("model.dir={}", dir.display()));
            fixed.push("model.max_len=16".into());
        }
    }
    // A CLIP run from shards: captioned shards of the bundled images written here, as
    // `write-shards --captions` writes them (10 shards of 8 pairs, the names the config lists).
    let shards = tempfile::tempdir().unwrap();
    if cfg.method == "clip" && cfg.sections().get("data").and_then(|d| d.get("shards")).is_some() {
        write_caption_shards(shards.path(), &root);
        fixed.push(format!("data.shards={}", shards.path().display()));
    }
    let cfg = RunConfig::load(path, &fixed).unwrap_or_else(|e| panic!("{e}"));
    for w in [1, 2] {
        cfg.validate(w, path).unwrap_or_else(|e| panic!("{} on {w} rank(s): {e}", path.display()));
    }
    // One step at a small batch, no evaluation: the sections fit together.
    let sets = ["train.global_batch=8", "train.max_steps=1", "train.eval=false", "log.progress=quiet", "log.plot=false"];
    let mut sets: Vec<String> = sets.map(String::from).to_vec();
    if let Some(dir) = cfg.sections().get("data").and_then(|d| d.get("dir")).and_then(|d| d.as_str()) {
        sets.push(format!("data.dir={}", root.join(dir).display()));
    }
    sets.extend(fixed);
    let small = RunConfig::load(path, &sets).unwrap();
    let losses = run_threads(2, |pg| Ok(run::build(&small, pg, None, false)?.train()?.last_loss))
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(losses[0].is_finite() && losses[0] == losses[1], "{}: losses {losses:?}", path.display());
}

/// `train-000000.tar` .. `train-000009.tar` in `dir`, 8 captioned Fashion-MNIST pairs each.
fn write_caption_shards(dir: &Path, root: &Path) {
    use allgrad_data::Dataset;
    let images = allgrad_data::IdxDataset::open_dir(root.join("data/fashion-mnist"), allgrad_data::Split::Train).unwrap();
    let mut w = allgrad_data::webdataset::ShardWriter::new(dir, "train", 8).unwrap();
    for i in 0..80 {
        let caption = format!("a photo of class {}", images.label(i).unwrap());
        w.write(&format!("train_{i:08}"), &[("png", &images.get(i).unwrap().to_png().unwrap()), ("txt", caption.as_bytes())])
            .unwrap();
    }
    assert_eq!(w.finish().unwrap().len(), 10);
}

#[test]
fn shipped_configs_load_validate_and_train_a_step_with_simcse_on_the_tiny_bert() {
    let tiny = root().join("crates/allgrad-models/tests/data/tiny-bert");
    // face_recordio.yaml reads files its script writes: the test below.
    for path in shipped().into_iter().filter(|p| !p.ends_with("face_recordio.yaml")) {
        load_validate_and_step(&path, Some(&tiny));
    }
}

#[test]
fn the_face_recordio_config_trains_a_step_and_scores_its_bin_on_what_its_script_writes() {
    let Some(python) = std::env::var_os("ALLGRAD_PYTHON").filter(|p| !p.is_empty()) else {
        return allgrad_testkit::skip(allgrad_testkit::Need::Torch, "ALLGRAD_PYTHON (a Python with NumPy and Pillow) is unset");
    };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("glyphs-recordio");
    let mut cmd = std::process::Command::new(python);
    cmd.arg(root().join("scripts/data/make_face_recordio.py")).arg(root().join("data/glyphs")).arg(&out).args(["--pairs", "20"]);
    let (o, _) = allgrad_testkit::process::run(&mut cmd, "make_face_recordio.py", std::time::Duration::from_secs(300));
    assert!(o.status.success(), "make_face_recordio.py: {}", String::from_utf8_lossy(&o.stderr));
    let path = root().join("configs/face_recordio.yaml");
    let sets: Vec<String> = [
        format!("data.dir={}", out.display()),
        format!("eval.verification=[{}]", out.join("glyphs_val.bin").display()),
        "train.global_batch=8".into(),
        "train.max_steps=1".into(),
        "log.progress=quiet".into(),
        "log.plot=false".into(),
    ]
    .to_vec();
    let cfg = RunConfig::load(&path, &sets).unwrap_or_else(|e| panic!("{e}"));
    for w in [1, 2] {
        cfg.validate(w, &path).unwrap_or_else(|e| panic!("{} on {w} rank(s): {e}", path.display()));
    }
    let ends = run_threads(2, |pg| {
        let s = run::build(&cfg, pg, None, false)?.train()?;
        Ok((s.last_loss, s.eval))
    })
    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(ends[0].0.is_finite() && ends[0].0 == ends[1].0, "losses {ends:?}");
    let acc = ends[0].1.iter().find(|(k, _)| k == "glyphs_val_acc").map(|(_, v)| *v);
    assert!(acc.is_some_and(|a| (0.0..=1.0).contains(&a)), "rank 0's evaluation: {:?}", ends[0].1);
}

#[test]
fn simcse_configs_train_a_step_on_their_pretrained_minilm() {
    let minilm = root().join("data/models/all-MiniLM-L6-v2/model.safetensors");
    if !minilm.is_file() {
        return allgrad_testkit::skip(allgrad_testkit::Need::MiniLm, "data/models/all-MiniLM-L6-v2 is absent");
    }
    let simcse: Vec<PathBuf> =
        shipped().into_iter().filter(|p| RunConfig::load(p, &[]).is_ok_and(|c| c.method == "simcse")).collect();
    assert!(!simcse.is_empty(), "no SimCSE config among the shipped ones");
    for path in simcse {
        load_validate_and_step(&path, None);
    }
}

/// `--set`s that make a SimCSE config's paths absolute (from the repository root).
fn simcse_paths(cfg: &RunConfig, root: &Path) -> Vec<String> {
    let mut sets = Vec::new();
    for (section, key) in
        [("data", "sentences"), ("data", "triplets"), ("model", "dir"), ("eval", "retrieval"), ("eval", "similarity_dir")]
    {
        if let Some(v) = cfg.sections().get(section).and_then(|d| d.get(key)).and_then(|d| d.as_str()) {
            sets.push(format!("{section}.{key}={}", root.join(v).display()));
        }
    }
    sets
}

#[test]
fn the_clip_config_evaluates_zero_shot_and_retrieval_before_and_after_a_step() {
    // configs/clip.yaml's eval section as shipped, on fewer test images: the untrained figures
    // (step 0) and those after one step are logged, each a fraction.
    let path = root().join("configs/clip.yaml");
    let sets: Vec<String> = [
        "train.global_batch=8",
        "train.max_steps=1",
        "eval.zero_shot=40",
        "eval.retrieval=20",
        "log.progress=quiet",
        "log.plot=false",
    ]
    .map(String::from)
    .to_vec();
    let cfg = RunConfig::load(&path, &sets).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(cfg.method, "clip");
    let evals = run_threads(2, |pg| Ok(run::build(&cfg, pg, None, false)?.train()?.eval)).unwrap();
    assert_eq!(evals[0], evals[1], "both ranks report the same figures");
    let names: Vec<&str> = evals[0].iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        names,
        ["zero_shot_top1", "image_to_text_r@1", "text_to_image_r@1", "image_to_text_r@5", "text_to_image_r@5"],
        "{evals:?}"
    );
    assert!(evals[0].iter().all(|(_, v)| (0.0..=1.0).contains(v)), "{evals:?}");
}
