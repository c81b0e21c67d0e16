//! `precision: bf16` through the trainer, on the CPU: a bf16 run follows the f32 run's losses
//! over 60 steps, and an f32 run with another seed does not (SimCLR on a small ResNet,
//! unsupervised SimCSE on the committed tiny BERT); the first step's gradients of W = 2 and 4
//! ranks equal W = 1 in bf16, and those of gradient caching with W = 2 equal the plain step on
//! one rank in bf16. The parameters (master weights) stay f32.
//!
//! Tolerances, through `allgrad_testkit::close` (`ALLGRAD_TEST_ERRORS=1` prints each measured
//! error; `-- --nocapture` the curves' figures), measured on one machine, an AMD EPYC with
//! AVX-512:
//!
//! - **bf16 against f32 over 60 steps**: bf16 keeps 8 significant bits, so each stored
//!   activation is off by up to 0.4% and the first loss (same parameters) by about 1e-3;
//!   training then drifts apart as any two runs whose arithmetic differs do (SimCLR's small
//!   ResNet with LARS is chaotic: its per-step losses differ by 5% within 10 steps, as they
//!   would for two f32 runs on different hardware). So two figures are checked: the first
//!   step's loss, and the mean over the run of the 10-step mean losses' relative differences
//!   (the batch-to-batch noise averages out, the trend stays); each bound is checked to be
//!   well under the distance of an f32 run with another seed, so that it tells bf16 from a
//!   different run (the figures are beside the bounds, at the end of this file).
//! - **W ranks, or caching, against one in bf16**: the parameters' gradients come back f32,
//!   not rounded to bf16 per rank (see `allgrad_nn::autocast`), so the f32 standard holds. The
//!   first step's gradients are compared, read back from a plain SGD step with a learning rate
//!   large enough that the update dwarfs the parameters (a comparison of the parameters after
//!   a few small steps would hide an error of several percent in the update under the
//!   parameters' own rounding).

use std::path::PathBuf;

use allgrad_dist::run_threads;
use allgrad_models::bert::Pooling;
use allgrad_models::simcse::{SimCse, SimCseData, SimCseLoss, SimCseModel};
use allgrad_testkit::close::{assert_elem_rel, assert_rel, report};
use allgrad_train::checkpoint::CheckpointConfig;
use allgrad_train::metrics::{LogConfig, Progress};
use allgrad_train::optim::OptimConfig;
use allgrad_train::precision::ComputePrecision;
use allgrad_train::schedule::ScheduleConfig;
use allgrad_train::TrainSection;
use allgrad_train::{run, Trainer, TrainerConfig};
use candle_core::{DType, Device};

use crate::common::{image_config, Params};

const NT_XENT: &str = "{kind: nt_xent, temperature: 0.5}";

/// The first step's loss and gradient of a trainer from `make` on `w` thread-ranks (rank 0's;
/// every rank's replicated parameters are checked equal). `make` gives plain SGD with a
/// learning rate of [`GRAD_LR`] and no momentum or weight decay: the step's update is
/// `−GRAD_LR · g`, which dwarfs the parameters, so the update read back from the f32
/// parameters is the gradient to f32 rounding (not hidden under the parameters' own rounding,
/// as a small update would be).
fn first_gradient(
    w: usize,
    make: impl Fn(allgrad_dist::ProcessGroup) -> allgrad_train::TrainResult<Trainer> + Sync,
) -> (f64, Params) {
    let flat = |t: &Trainer| -> candle_core::Result<Params> {
        let mut p = Params::new();
        for (n, v) in t.params() {
            p.insert(n.clone(), v.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?);
        }
        Ok(p)
    };
    let mut all = run_threads(w, |pg| {
        let mut t = make(pg)?;
        let before = flat(&t)?;
        let loss = t.train_until(1)?.last_loss;
        let after = flat(&t)?;
        let g: Params =
            after.iter().map(|(n, a)| (n.clone(), a.iter().zip(&before[n]).map(|(a, b)| (b - a) / GRAD_LR).collect())).collect();
        Ok((loss, g))
    })
    .unwrap();
    for (r, other) in all.iter().enumerate().skip(1) {
        assert!(other.1 == all[0].1, "rank {r}'s replicated gradients differ from rank 0's");
    }
    all.remove(0)
}

