//! Face centres and their optimizer state stored in bf16 (`head.storage: bf16`, f32
//! arithmetic) through the trainer, synthetic identities, 60 classes at rate 0.1, 120 steps
//! with warmup and cosine: the centres and their momentum are bf16 in memory and in the
//! checkpoint; a run resumes bitwise from step 37; 2 and 3 ranks stay within bf16's rounding
//! of 1 rank; the losses stay within bf16's effect of f32 storage's; the same without sampling
//! (`head.sample_rate: 1.0`, every centre in every step); the keys that do not fit are refused,
//! and so is resuming a checkpoint with the other storage.
//! (The update itself, lazy against dense bf16 storage, is held bit for bit in
//! `lazy_update.rs`.)
//!
//! Tolerances through `allgrad_testkit::close` (losses element-wise, parameters norm-wise);
//! `ALLGRAD_TEST_ERRORS=1` prints each measured error. The figures quoted were measured on one
//! machine, an AMD EPYC with AVX-512.

use std::collections::BTreeMap;
use std::path::Path;

use allgrad_dist::run_threads;
use allgrad_testkit::close::assert_elem_rel;
use allgrad_train::{run, RunConfig};

use crate::face_support::{assert_bitwise, assert_params, train, CENTRES};

fn config(storage: &str, optim: &str, extra: &[&str]) -> RunConfig {
    let text = format!(
        "seed: 11\n\
         dtype: f32\n\
         method: face\n\
         data: {{kind: synthetic, samples: 96, dim: 6, noise: 0.4}}\n\
         model: {{kind: linear, embedding: 4}}\n\
         head: {{num_classes: 60, margin: {{kind: arcface, s: 16}}, sample_rate: 0.1, storage: {storage}}}\n\
         optim: {optim}\n\
         schedule: {{warmup_steps: 10, decay: cosine, final_fraction: 0.05}}\n\
         train: {{global_batch: 12, epochs: 15, eval: false}}\n\
         checkpoint: {{every: 0}}\n\
         log: {{progress: quiet, plot: false}}\n"
    );
    let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    RunConfig::parse(&text, Path::new("face-bf16-test.yaml"), &extra).unwrap()
}

const SGD: &str = "{kind: sgd, lr: 0.2, momentum: 0.9, weight_decay: 0.01}";
const ADAMW: &str = "{kind: adamw, lr: 0.01, weight_decay: 0.05}";

/// bf16 storage against f32 storage over 120 steps, the losses at the stops: bf16 keeps 8
/// significant bits of every centre after every update, so the runs part by that much each
/// step. Measured at most 5.0e-3 (SGD) and 6.7e-3 (AdamW) with sampling; about three times
/// that.
const BF16_VS_F32: f64 = 2e-2;

/// W ranks against one with bf16 centres: the f32 gradients of different W differ in their
/// last bits, which rounds a few centre values to the neighbouring bf16 value (2^-8 = 3.9e-3
/// relative). Measured at most 2.6e-4 (losses) and 2.3e-3 (the centres, norm-wise); about four
/// times these.
const BF16_RANKS_LOSS: f64 = 1e-3;
const BF16_RANKS_PARAMS: f64 = 1e-2;

const STOPS: [usize; 5] = [1, 10, 30, 60, 120];

#[test]
fn bf16_centres_train_close_to_f32_ones_and_on_2_and_3_ranks_close_to_1_rank() {
    for optim in [SGD, ADAMW] {
        let f32_run = train(&config("run", optim, &[]), 1, None, false, &STOPS);
        let one = train(&config("bf16", optim, &[]), 1, None, false, &STOPS);
        assert_eq!((f32_run.centres_dtype, one.centres_dtype), (candle_core::DType::F32, candle_core::DType::BF16));
        assert!(one.losses[4] < 0.5 * one.losses[0], "{optim}: bf16 centres did not train: {:?}", one.losses);
        assert_elem_rel(&one.losses, &f32_run.losses, BF16_VS_F32, f64::MIN_POSITIVE, &format!("{optim}: bf16 vs f32 losses"));
        for w in [2, 3] {
            let run = train(&config("bf16", optim, &[]), w, None, false, &STOPS);
            let what = format!("{optim} W={w} vs W=1");
            assert_elem_rel(&run.losses, &one.losses, BF16_RANKS_LOSS, f64::MIN_POSITIVE, &format!("{what}: losses"));
            assert_params(&run, &one, BF16_RANKS_PARAMS, &what);
        }
    }
}

