//! SimCSE through the trainer on the committed tiny BERT (2 layers, hidden 32; its weights
//! or a fresh keyed initialisation), dropout ON: 2 and 3 ranks end 4 AdamW steps with the
//! same per-step losses and parameters as 1 rank at the same global batch of 12
//! (f64 to 1e-10, f32 to 1e-5), unsupervised and supervised.

use std::collections::BTreeMap;
use std::path::PathBuf;

use allgrad_dist::run_threads;
use allgrad_models::bert::Pooling;
use allgrad_models::simcse::{SimCse, SimCseData, SimCseLoss, SimCseModel};
use allgrad_train::checkpoint::CheckpointConfig;
use allgrad_train::metrics::{LogConfig, Progress};
use allgrad_train::optim::OptimConfig;
use allgrad_train::schedule::ScheduleConfig;
use allgrad_train::TrainSection;
use allgrad_train::{Trainer, TrainerConfig};
use candle_core::{DType, Device};

use crate::common::{self, max_rel_diff_floor};

const WORDS: [&str; 32] = [
    "the", "a", "cat", "dog", "sat", "on", "mat", "ran", "fast", "slow", "big", "small", "red", "blue", "house", "tree", "under",
    "over", "and", "is", "was", "very", "bird", "sings", "loud", "quiet", "sun", "rain", "falls", "in", "park", "zebra",
];

/// Sentence `i`: 2 to 14 words (lengths differ within and across ranks; "zebra" is unknown).
fn sentence(i: usize, salt: usize) -> String {
    let n = 2 + (i * 5 + salt) % 13;
    (0..n).map(|k| WORDS[(i * 7 + k * 3 + salt * 11) % WORDS.len()]).collect::<Vec<_>>().join(" ")
}

fn data(supervised: bool) -> SimCseData {
    if supervised {
        SimCseData::Triplets((0..36).map(|i| [sentence(i, 0), sentence(i, 1), sentence(i + 100, 2)]).collect())
    } else {
        SimCseData::Sentences((0..36).map(|i| sentence(i, 0)).collect())
    }
}

fn tiny_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../allgrad-models/tests/data/tiny-bert")
}

struct Run {
    losses: Vec<f64>,
    params: BTreeMap<String, Vec<f64>>,
}

/// `steps` AdamW steps (warmup 2, clipping at 5) on `w` thread-ranks at a global batch of
/// 12 (36 samples: 3 steps per epoch, so step 4 starts a second, reshuffled epoch). Unsupervised: from the tiny model's weights, `cls_before_pooler` + MLP head.
/// Supervised: from a fresh keyed initialisation (f64), `cls` (pooler), hard-negative
/// weight 0.4.
fn train(w: usize, dtype: DType, supervised: bool, steps: usize) -> Run {
    // Supervised f32 starts from the weights too: from BERT's fresh initialisation (std 0.02)
    // many gradients are near rounding level in f32, and AdamW's normalisation magnifies the
    // f32 differences of rank-split sums (the fresh path is compared in f64).
    let pretrained = !supervised || dtype == DType::F32;
    let model = SimCseModel {
        dir: tiny_dir(),
        pretrained,
        pooling: if supervised { Pooling::Cls } else { Pooling::ClsBeforePooler },
        mlp_head: !supervised,
        max_len: 16,
    };
    let loss =
        SimCseLoss { temperature: 0.05, hard_negative_weight: if supervised { 0.4 } else { 0.0 }, tile: None, queue: None };
    let cfg = TrainerConfig {
        seed: 17,
        dtype,
        precision: Default::default(),
        device: Device::Cpu,
        train: TrainSection {
            global_batch: 12,
            epochs: 2,
            max_steps: Some(steps),
            accumulate: 1,
            clip_grad_norm: Some(5.0),
            on_nonfinite: Default::default(),
            shuffle: true,
            eval: false,
            cache_chunk: None,
        },
        optim: OptimConfig::Adamw { lr: 3e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 },
        param_groups: Default::default(),
        schedule: ScheduleConfig { warmup_steps: 2, ..Default::default() },
        checkpoint: CheckpointConfig::default(),
        log: LogConfig { progress: Progress::Quiet, plot: false, ..Default::default() },
        settings: Default::default(),
    };
    run_threads(w, |pg| {
        let objective = SimCse::new(model.clone(), loss.clone(), data(supervised), Device::Cpu, dtype)?;
        let mut t = Trainer::new(cfg.clone(), Box::new(objective), pg, None, false)?;
        let losses = (1..=steps).map(|s| Ok(t.train_until(s)?.last_loss)).collect::<candle_core::Result<Vec<_>>>()?;
        let mut params = BTreeMap::new();
        for (n, v) in t.params() {
            params.insert(n.clone(), v.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?);
        }
        Ok(Run { losses, params })
    })
    .unwrap()
    .remove(0)
}

/// The parameters whose gradient is not identically zero. The attention key bias adds
/// `q · b_k` to every score of a query row, which the softmax cancels: its true gradient is 0,
/// the computed one is rounding noise, and AdamW (which divides by the gradient's size) turns
/// that noise into updates of full size and arbitrary sign, in PyTorch as here.
fn comparable(params: &BTreeMap<String, Vec<f64>>) -> BTreeMap<String, Vec<f64>> {
    params.iter().filter(|(n, _)| !n.ends_with("attention.self.key.bias")).map(|(n, v)| (n.clone(), v.clone())).collect()
}

fn assert_equivalent(dtype: DType, supervised: bool, tol: f64) {
    let one = train(1, dtype, supervised, 4);
    assert!(one.losses.iter().all(|l| l.is_finite() && *l > 0.1), "losses {:?}", one.losses);
    for w in [2, 3] {
        let run = train(w, dtype, supervised, 4);
        let what = format!("{dtype:?} supervised {supervised} W={w} vs W=1");
        allgrad_testkit::close::assert_elem_rel(&run.losses, &one.losses, tol, f64::MIN_POSITIVE, &format!("{what}: losses"));
        common::assert_params_rel(&comparable(&run.params), &comparable(&one.params), tol, &what);
    }
}

#[test]
fn unsupervised_simcse_on_2_and_3_ranks_equals_1_rank_in_f64() {
    assert_equivalent(DType::F64, false, 1e-10);
}

#[test]
fn supervised_simcse_on_2_and_3_ranks_equals_1_rank_in_f64() {
    assert_equivalent(DType::F64, true, 1e-10);
}

#[test]
fn unsupervised_simcse_on_2_and_3_ranks_equals_1_rank_in_f32() {
    assert_equivalent(DType::F32, false, 1e-5);
}

#[test]
fn supervised_simcse_on_2_and_3_ranks_equals_1_rank_in_f32() {
    assert_equivalent(DType::F32, true, 1e-5);
}

#[test]
fn four_steps_move_the_parameters() {
    // The equivalence above is not vacuous: training changes the parameters it compares.
    for supervised in [false, true] {
        let (d, name) =
            max_rel_diff_floor(&train(1, DType::F64, supervised, 4).params, &train(1, DType::F64, supervised, 0).params, 1e-2);
        assert!(d > 1e-3, "4 steps moved no parameter by more than {d:.2e} ({name})");
    }
}