/// The learning rate of [`first_gradient`]'s SGD step.
const GRAD_LR: f64 = 1e4;

/// [`first_gradient`]'s optimizer, as a `--set`.
const GRAD_SGD: &str = "optim={kind: sgd, lr: 1.0e4, momentum: 0.0, weight_decay: 0.0}";

/// Each tensor's gradient within `tol` (norm-wise), and the losses.
fn assert_same_gradient(got: &(f64, Params), want: &(f64, Params), tol: f64, what: &str) {
    assert_elem_rel(&[got.0], &[want.0], tol, f64::MIN_POSITIVE, &format!("{what}: loss"));
    assert_eq!(got.1.keys().collect::<Vec<_>>(), want.1.keys().collect::<Vec<_>>(), "{what}");
    for (n, g) in &want.1 {
        assert!(g.iter().any(|x| *x != 0.0), "{what}: {n} has a zero gradient");
        assert_rel(&got.1[n], g, tol, &format!("{what}: gradient of {n}"));
    }
}

/// Each step's loss and the final parameters (rank 0's; every rank's replicated parameters
/// are checked equal) of `steps` steps on `w` thread-ranks, from `make_trainer`.
fn run_steps(
    w: usize,
    steps: usize,
    make: impl Fn(allgrad_dist::ProcessGroup) -> allgrad_train::TrainResult<Trainer> + Sync,
) -> (Vec<f64>, Params) {
    let mut all = run_threads(w, |pg| {
        let mut t = make(pg)?;
        let losses = (1..=steps).map(|s| Ok(t.train_until(s)?.last_loss)).collect::<candle_core::Result<Vec<f64>>>()?;
        let mut p = Params::new();
        for (n, v) in t.params() {
            assert_eq!(v.dtype(), DType::F32, "{n}: master weights must stay f32");
            p.insert(n.clone(), v.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?);
        }
        Ok((losses, p))
    })
    .unwrap();
    for (r, other) in all.iter().enumerate().skip(1) {
        assert!(other.1 == all[0].1, "rank {r}'s replicated parameters differ from rank 0's");
    }
    all.remove(0)
}

/// The SimCLR image test config (ResNet-18 of width 4 on 12x12 crops, 3-layer projector,
/// SyncBatchNorm) at global batch 32 with `sets`.
fn simclr(sets: &[&str]) -> allgrad_train::RunConfig {
    image_config("simclr", NT_XENT, true, 32, sets)
}

fn simclr_run(sets: &[&str], w: usize, steps: usize) -> (Vec<f64>, Params) {
    let cfg = simclr(sets);
    run_steps(w, steps, |pg| run::build(&cfg, pg, None, false))
}

/// The mean loss of each run of `WINDOW` steps.
fn windows(losses: &[f64]) -> Vec<f64> {
    losses.chunks(WINDOW).map(|w| w.iter().sum::<f64>() / w.len() as f64).collect()
}

/// Steps per window of [`windows`]: the per-batch noise of the loss averages out over a window,
/// while the trend of training stays.
const WINDOW: usize = 10;

