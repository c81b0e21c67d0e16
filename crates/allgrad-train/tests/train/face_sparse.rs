//! The face method's sparse centre update through the trainer, on synthetic identities with
//! a linear backbone and Partial FC at 0.1 over 60 classes (split unevenly over 2 and 3
//! ranks), 120 steps (15 epochs) with warmup and cosine decay: the row-sparse gradient and
//! lazy optimizer (`head.update: sparse`, the default) end with the same parameters as the
//! dense gradient and update (`head.update: dense`) bit for bit, SGD (momentum, weight
//! decay, nesterov) and AdamW, f64 and f32, 1 and 2 ranks, with 2 micro-batches per step; 2
//! and 3 ranks equal 1 rank
//! (f64 1e-10, f32 1e-5); checkpoints written mid-run resume bitwise at the same W and
//! re-shard to other W; with gradient clipping and LARS the sparse path equals the dense one;
//! bad input gets errors naming the key.
//!
//! Every sparse run is checked to have taken the lazy update on every rank (rows deferred and
//! replayed, `allgrad_train::optim_paths`), and every dense run not: the lazy update equals the
//! dense one bit for bit, so without this a fallback to the dense update would pass.
//! Tolerances through `allgrad_testkit::close` (norm-wise per parameter, element-wise per
//! loss); `ALLGRAD_TEST_ERRORS=1` prints each measured error.

use std::path::Path;

use allgrad_dist::run_threads;
use allgrad_train::{run, RunConfig};

use crate::face_support::{assert_bitwise, assert_close, assert_params_bitwise, train, CENTRES};

/// A face run: 60 classes, rate 0.1, `steps` steps of a 12-sample global batch.
fn config(optim: &str, dtype: &str, update: &str, extra: &[&str]) -> RunConfig {
    let text = format!(
        "seed: 11\n\
         dtype: {dtype}\n\
         method: face\n\
         data: {{kind: synthetic, samples: 96, dim: 6, noise: 0.4}}\n\
         model: {{kind: linear, embedding: 4}}\n\
         head: {{num_classes: 60, margin: {{kind: arcface, s: 16}}, sample_rate: 0.1, update: {update}}}\n\
         optim: {optim}\n\
         schedule: {{warmup_steps: 10, decay: cosine, final_fraction: 0.05}}\n\
         train: {{global_batch: 12, epochs: 15, eval: false}}\n\
         checkpoint: {{every: 0}}\n\
         log: {{progress: quiet, plot: false}}\n"
    );
    let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    RunConfig::parse(&text, Path::new("face-sparse-test.yaml"), &extra).unwrap()
}

const SGD: &str = "{kind: sgd, lr: 0.2, momentum: 0.9, weight_decay: 0.01}";
const NESTEROV: &str = "{kind: sgd, lr: 0.2, momentum: 0.9, nesterov: true, weight_decay: 0.01}";
const ADAMW: &str = "{kind: adamw, lr: 0.01, weight_decay: 0.05}";

const STOPS: [usize; 3] = [1, 60, 120];

/// Two micro-batches per step: the row-sparse gradients of the two loss calls are summed.
/// (Not in the runs compared across W: a micro-batch's sampled classes include its own
/// positives, and which samples share a micro-batch depends on W.)
const ACC2: [&str; 1] = ["train.accumulate=2"];

#[test]
fn sparse_centre_updates_equal_dense_ones_bitwise_over_120_steps_sgd_nesterov_adamw_f64_f32() {
    for optim in [SGD, NESTEROV, ADAMW] {
        for dtype in ["f64", "f32"] {
            let dense = train(&config(optim, dtype, "dense", &ACC2), 1, None, false, &STOPS);
            let sparse = train(&config(optim, dtype, "sparse", &ACC2), 1, None, false, &STOPS);
            dense.assert_dense(&format!("{optim} {dtype} W=1 dense"));
            sparse.assert_lazy(&format!("{optim} {dtype} W=1 sparse"));
            assert_bitwise(&sparse, &dense, &format!("{optim} {dtype} W=1"));
            assert!(dense.losses[2] < dense.losses[0], "{optim} {dtype}: losses {:?}", dense.losses);
        }
    }
}

#[test]
fn sparse_centre_updates_on_2_ranks_equal_dense_ones_bitwise() {
    for optim in [SGD, ADAMW] {
        let dense = train(&config(optim, "f64", "dense", &ACC2), 2, None, false, &STOPS);
        let sparse = train(&config(optim, "f64", "sparse", &ACC2), 2, None, false, &STOPS);
        dense.assert_dense(&format!("{optim} W=2 dense"));
        sparse.assert_lazy(&format!("{optim} W=2 sparse"));
        assert_bitwise(&sparse, &dense, &format!("{optim} W=2"));
    }
}

#[test]
fn sparse_centre_updates_on_2_and_3_ranks_equal_1_rank_f64_and_f32() {
    for (optim, dtype, tol) in [(SGD, "f64", 1e-10), (ADAMW, "f64", 1e-10), (SGD, "f32", 1e-5)] {
        let cfg = config(optim, dtype, "sparse", &[]);
        let one = train(&cfg, 1, None, false, &STOPS);
        one.assert_lazy(&format!("{optim} {dtype} W=1"));
        for w in [2, 3] {
            let many = train(&cfg, w, None, false, &STOPS);
            many.assert_lazy(&format!("{optim} {dtype} W={w}"));
            assert_close(&many, &one, tol, &format!("{optim} {dtype} W={w} vs W=1"));
        }
    }
}

