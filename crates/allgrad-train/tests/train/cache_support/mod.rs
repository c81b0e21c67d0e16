//! Shared by the gradient-caching tests: training any objective on W thread-ranks with and
//! without `train.cache_chunk`, and comparing what it did (per-step losses, parameter
//! updates, buffers) to a relative tolerance.

#![allow(dead_code)]

pub mod mlp;

use std::collections::BTreeMap;

use allgrad_dist::run_threads;
use allgrad_models::Objective;
use allgrad_train::checkpoint::CheckpointConfig;
use allgrad_train::metrics::{LogConfig, Progress};
use allgrad_train::optim::OptimConfig;
use allgrad_train::schedule::ScheduleConfig;
use allgrad_train::TrainSection;
use allgrad_train::{Trainer, TrainerConfig};
use candle_core::{DType, Device, Tensor};

/// Tensors by name, as f64.
pub type Named = BTreeMap<String, Vec<f64>>;

/// What a run did: the loss of each step, the parameters before and after, the buffers after.
pub struct Outcome {
    pub losses: Vec<f64>,
    pub init: Named,
    pub end: Named,
    pub buffers: Named,
}

impl Outcome {
    /// Each parameter's change over the run.
    pub fn updates(&self) -> Named {
        self.end.iter().map(|(n, v)| (n.clone(), v.iter().zip(&self.init[n]).map(|(a, b)| a - b).collect())).collect()
    }
}

/// A `train` section: `global_batch`, `accumulate`, `cache_chunk`, no evaluation.
pub fn section(global_batch: usize, accumulate: usize, cache_chunk: Option<usize>) -> TrainSection {
    TrainSection {
        global_batch,
        epochs: 2,
        max_steps: None,
        accumulate,
        clip_grad_norm: None,
        on_nonfinite: Default::default(),
        shuffle: true,
        eval: false,
        cache_chunk,
    }
}

/// The trainer's settings around `train`: seed 5, f64 on the CPU, `optim`, quiet.
pub fn trainer_config(train: TrainSection, optim: OptimConfig) -> TrainerConfig {
    TrainerConfig {
        seed: 5,
        dtype: DType::F64,
        precision: Default::default(),
        device: Device::Cpu,
        train,
        optim,
        param_groups: Default::default(),
        schedule: ScheduleConfig::default(),
        checkpoint: CheckpointConfig::default(),
        log: LogConfig { progress: Progress::Quiet, plot: false, ..Default::default() },
        settings: Default::default(),
    }
}

fn named(items: impl IntoIterator<Item = (String, Tensor)>) -> candle_core::Result<Named> {
    items.into_iter().map(|(n, t)| Ok((n, t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?))).collect()
}

/// `steps` steps of `cfg` on `w` thread-ranks, each rank's objective from `make`; rank 0's
/// outcome, after checking that every rank ends with bitwise the same parameters.
pub fn train<O, F>(w: usize, cfg: &TrainerConfig, steps: usize, make: F) -> Outcome
where
    O: Objective + 'static,
    F: Fn() -> candle_core::Result<O> + Sync,
{
    let mut all = run_threads(w, |pg| {
        let mut t = Trainer::new(cfg.clone(), Box::new(make()?), pg, None, false)?;
        let params = |t: &Trainer| named(t.params().iter().map(|(n, v)| (n.clone(), v.as_tensor().clone())));
        let init = params(&t)?;
        let losses = (1..=steps).map(|s| Ok(t.train_until(s)?.last_loss)).collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Outcome { losses, init, end: params(&t)?, buffers: named(t.buffers()?)? })
    })
    .unwrap();
    for (r, other) in all.iter().enumerate().skip(1) {
        assert!(other.end == all[0].end, "rank {r}'s parameters differ from rank 0's");
    }
    all.remove(0)
}

/// Largest |a - b| / max(floor, largest |b| of the tensor) over `a` and `b`, and where.
pub fn max_rel_diff(a: &Named, b: &Named, floor: f64) -> (f64, String) {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>(), "different tensor sets");
    let mut worst = (0f64, String::new());
    for (name, y) in b {
        let scale = y.iter().fold(floor, |m, v| m.max(v.abs()));
        for (p, q) in a[name].iter().zip(y) {
            let d = (p - q).abs() / scale;
            if d > worst.0 || d.is_nan() {
                worst = (d, name.clone());
            }
        }
    }
    worst
}

/// Asserts that `run` did what `reference` did: the same per-step losses (element-wise), the
/// same update of every parameter and the same buffers (norm-wise per tensor), to `tol`,
/// through `allgrad_testkit::close`. Parameters named in `skip` are left out (state why at the
/// call).
pub fn assert_same_steps(run: &Outcome, reference: &Outcome, tol: f64, skip: &[&str], what: &str) {
    use allgrad_testkit::close::{assert_elem_rel, assert_rel};
    assert_elem_rel(&run.losses, &reference.losses, tol, f64::MIN_POSITIVE, &format!("{what}: per-step losses"));
    let keep = |m: Named| -> Named { m.into_iter().filter(|(n, _)| !skip.iter().any(|s| n.ends_with(s))).collect() };
    let (got, want) = (keep(run.updates()), keep(reference.updates()));
    assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "{what}: parameters");
    for (n, u) in &want {
        assert_rel(&got[n], u, tol, &format!("{what}: update of {n}"));
    }
    assert_eq!(run.buffers.keys().collect::<Vec<_>>(), reference.buffers.keys().collect::<Vec<_>>(), "{what}: buffers");
    for (n, b) in &reference.buffers {
        assert_rel(&run.buffers[n], b, tol, &format!("{what}: buffer {n}"));
    }
}

/// The largest relative update over all parameters: training moved them.
pub fn largest_update(run: &Outcome) -> f64 {
    let (d, _) = max_rel_diff(&run.end, &run.init, 1e-3);
    d
}