#[test]
fn bf16_centres_without_sampling_train_close_to_f32_ones_and_on_2_ranks_close_to_1_rank() {
    // Rate 1.0: every centre is in every step's softmax, so every row is updated each step
    // (the bf16 storage's path when nothing is sampled).
    let all = ["head.sample_rate=1.0"];
    for optim in [SGD, ADAMW] {
        let f32_run = train(&config("run", optim, &all), 1, None, false, &STOPS);
        let one = train(&config("bf16", optim, &all), 1, None, false, &STOPS);
        assert_eq!((f32_run.centres_dtype, one.centres_dtype), (candle_core::DType::F32, candle_core::DType::BF16));
        // Every class in every softmax: a higher loss than with sampling, and slower to fall.
        assert!(one.losses[4] < 0.75 * one.losses[0], "{optim}: bf16 centres did not train: {:?}", one.losses);
        assert!(one.losses != f32_run.losses, "{optim}: bf16 storage computed exactly the f32 losses");
        let what = format!("{optim}, no sampling");
        assert_elem_rel(&one.losses, &f32_run.losses, BF16_VS_F32, f64::MIN_POSITIVE, &format!("{what}: bf16 vs f32 losses"));
        let two = train(&config("bf16", optim, &all), 2, None, false, &STOPS);
        assert_elem_rel(&two.losses, &one.losses, BF16_RANKS_LOSS, f64::MIN_POSITIVE, &format!("{what}: W=2 vs W=1 losses"));
        assert_params(&two, &one, BF16_RANKS_PARAMS, &format!("{what}: W=2 vs W=1"));
    }
}

#[test]
fn bf16_centres_resume_bitwise_from_a_mid_run_checkpoint_which_holds_them_in_bf16() {
    for optim in [SGD, ADAMW] {
        let cfg = config("bf16", optim, &[]);
        let full = train(&cfg, 2, None, false, &[120]);
        let dir = tempfile::tempdir().unwrap();
        train(&cfg, 2, Some(dir.path()), false, &[37]);
        let shard = dir.path().join("checkpoints/step_37/shard_1.safetensors");
        let saved = candle_core::safetensors::load(&shard, &candle_core::Device::Cpu).unwrap();
        let dtypes: BTreeMap<&str, candle_core::DType> = saved.iter().map(|(k, v)| (k.as_str(), v.dtype())).collect();
        assert!(!dtypes.is_empty() && dtypes.values().all(|d| *d == candle_core::DType::BF16), "{optim}: shard holds {dtypes:?}");
        let resumed = train(&cfg, 2, Some(dir.path()), true, &[120]);
        assert_bitwise(&resumed, &full, &format!("{optim}: resumed at step 37 vs uninterrupted"));
    }
}

#[test]
fn a_checkpoint_resumes_only_with_the_centre_storage_it_was_written_with() {
    let dir = tempfile::tempdir().unwrap();
    train(&config("bf16", SGD, &[]), 2, Some(dir.path()), false, &[37]);
    // Each rank's outcome: the error's message, or None where the run was built.
    let outcomes = run_threads(2, |pg| {
        Ok(run::build(&config("run", SGD, &[]), pg, Some(dir.path().to_path_buf()), true).err().map(|e| e.to_string()))
    })
    .unwrap();
    for (rank, msg) in outcomes.iter().enumerate() {
        let msg = msg.as_deref().unwrap_or_else(|| panic!("rank {rank} resumed bf16 centres as f32 ones"));
        assert!(msg.contains(CENTRES) && msg.contains("BF16") && msg.contains("head.storage"), "rank {rank}: {msg}");
    }
}

#[test]
fn bf16_centres_refuse_the_dense_update_lars_and_f64_naming_head_storage() {
    let dense = config("bf16", SGD, &["head.update=dense"]);
    let msg = dense.validate(1, Path::new("bad.yaml")).unwrap_err().to_string();
    assert!(msg.contains("head.storage") && msg.contains("head.update: sparse"), "{msg}");
    let lars = config("bf16", "{kind: lars, lr: 0.1}", &[]);
    let msg = lars.validate(1, Path::new("bad.yaml")).unwrap_err().to_string();
    assert!(msg.contains("head.storage") && msg.contains("sgd or adamw"), "{msg}");
    let f64_run = config("bf16", SGD, &["dtype=f64"]);
    let msg = f64_run.validate(1, Path::new("bad.yaml")).unwrap_err().to_string();
    assert!(msg.contains("head.storage") && msg.contains("dtype: f32"), "{msg}");
    assert!(config("bf16", ADAMW, &[]).validate(2, Path::new("ok.yaml")).is_ok());
}