#[test]
fn sparse_runs_resume_bitwise_from_a_mid_run_checkpoint_at_the_same_world_size() {
    for optim in [SGD, ADAMW] {
        let cfg = config(optim, "f64", "sparse", &[]);
        let full = train(&cfg, 2, None, false, &[120]);
        let dir = tempfile::tempdir().unwrap();
        train(&cfg, 2, Some(dir.path()), false, &[37]);
        let latest = std::fs::read_to_string(dir.path().join("checkpoints/latest")).unwrap();
        assert_eq!(latest.trim(), "step_37");
        let resumed = train(&cfg, 2, Some(dir.path()), true, &[120]);
        resumed.assert_lazy(&format!("{optim}: resumed"));
        assert_bitwise(&resumed, &full, &format!("{optim}: resumed at step 37 vs uninterrupted"));
    }
}

#[test]
fn sparse_checkpoints_re_shard_from_2_to_3_and_from_3_to_1_ranks() {
    let cfg = config(SGD, "f64", "sparse", &[]);
    let full = train(&cfg, 1, None, false, &[120]);
    for (from, to) in [(2, 3), (3, 1)] {
        let dir = tempfile::tempdir().unwrap();
        let saved = train(&cfg, from, Some(dir.path()), false, &[45]);
        // Before any further step the re-sharded run holds exactly what was saved.
        let loaded = train(&cfg, to, Some(dir.path()), true, &[45]);
        assert_params_bitwise(&loaded, &saved, &format!("W={from} -> {to}: loaded"));
        let resumed = train(&cfg, to, Some(dir.path()), true, &[120]);
        assert_close(&resumed, &full, 1e-10, &format!("saved on {from} ranks at step 45, resumed on {to}"));
    }
}

#[test]
fn with_gradient_clipping_and_with_lars_the_sparse_path_equals_the_dense_one() {
    // Clipping scales the gradient by the global norm: summed over the sampled rows here and
    // over the whole (zero elsewhere) gradient there. The zeros add nothing, so the two agree
    // exactly here (measured 0 on an AMD EPYC with AVX-512); 1e-14 allows the clip scale's
    // last bit to differ where a machine sums the same terms in another order.
    let clip = ["train.clip_grad_norm=0.05"];
    let dense = train(&config(SGD, "f64", "dense", &clip), 2, None, false, &STOPS);
    let sparse = train(&config(SGD, "f64", "sparse", &clip), 2, None, false, &STOPS);
    sparse.assert_lazy("clipped");
    assert_close(&sparse, &dense, 1e-14, "clipped");
    let lars = "{kind: lars, lr: 0.2, momentum: 0.9, weight_decay: 0.01, trust_coefficient: 0.02}";
    let dense = train(&config(lars, "f64", "dense", &[]), 2, None, false, &STOPS);
    let sparse = train(&config(lars, "f64", "sparse", &[]), 2, None, false, &STOPS);
    // LARS's step depends on the whole parameter: the sparse gradient takes the dense update.
    for (r, p) in sparse.paths.iter().enumerate() {
        assert!(p.sparse_as_dense > 0 && p.lazy_updates == 0, "LARS: rank {r}: {p:?}");
    }
    assert_bitwise(&sparse, &dense, "LARS");
}

#[test]
fn bad_face_head_input_is_refused_with_the_key_and_the_numbers() {
    let text = |rate: &str| {
        format!(
            "method: face\ndata: {{kind: synthetic, samples: 12, dim: 3}}\nmodel: {{kind: linear, embedding: 2}}\n\
             head: {{num_classes: 10, sample_rate: {rate}}}\ntrain: {{global_batch: 4}}\n"
        )
    };
    for rate in ["0", "1.5", "-0.1", ".nan"] {
        let cfg = RunConfig::parse(&text(rate), Path::new("bad.yaml"), &[]).unwrap();
        let msg = cfg.validate(1, Path::new("bad.yaml")).unwrap_err().to_string();
        assert!(msg.contains("head.sample_rate") && msg.contains("(0, 1]"), "sample_rate {rate}: {msg}");
    }
    let msg =
        RunConfig::parse(&text("0.5").replace("sample_rate: 0.5", "sample_rate: 0.5, update: lazy"), Path::new("bad.yaml"), &[])
            .unwrap_err()
            .to_string();
    assert!(msg.contains("head.update") && msg.contains("sparse") && msg.contains("dense"), "{msg}");
    // An image data set with more identities than the head has classes.
    let glyphs = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/glyphs");
    let images = format!(
        "method: face\ndata: {{kind: images, dir: {glyphs}, format: idx}}\n\
         model: {{kind: resnet, encoder: {{depth: 18, width: 4, in_channels: 1, stem: cifar}}, embedding: 8}}\n\
         head: {{num_classes: 100}}\ntrain: {{global_batch: 4}}\n"
    );
    let cfg = RunConfig::parse(&images, Path::new("bad.yaml"), &[]).unwrap();
    let err = run_threads(1, |pg| Ok(run::build(&cfg, pg, None, false).map(|_| ())?)).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("2000 identities") && msg.contains("head.num_classes = 100"), "{msg}");
    // A checkpoint of 60 classes does not resume a run of 61.
    let dir = tempfile::tempdir().unwrap();
    train(&config(SGD, "f64", "sparse", &["train.max_steps=2"]), 2, Some(dir.path()), false, &[2]);
    let other = config(SGD, "f64", "sparse", &["head.num_classes=61"]);
    let err = run_threads(2, |pg| Ok(run::build(&other, pg, Some(dir.path().to_path_buf()), true).map(|_| ())?)).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains(CENTRES) && msg.contains("60") && msg.contains("61"), "{msg}");
}
