//! Every shipped config in `configs/` loads, validates for 1 and 2 ranks, and trains one small
//! step on 2 thread-ranks with its own model, loss and data (data paths are relative to the
//! repository root, where the README's commands run).

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
        for w in [1, 2] {
            cfg.validate(w, &path).unwrap_or_else(|e| panic!("{} on {w} rank(s): {e}", path.display()));
        }
        // One step at a small batch, no evaluation: the sections fit together.
        let sets = ["train.global_batch=8", "train.max_steps=1", "train.eval=false", "log.progress=quiet", "log.plot=false"];
        let mut sets: Vec<String> = sets.map(String::from).to_vec();
        if let Some(dir) = cfg.sections.get("data").and_then(|d| d.get("dir")).and_then(|d| d.as_str()) {
            sets.push(format!("data.dir={}", root.join(dir).display()));
        }
        let small = RunConfig::load(&path, &sets).unwrap();
        let losses = run_threads(2, |pg| Ok(run::build(&small, pg, None, false)?.train()?.last_loss))
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(losses[0].is_finite() && losses[0] == losses[1], "{}: losses {losses:?}", path.display());
    }
}
