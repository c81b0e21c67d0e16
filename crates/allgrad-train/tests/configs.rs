//! Every shipped config in `configs/` loads, validates for 1 and 2 ranks, and trains one small
//! step on 2 thread-ranks with its own model, loss and data (data paths are relative to the
//! repository root, where the README's commands run). A SimCSE config whose pretrained BERT
//! (all-MiniLM-L6-v2, fetched by scripts/get_minilm.sh) is absent trains its step on the
//! committed tiny BERT instead, and says so.

use std::path::Path;

use allgrad_dist::run_threads;
use allgrad_train::{run, RunConfig};

#[test]
fn shipped_configs_load_validate_and_train_a_step() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut files: Vec<_> = std::fs::read_dir(root.join("configs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 3, "expected the shipped configs, found {files:?}");
    for path in files {
        let cfg = RunConfig::load(&path, &[]).unwrap_or_else(|e| panic!("{e}"));
        // SimCSE checks that its files exist: validate with the paths from the root.
        let cfg = match cfg.method.as_str() {
            "simcse" => RunConfig::load(&path, &simcse_paths(&cfg, &root, &path)).unwrap(),
            _ => cfg,
        };
        for w in [1, 2] {
            cfg.validate(w, &path).unwrap_or_else(|e| panic!("{} on {w} rank(s): {e}", path.display()));
        }
        // One step at a small batch, no evaluation: the sections fit together.
        let sets = ["train.global_batch=8", "train.max_steps=1", "train.eval=false", "log.progress=quiet", "log.plot=false"];
        let mut sets: Vec<String> = sets.map(String::from).to_vec();
        if let Some(dir) = cfg.sections.get("data").and_then(|d| d.get("dir")).and_then(|d| d.as_str()) {
            sets.push(format!("data.dir={}", root.join(dir).display()));
        }
        if cfg.method == "simcse" {
            sets.extend(simcse_paths(&RunConfig::load(&path, &[]).unwrap(), &root, &path));
        }
        let small = RunConfig::load(&path, &sets).unwrap();
        let losses = run_threads(2, |pg| Ok(run::build(&small, pg, None, false)?.train()?.last_loss))
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(losses[0].is_finite() && losses[0] == losses[1], "{}: losses {losses:?}", path.display());
    }
}

/// `--set`s that make a SimCSE config's paths absolute (from the repository root), with the
/// committed tiny BERT in place of a pretrained model that has not been fetched.
fn simcse_paths(cfg: &RunConfig, root: &Path, path: &Path) -> Vec<String> {
    let mut sets = Vec::new();
    for (section, key) in
        [("data", "sentences"), ("data", "triplets"), ("model", "dir"), ("eval", "retrieval"), ("eval", "similarity_dir")]
    {
        if let Some(v) = cfg.sections.get(section).and_then(|d| d.get(key)).and_then(|d| d.as_str()) {
            sets.push(format!("{section}.{key}={}", root.join(v).display()));
        }
    }
    let model = cfg.sections.get("model").and_then(|m| m.get("dir")).and_then(|d| d.as_str()).unwrap_or_default();
    if !root.join(model).join("model.safetensors").is_file() {
        let tiny = root.join("crates/allgrad-models/tests/data/tiny-bert");
        println!("{}: {model} is absent (scripts/get_minilm.sh fetches it): stepping on the tiny BERT", path.display());
        sets.push(format!("model.dir={}", tiny.display()));
        sets.push("model.max_len=16".into());
    }
    sets
}
