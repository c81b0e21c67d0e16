//! The trainer's semantics, with ranks as threads:
//! - W = 2 and 3 ranks end with the same parameters as 1 rank at the same global batch, for
//!   a local loss (NT-Xent over global negatives) and a replicated loss (cross-correlation);
//! - a run stopped and resumed from its checkpoint ends bitwise identical to one that was not;
//! - a non-finite loss stops the run naming the step, or is skipped when the config says so.

use std::collections::BTreeMap;
use std::path::Path;

use allgrad_dist::{run_threads, ProcessGroup};
use allgrad_train::{run, RunConfig};

fn config(extra: &[&str]) -> RunConfig {
    let base = "seed: 3\n\
                method: vectors\n\
                data: {kind: vectors, samples: 96, dim: 8, clusters: 4, view_noise: 0.5}\n\
                model: {kind: mlp, hidden: 16, out: 8}\n\
                train: {global_batch: 24, epochs: 2, max_steps: 5}\n\
                log: {progress: quiet, plot: false}\n";
    let sets: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    RunConfig::parse(base, Path::new("test.yaml"), &sets).unwrap()
}

type Params = BTreeMap<String, Vec<f32>>;

fn final_params(cfg: &RunConfig, w: usize) -> Params {
    let all = run_threads(w, |pg: ProcessGroup| {
        cfg.validate(pg.world_size(), Path::new("test.yaml")).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let mut t = run::build(cfg, pg, None, false)?;
        t.train()?;
        let mut out = Params::new();
        for (name, v) in t.params() {
            out.insert(name.clone(), v.flatten_all()?.to_vec1::<f32>()?);
        }
        Ok(out)
    })
    .unwrap();
    for p in &all[1..] {
        assert_eq!(p, &all[0], "replicated parameters differ between ranks");
    }
    all.into_iter().next().unwrap()
}

/// Each parameter within `rel` norm-wise (`allgrad_testkit::close`).
fn assert_close(a: &Params, b: &Params, rel: f64, what: &str) {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    let wide = |v: &[f32]| -> Vec<f64> { v.iter().map(|x| f64::from(*x)).collect() };
    for (name, x) in a {
        allgrad_testkit::close::assert_rel(&wide(x), &wide(&b[name]), rel, &format!("{what}: {name}"));
    }
}

fn moved(a: &Params, b: &Params) -> bool {
    a.iter().any(|(k, v)| v.iter().zip(&b[k]).any(|(p, q)| p != q))
}

#[test]
fn local_loss_on_2_and_3_ranks_equals_1_rank() {
    let cfg = config(&["loss.kind=nt_xent", "optim={kind: sgd, lr: 0.5, momentum: 0.9, weight_decay: 0.0001}"]);
    let one = final_params(&cfg, 1);
    let untrained = final_params(&config(&["train.max_steps=0", "train.epochs=0"]), 1);
    assert!(moved(&one, &untrained), "training changed nothing");
    for w in [2, 3] {
        assert_close(&final_params(&cfg, w), &one, 1e-5, &format!("nt_xent W={w}"));
    }
}

#[test]
fn replicated_loss_on_2_and_3_ranks_equals_1_rank() {
    let cfg = config(&["loss={kind: cross_correlation, lambda: 0.01}", "optim={kind: lars, lr: 0.2, weight_decay: 0.0001}"]);
    let one = final_params(&cfg, 1);
    let untrained = final_params(&config(&["train.max_steps=0", "train.epochs=0"]), 1);
    assert!(moved(&one, &untrained), "training changed nothing");
    for w in [2, 3] {
        assert_close(&final_params(&cfg, w), &one, 1e-5, &format!("cross_correlation W={w}"));
    }
}

#[test]
fn adamw_on_2_ranks_equals_1_rank() {
    // NT-Xent: every parameter has a real gradient. (Under the cross-correlation loss the last
    // bias has an exactly zero gradient, whose rounding noise AdamW would normalise into
    // full-size steps of either sign: no optimizer-independent truth to compare with.)
    let cfg = config(&["loss.kind=nt_xent", "optim={kind: adamw, lr: 0.001}"]);
    let one = final_params(&cfg, 1);
    assert_close(&final_params(&cfg, 2), &one, 1e-5, "adamw W=2");
}