/// How closely `bf16` follows `full`, and how far `other_seed` (f32, another seed) is from it:
/// the relative difference of the first step's loss (the same parameters: bf16's own effect),
/// and the mean over the run of the windows' relative differences (each window's mean loss).
/// Each is reported (`ALLGRAD_TEST_ERRORS=1`) and checked: bf16 within `bounds`, the other seed
/// at least [`SEPARATION`] times each bound away, so that the bounds tell a bf16 run from a
/// different run.
fn follow(what: &str, full: &[f64], bf16: &[f64], other_seed: &[f64], bounds: (f64, f64)) {
    let first = curve_diff(&bf16[..1], &full[..1]).0;
    let w = mean_diff(&windows(bf16), &windows(full));
    let w_seed = mean_diff(&windows(other_seed), &windows(full));
    let seed_first = curve_diff(&other_seed[..1], &full[..1]).0;
    println!(
        "{what}: bf16 vs f32: step 1 {first:.2e}, {WINDOW}-step means {w:.2e} (largest {:.2e}); \
         f32 with another seed: step 1 {seed_first:.2e}, means {w_seed:.2e} (largest {:.2e}); mean loss f32 {:.4} -> {:.4}, bf16 {:.4} -> {:.4}",
        curve_diff(&windows(bf16), &windows(full)).0,
        curve_diff(&windows(other_seed), &windows(full)).0,
        windows(full)[0],
        windows(full)[STEPS / WINDOW - 1],
        windows(bf16)[0],
        windows(bf16)[STEPS / WINDOW - 1]
    );
    assert!(curve_diff(bf16, full).0 > 0.0, "{what}: the bf16 run computed exactly the f32 run's losses: autocast did not apply");
    report(&format!("{what}: bf16 vs f32, step 1"), first, bounds.0);
    report(&format!("{what}: bf16 vs f32, {WINDOW}-step means"), w, bounds.1);
    report(&format!("{what}: another seed vs f32, step 1 (a floor)"), seed_first, SEPARATION * bounds.0);
    report(&format!("{what}: another seed vs f32, {WINDOW}-step means (a floor)"), w_seed, SEPARATION * bounds.1);
    assert!(first <= bounds.0 && w <= bounds.1, "bf16 {what} left the f32 run: {first:.2e} (step 1), {w:.2e} (means)");
    for (name, seed, bound) in [("step 1", seed_first, bounds.0), ("the means", w_seed, bounds.1)] {
        assert!(
            seed >= SEPARATION * bound,
            "{what}, {name}: an f32 run with another seed is only {seed:.2e} from the f32 run, under {SEPARATION} x the bound \
             {bound:.0e}: the bound cannot tell bf16 from another run"
        );
    }
}

/// How many times each bound an f32 run with another seed must be away.
const SEPARATION: f64 = 2.5;

/// The mean relative difference between two curves.
fn mean_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs() / y.abs().max(1e-12)).sum::<f64>() / a.len() as f64
}

/// Largest relative difference between two loss curves, and the step where it is.
fn curve_diff(a: &[f64], b: &[f64]) -> (f64, usize) {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).enumerate().map(|(i, (x, y))| ((x - y).abs() / y.abs().max(1e-12), i + 1)).fold((0.0, 0), |m, d| {
        if d.0 > m.0 {
            d
        } else {
            m
        }
    })
}

const WORDS: [&str; 32] = [
    "the", "a", "cat", "dog", "sat", "on", "mat", "ran", "fast", "slow", "big", "small", "red", "blue", "house", "tree", "under",
    "over", "and", "is", "was", "very", "bird", "sings", "loud", "quiet", "sun", "rain", "falls", "in", "park", "zebra",
];

/// Sentence `i`: 2 to 14 words (lengths differ within and across ranks).
fn sentence(i: usize) -> String {
    let n = 2 + (i * 5) % 13;
    (0..n).map(|k| WORDS[(i * 7 + k * 3) % WORDS.len()]).collect::<Vec<_>>().join(" ")
}

