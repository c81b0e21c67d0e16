//! `precision: tf32` through the trainer: building a trainer with it turns TF32 on for the run
//! (`allgrad_nn::tf32`, the switch cuDNN's convolutions and cuBLAS's f32 GEMMs read), and
//! `full` turns it off again; on the CPU TF32 is plain f32, so a tf32 run equals a full one bit
//! for bit. That TF32 changes a GPU's arithmetic when on is checked on a GPU by
//! `crates/allgrad-nn/tests/conv_cuda.rs`. One test in a binary of its own: the switch is
//! process-wide, and another test building a trainer at the same time would flip it.

use std::path::Path;

use allgrad_dist::run_threads;
use allgrad_train::{run, RunConfig};

fn config(precision: &str) -> RunConfig {
    let text = "seed: 5\nmethod: vectors\n\
                data: {kind: vectors, samples: 48, dim: 6, clusters: 3, view_noise: 0.4}\n\
                model: {kind: mlp, hidden: 8, out: 4}\n\
                train: {global_batch: 12, epochs: 1, max_steps: 3, eval: false}\n\
                log: {progress: quiet, plot: false}\n";
    RunConfig::parse(text, Path::new("tf32.yaml"), &[format!("precision={precision}")]).unwrap()
}

/// The TF32 switch once the trainer is built, and the parameters' bits after 3 steps.
fn run_with(precision: &str) -> (bool, Vec<u32>) {
    let cfg = config(precision);
    run_threads(1, |pg| {
        let mut t = run::build(&cfg, pg, None, false)?;
        let on = allgrad_nn::tf32();
        t.train_until(3)?;
        let mut bits = Vec::new();
        for (_, v) in t.params() {
            bits.extend(v.flatten_all()?.to_vec1::<f32>()?.iter().map(|x| x.to_bits()));
        }
        Ok((on, bits))
    })
    .unwrap()
    .remove(0)
}

#[test]
fn precision_tf32_switches_tf32_on_for_the_run_and_full_switches_it_off() {
    let (on, full) = run_with("full");
    assert!(!on, "precision: full left TF32 on");
    let (on, tf32) = run_with("tf32");
    assert!(on, "precision: tf32 did not switch TF32 on");
    assert_eq!(tf32, full, "on the CPU a tf32 run must equal the full f32 run bit for bit");
    let (on, _) = run_with("full");
    assert!(!on, "precision: full after a tf32 run left TF32 on");
}