#[test]
fn accumulation_on_2_ranks_moves_every_parameter_tensor_to_finite_values() {
    // Only that accumulated steps run and update everything: micro-batch m is the m-th part
    // of every rank's slice, so its contrastive loss depends on W and no 1-rank run equals
    // it. (grad_cache.rs holds a cached step with accumulation to the plain accumulated step.)
    let acc = final_params(&config(&["train.accumulate=2"]), 2);
    let untrained = final_params(&config(&["train.max_steps=0", "train.epochs=0"]), 1);
    for (name, v) in &acc {
        assert!(v.iter().all(|p| p.is_finite()), "{name} is not finite after accumulated steps");
        assert!(v.iter().zip(&untrained[name]).any(|(p, q)| p != q), "{name} did not move under accumulation");
    }
}

#[test]
fn resumed_run_ends_bitwise_identical_to_an_uninterrupted_one() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(&["train.max_steps=7", "checkpoint.every=2", "log.every=1", "optim={kind: adamw, lr: 0.01}"]);
    let run_to_end = |out: &Path, stop: usize, resume: bool| -> Params {
        run_threads(2, |pg| {
            let mut t = run::build(&cfg, pg, Some(out.to_path_buf()), resume)?;
            t.train_until(stop)?;
            let mut p = Params::new();
            for (n, v) in t.params() {
                p.insert(n.clone(), v.flatten_all()?.to_vec1::<f32>()?);
            }
            Ok(p)
        })
        .unwrap()
        .remove(0)
    };
    let straight = run_to_end(&dir.path().join("a"), usize::MAX, false);
    let b = dir.path().join("b");
    let first = run_to_end(&b, 3, false);
    assert_ne!(first, straight);
    let latest = std::fs::read_to_string(b.join("checkpoints/latest")).unwrap();
    assert_eq!(latest.trim(), "step_3");
    let resumed = run_to_end(&b, usize::MAX, true);
    assert_eq!(resumed, straight, "resume is not bitwise identical");
    // The metrics of the resumed run continue where the first part stopped.
    let steps: Vec<u64> = std::fs::read_to_string(b.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.get("loss").is_some())
        .map(|v| v["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, (1..=7).collect::<Vec<u64>>(), "{steps:?}");
}

#[test]
fn non_finite_loss_stops_the_run_naming_the_step_or_is_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(&["optim={kind: sgd, lr: 1.0e30}", "checkpoint.every=1"]);
    let out = dir.path().to_path_buf();
    let err = run_threads(2, |pg| {
        let mut t = run::build(&cfg, pg, Some(out.clone()), false)?;
        Ok(t.train()?)
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("non-finite") && err.contains("at step"), "{err}");
    // Whatever was checkpointed before is finite.
    if let Some(ck) = allgrad_train::checkpoint::load_latest(&out, &candle_core::Device::Cpu).unwrap() {
        for (name, t) in ck.model {
            let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert!(v.iter().all(|x| x.is_finite()), "checkpoint {} holds non-finite {name}", ck.path.display());
        }
    }
    let skip = config(&["optim={kind: sgd, lr: 1.0e30}", "train.on_nonfinite=skip"]);
    let summaries = run_threads(2, |pg| Ok(run::build(&skip, pg, None, false)?.train()?)).unwrap();
    assert!(summaries[0].skipped > 0 && summaries[0].steps == 5, "{:?}", summaries[0]);
}

/// A tiny objective with a queue of past keys (`loss.queue`): a linear map of fixed vectors,
/// two views each, NT-Xent tiled against the queue; the embeddings of step `poisoned` are NaN
/// (as a diverging step's would be), so that step's keys, pushed into the queue by its loss,
/// are NaN.
struct Queued {
    w: Option<candle_core::Tensor>,
    queue: allgrad_models::tiled::KeyQueue,
    poisoned: usize,
}

impl allgrad_models::Objective for Queued {
    fn build(&mut self, vb: candle_nn::VarBuilder) -> candle_core::Result<()> {
        self.w = Some(vb.get_with_hints((6, 4), "w", candle_nn::init::DEFAULT_KAIMING_NORMAL)?);
        Ok(())
    }
    fn num_samples(&self) -> usize {
        48
    }
    fn loss(&mut self, batch: &allgrad_models::Batch, pg: &ProcessGroup) -> candle_core::Result<candle_core::Tensor> {
        let view = |v: u64| -> candle_core::Result<candle_core::Tensor> {
            let rows: Vec<f32> = batch
                .indices
                .iter()
                .flat_map(|&i| allgrad_testkit::hashed_values(6, i as u64 + 100 * v))
                .map(|x| x as f32)
                .collect();
            let x = candle_core::Tensor::from_vec(rows, (batch.indices.len(), 6), &candle_core::Device::Cpu)?;
            let z = x.matmul(self.w.as_ref().expect("built"))?;
            if batch.step + 1 == self.poisoned {
                z * f64::NAN
            } else {
                Ok(z)
            }
        };
        allgrad_models::losses::nt_xent_tiled_queued(&view(1)?, &view(2)?, 0.5, 4, &mut self.queue, pg)
    }
    fn buffers(&self) -> candle_core::Result<Vec<(String, candle_core::Tensor)>> {
        allgrad_models::tiled::queue_buffers(Some(&self.queue))
    }
    fn load_buffers(&mut self, buffers: &std::collections::HashMap<String, candle_core::Tensor>) -> candle_core::Result<()> {
        allgrad_models::tiled::load_queue_buffers(Some(&mut self.queue), buffers, "queued")
    }
}

fn bits(named: Vec<(String, candle_core::Tensor)>) -> BTreeMap<String, Vec<u32>> {
    let flat = |t: &candle_core::Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    named.iter().map(|(n, t)| (n.clone(), flat(t).iter().map(|x| x.to_bits()).collect())).collect()
}

#[test]
fn a_skipped_step_leaves_the_queue_of_past_keys_as_it_was() {
    // Step 3's keys are NaN: with train.on_nonfinite: skip the step is skipped and the queue
    // (2 batches) holds steps 1 and 2's keys after it, as before it; steps 4 to 6 are finite.
    // Without the roll-back, step 3's NaN keys would make steps 4 and 5 non-finite too.
    let cfg = config(&["optim={kind: sgd, lr: 0.1}", "train.on_nonfinite=skip", "train.max_steps=6"]);
    run_threads(2, |pg| {
        let trainer_cfg = allgrad_train::TrainerConfig {
            seed: cfg.seed,
            dtype: candle_core::DType::F32,
            precision: Default::default(),
            device: candle_core::Device::Cpu,
            train: allgrad_train::TrainSection { global_batch: 8, epochs: 1, ..cfg.train.clone() },
            optim: cfg.optim.clone(),
            param_groups: Default::default(),
            schedule: Default::default(),
            checkpoint: Default::default(),
            log: cfg.log.clone(),
            settings: Default::default(),
        };
        let queue = allgrad_models::tiled::KeyQueue::new(2)?;
        let objective = Queued { w: None, queue, poisoned: 3 };
        let mut t = allgrad_train::Trainer::new(trainer_cfg, Box::new(objective), pg, None, false)?;
        assert_eq!(t.train_until(2)?.skipped, 0);
        let before = bits(t.buffers()?);
        assert_eq!(before["loss.queue"].len(), 2 * 16 * 4, "two batches of 16 keys of width 4");
        assert_eq!(t.train_until(3)?.skipped, 1, "step 3 (NaN keys) was not skipped");
        assert_eq!(bits(t.buffers()?), before, "the skipped step changed the queue");
        let rest = t.train_until(6)?;
        assert!(rest.skipped == 0 && rest.last_loss.is_finite(), "after the skipped step: {rest:?}");
        Ok(())
    })
    .unwrap();
}