/// Unsupervised SimCSE on the tiny BERT (its weights, mean pooling, MLP head, dropout on):
/// global batch 12 of 36 sentences, AdamW at 1e-3, `precision`, `cache_chunk`, `seed`.
fn simcse_trainer(
    pg: allgrad_dist::ProcessGroup,
    precision: ComputePrecision,
    cache_chunk: Option<usize>,
    seed: u64,
    steps: usize,
) -> allgrad_train::TrainResult<Trainer> {
    let adamw = OptimConfig::Adamw { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
    simcse_trainer_with(pg, precision, cache_chunk, seed, steps, adamw)
}

/// [`simcse_trainer`] with `optim`.
fn simcse_trainer_with(
    pg: allgrad_dist::ProcessGroup,
    precision: ComputePrecision,
    cache_chunk: Option<usize>,
    seed: u64,
    steps: usize,
    optim: OptimConfig,
) -> allgrad_train::TrainResult<Trainer> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../allgrad-models/tests/data/tiny-bert");
    let model = SimCseModel { dir, pretrained: true, pooling: Pooling::Mean, mlp_head: true, max_len: 16 };
    let loss = SimCseLoss { temperature: 0.05, hard_negative_weight: 0.0, tile: None, queue: None };
    let data = SimCseData::Sentences((0..36).map(sentence).collect());
    let cfg = TrainerConfig {
        seed,
        dtype: DType::F32,
        precision,
        device: Device::Cpu,
        train: TrainSection {
            global_batch: 12,
            epochs: steps.div_ceil(3),
            max_steps: Some(steps),
            accumulate: 1,
            clip_grad_norm: None,
            on_nonfinite: Default::default(),
            shuffle: true,
            eval: false,
            cache_chunk,
        },
        optim,
        param_groups: Default::default(),
        schedule: ScheduleConfig::default(),
        checkpoint: CheckpointConfig::default(),
        log: LogConfig { progress: Progress::Quiet, plot: false, ..Default::default() },
        settings: Default::default(),
    };
    let objective = SimCse::new(model, loss, data, Device::Cpu, DType::F32)?;
    Trainer::new(cfg, Box::new(objective), pg, None, false)
}

fn simcse_run(w: usize, precision: ComputePrecision, cache_chunk: Option<usize>, seed: u64, steps: usize) -> (Vec<f64>, Params) {
    run_steps(w, steps, |pg| simcse_trainer(pg, precision, cache_chunk, seed, steps))
}

const STEPS: usize = 60;

#[test]
fn bf16_simclr_follows_the_f32_losses_over_60_steps() {
    let sets = |p: &'static str| ["train.max_steps=60", "train.epochs=100", "optim.lr=0.05", p];
    let (full, _) = simclr_run(&sets("precision=full"), 1, STEPS);
    let (bf16, _) = simclr_run(&sets("precision=bf16"), 1, STEPS);
    let (other_seed, _) = simclr_run(&[sets("precision=full").as_slice(), &["seed=12"]].concat(), 1, STEPS);
    follow("SimCLR", &full, &bf16, &other_seed, (SIMCLR_STEP1, SIMCLR_WINDOWS));
}

#[test]
fn bf16_simcse_follows_the_f32_losses_over_60_steps() {
    let (full, _) = simcse_run(1, ComputePrecision::Full, None, 17, STEPS);
    let (bf16, _) = simcse_run(1, ComputePrecision::Bf16, None, 17, STEPS);
    let (other_seed, _) = simcse_run(1, ComputePrecision::Full, None, 18, STEPS);
    follow("SimCSE", &full, &bf16, &other_seed, (SIMCSE_STEP1, SIMCSE_WINDOWS));
}

#[test]
fn bf16_simclr_gradients_on_2_and_4_ranks_equal_1_rank() {
    let cfg = simclr(&["precision=bf16", GRAD_SGD, "train.max_steps=1"]);
    let one = first_gradient(1, |pg| run::build(&cfg, pg, None, false));
    for w in [2, 4] {
        let many = first_gradient(w, |pg| run::build(&cfg, pg, None, false));
        assert_same_gradient(&many, &one, BF16_RANKS_TOL, &format!("SimCLR bf16 W={w} vs W=1"));
    }
}

