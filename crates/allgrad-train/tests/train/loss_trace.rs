//! A stored loss trace: `configs/vectors.yaml` (64 steps: 8 epochs of 8 batches) on one rank
//! must reproduce, bit for bit on this CPU, the losses in `tests/data/vectors_loss_trace.txt`.
//! Any change to the numerics (initialisation, data, keyed RNG, kernels, optimizer, schedule)
//! shows up here as the first differing step.
//!
//! To regenerate the file after an intended numeric change:
//!
//! ```text
//! ALLGRAD_WRITE_LOSS_TRACE=1 cargo test -p allgrad-train --test train loss_trace::
//! ```
//!
//! and commit the new file IN THE SAME COMMIT as the change, saying in the message why the
//! numbers moved. (Another CPU or compiler may round differently: the trace is this
//! project's reference machine's; a mismatch elsewhere names the first step that differs.)

use std::path::Path;

use allgrad_dist::run_threads;
use allgrad_train::{run, RunConfig};

fn trace() -> Vec<(usize, f64)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let sets = ["log.every=1", "log.progress=quiet", "log.plot=false", "train.eval=false"].map(String::from);
    let cfg = RunConfig::load(&root.join("configs/vectors.yaml"), &sets).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().to_path_buf();
    let steps = run_threads(1, |pg| Ok(run::build(&cfg, pg, Some(out.clone()), false)?.train()?.steps)).unwrap();
    assert_eq!(steps[0], 64, "configs/vectors.yaml no longer runs 64 steps");
    std::fs::read_to_string(dir.path().join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter_map(|v| Some((v["step"].as_u64()? as usize, v.get("loss")?.as_f64()?)))
        .collect()
}

#[test]
fn vectors_config_reproduces_the_stored_loss_trace_bitwise() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/vectors_loss_trace.txt");
    let got = trace();
    assert_eq!(got.len(), 64, "expected a loss for each of 64 steps, got {}", got.len());
    if std::env::var_os("ALLGRAD_WRITE_LOSS_TRACE").is_some() {
        let mut text = String::from("# step loss(f64 bits, hex) loss(decimal): configs/vectors.yaml, 1 rank\n");
        for (s, l) in &got {
            text += &format!("{s} {:016x} {l:e}\n", l.to_bits());
        }
        std::fs::write(&path, text).unwrap();
        return;
    }
    let stored: Vec<(usize, u64)> = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (see this test's docs to write it)", path.display()))
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[0].parse().unwrap(), u64::from_str_radix(f[1], 16).unwrap())
        })
        .collect();
    assert_eq!(stored.len(), got.len(), "the stored trace has {} steps", stored.len());
    for ((s, want), (gs, l)) in stored.iter().zip(&got) {
        assert_eq!(s, gs, "step numbers differ");
        assert!(
            l.to_bits() == *want,
            "first differing step {s}: loss {l:e}, stored {:e} (regenerate as this test's docs say if the change is intended)",
            f64::from_bits(*want)
        );
    }
}