#[test]
fn bf16_simcse_gradients_with_cache_chunk_on_2_ranks_equal_the_plain_step_on_1_rank() {
    let sgd = OptimConfig::Sgd { lr: GRAD_LR, momentum: 0.0, nesterov: false, weight_decay: 0.0 };
    let plain = first_gradient(1, |pg| simcse_trainer_with(pg, ComputePrecision::Bf16, None, 17, 1, sgd.clone()));
    let cached = first_gradient(2, |pg| simcse_trainer_with(pg, ComputePrecision::Bf16, Some(2), 17, 1, sgd.clone()));
    assert_same_gradient(&cached, &plain, BF16_RANKS_TOL, "SimCSE bf16, cache_chunk 2 on W=2 vs plain W=1");
}

#[test]
fn bf16_with_f64_parameters_is_refused_by_the_trainer() {
    let e = run_threads(1, |pg| {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../allgrad-models/tests/data/tiny-bert");
        let model = SimCseModel { dir, pretrained: true, pooling: Pooling::Mean, mlp_head: false, max_len: 16 };
        let objective = SimCse::new(
            model,
            SimCseLoss::default(),
            SimCseData::Sentences((0..12).map(sentence).collect()),
            Device::Cpu,
            DType::F64,
        )?;
        let mut cfg = simcse_trainer_config();
        cfg.dtype = DType::F64;
        Ok(Trainer::new(cfg, Box::new(objective), pg, None, false).err().map(|e| e.to_string()))
    })
    .unwrap()
    .remove(0)
    .expect("bf16 with f64 parameters was accepted");
    assert!(e.contains("precision: bf16") && e.contains("dtype: f32") && e.contains("dtype: f64"), "{e}");
}

/// A bf16 trainer config for the refusal test.
fn simcse_trainer_config() -> TrainerConfig {
    TrainerConfig {
        seed: 1,
        dtype: DType::F32,
        precision: ComputePrecision::Bf16,
        device: Device::Cpu,
        train: TrainSection {
            global_batch: 12,
            epochs: 1,
            max_steps: Some(1),
            accumulate: 1,
            clip_grad_norm: None,
            on_nonfinite: Default::default(),
            shuffle: true,
            eval: false,
            cache_chunk: None,
        },
        optim: OptimConfig::default(),
        param_groups: Default::default(),
        schedule: ScheduleConfig::default(),
        checkpoint: CheckpointConfig::default(),
        log: LogConfig { progress: Progress::Quiet, plot: false, ..Default::default() },
        settings: Default::default(),
    }
}

/// SimCLR: bf16's effect on the first loss (measured 2.0e-3) and on the 10-step mean losses over
/// 60 steps (mean relative difference, measured 1.05e-2); an f32 run with another seed is at
/// 4.0e-2 and 5.5e-2. Bounds about 2.5x and 2x the measured effects, so that the other seed is
/// at least [`SEPARATION`] times each away (8x and 2.8x).
const SIMCLR_STEP1: f64 = 5e-3;
const SIMCLR_WINDOWS: f64 = 2e-2;
/// SimCSE: measured 1.2e-3 and 1.1e-3; another seed 2.2e-1 and 5.0e-2 (75x and 10x the bounds).
const SIMCSE_STEP1: f64 = 3e-3;
const SIMCSE_WINDOWS: f64 = 5e-3;

/// W ranks (or gradient caching) against one rank, in bf16: the gradients of the first step,
/// norm-wise per tensor. Measured (AMD EPYC, AVX-512): at most 3.1e-7 for SimCLR's weights
/// (2.3e-6 for a bias before a batch norm, whose gradient is zero by construction and so only
/// rounding), 3.0e-6 for SimCSE with caching (a layer norm's bias); the f32 standard, 1e-5, is
/// about three times the largest.
const BF16_RANKS_TOL: f64 = 1e-5;
