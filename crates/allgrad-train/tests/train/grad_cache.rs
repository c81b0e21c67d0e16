//! Gradient caching (`train.cache_chunk`), with ranks as threads, in f64:
//! - a cached step equals a plain step for a two-view MLP with keyed dropout on 1, 2 and 3
//!   ranks, and the 1-rank plain step at the same global batch, with chunks that do not
//!   divide the local batch (also with accumulation), and for the built-in `vectors` method;
//! - the second pass replays the first bitwise, and dropout that is not keyed is caught;
//! - with SyncBatchNorm, a cached step equals a plain step that normalises per chunk (and the
//!   first pass leaves the running statistics alone), equals the plain step when one chunk
//!   holds the micro-batch, and differs from it otherwise;
//! - bad settings are refused naming `train.cache_chunk`.

use std::path::Path;

use allgrad_dist::run_threads;
use allgrad_models::{Batch, EmbeddingObjective, Objective};
use allgrad_train::optim::OptimConfig;
use allgrad_train::params::ParamStore;
use allgrad_train::{grad_cache, run, RunConfig, Trainer};
use candle_core::{DType, Device};

use crate::cache_support::mlp::{LossOnly, Middle, TwoViewMlp};
use crate::cache_support::{assert_same_steps, largest_update, section, train, trainer_config, Outcome};

const TOL: f64 = 1e-10;

fn sgd() -> OptimConfig {
    OptimConfig::Sgd { lr: 0.4, momentum: 0.9, nesterov: false, weight_decay: 1e-4 }
}

fn mlp_run(middle: Middle, w: usize, global: usize, acc: usize, chunk: Option<usize>, plain_chunk: Option<usize>) -> Outcome {
    let mut cfg = trainer_config(section(global, acc, chunk), sgd());
    // Weight decay on every parameter, the biases too: the bias before batch norm has a true
    // gradient of 0 (the normalisation removes it), so without decay its update is rounding
    // noise, which no comparison of updates can hold to a tolerance.
    cfg.param_groups.exclude_1d = false;
    train(w, &cfg, 3, || {
        let mut o = TwoViewMlp::new(middle);
        o.plain_chunk = plain_chunk;
        Ok(o)
    })
}

#[test]
fn cached_dropout_mlp_step_equals_the_plain_step_on_1_2_3_ranks_and_1_rank_at_the_same_global_batch() {
    // Global batch 30: local 30, 15, 10; chunks of 4 divide none of them.
    let one = mlp_run(Middle::KeyedDropout, 1, 30, 1, None, None);
    assert!(largest_update(&one) > 1e-3, "3 steps moved no parameter");
    for w in [1, 2, 3] {
        let cached = mlp_run(Middle::KeyedDropout, w, 30, 1, Some(4), None);
        assert_same_steps(&cached, &mlp_run(Middle::KeyedDropout, w, 30, 1, None, None), TOL, &[], &format!("W={w} vs plain"));
        assert_same_steps(&cached, &one, TOL, &[], &format!("W={w} vs 1-rank plain"));
    }
}

#[test]
fn cached_step_with_accumulation_equals_the_plain_step_with_it() {
    // 3 ranks, 2 micro-batches of 5 per rank, chunks of 2 (2, 2, 1).
    let cached = mlp_run(Middle::KeyedDropout, 3, 30, 2, Some(2), None);
    assert_same_steps(&cached, &mlp_run(Middle::KeyedDropout, 3, 30, 2, None, None), TOL, &[], "accumulate 2");
}

#[test]
fn replayed_chunk_embeddings_equal_the_first_pass_bitwise_and_the_whole_batch_rows() {
    run_threads(1, |pg| {
        let mut o = TwoViewMlp::new(Middle::KeyedDropout);
        o.build(ParamStore::new(3).var_builder(DType::F64, &Device::Cpu))?;
        let idx = [7usize, 3, 11, 40, 2, 9, 18];
        let batch = Batch { indices: &idx, epoch: 1, step: 4, seed: 5 };
        let first = o.embed(&batch, 2..6, &pg)?;
        let _other = o.embed(&batch, 0..2, &pg)?;
        let again = o.embed(&batch, 2..6, &pg)?;
        assert_eq!(first.flatten_all()?.to_vec1::<f64>()?, again.flatten_all()?.to_vec1::<f64>()?, "replay differs");
        let whole = o.embed(&batch, 0..7, &pg)?.narrow(0, 2, 4)?;
        let diff = (&whole - &first)?.abs()?.max_all()?.to_scalar::<f64>()?;
        assert!(diff <= 1e-14, "a chunk's embeddings differ from its rows of the whole batch by {diff:e}");
        // Dropout is on: the next step's masks change the same chunk's embeddings.
        let next = o.embed(&Batch { step: 5, ..batch }, 2..6, &pg)?;
        let moved = (&next - &first)?.abs()?.max_all()?.to_scalar::<f64>()?;
        assert!(moved > 1e-3, "dropout masks did not change with the step ({moved:e})");
        Ok(())
    })
    .unwrap();
}

#[test]
fn dropout_that_is_not_keyed_is_caught_by_the_replay_check_naming_the_step_and_chunk() {
    let cfg = trainer_config(section(12, 1, Some(4)), sgd());
    let err = run_threads(2, |pg| {
        let mut t = Trainer::new(cfg.clone(), Box::new(TwoViewMlp::new(Middle::UnkeyedDropout)), pg, None, false)?;
        Ok(t.train_until(1)?)
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("train.cache_chunk: at step 1, chunk 0 (samples 0..4") && err.contains("not replayed"), "{err}");
}

#[test]
fn cached_step_with_sync_batch_norm_equals_a_plain_step_normalising_per_chunk() {
    // The running statistics are compared too: updated once per chunk, by the second pass
    // only (a first pass that updated them would have moved them twice as often).
    for w in [1, 2] {
        let cached = mlp_run(Middle::SyncBatchNorm, w, 24, 1, Some(5), None);
        assert!(!cached.buffers.is_empty());
        let ghost = mlp_run(Middle::SyncBatchNorm, w, 24, 1, None, Some(5));
        assert_same_steps(&cached, &ghost, TOL, &[], &format!("W={w} vs plain per-chunk batch norm"));
        // Per-chunk statistics are not the whole batch's: the plain step differs.
        let plain = mlp_run(Middle::SyncBatchNorm, w, 24, 1, None, None);
        let d = (cached.losses[1] - plain.losses[1]).abs() / plain.losses[1];
        assert!(d > 1e-6, "W={w}: per-chunk batch norm changed nothing ({d:e}): the comparison above proves nothing");
    }
}

#[test]
fn cached_step_with_sync_batch_norm_and_one_chunk_per_micro_batch_equals_the_plain_step() {
    for w in [1, 3] {
        let cached = mlp_run(Middle::SyncBatchNorm, w, 24, 1, Some(24 / w), None);
        assert_same_steps(&cached, &mlp_run(Middle::SyncBatchNorm, w, 24, 1, None, None), TOL, &[], &format!("W={w}"));
    }
}

fn vectors_config(loss: &str, sets: &[&str]) -> RunConfig {
    let text = format!(
        "seed: 2\ndtype: f64\nmethod: vectors\n\
         data: {{kind: vectors, samples: 90, dim: 6, clusters: 3, view_noise: 0.5}}\n\
         model: {{kind: mlp, hidden: 10, out: 4}}\nloss: {loss}\n\
         optim: {{kind: lars, lr: 0.3, weight_decay: 1.0e-4}}\n\
         train: {{global_batch: 18, epochs: 1, max_steps: 3, eval: false}}\nlog: {{progress: quiet, plot: false}}\n"
    );
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    RunConfig::parse(&text, Path::new("cache.yaml"), &sets).unwrap()
}

fn vectors_run(cfg: &RunConfig, w: usize) -> Vec<Vec<f64>> {
    run_threads(w, |pg| {
        cfg.validate(pg.world_size(), Path::new("cache.yaml")).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let mut t = run::build(cfg, pg, None, false)?;
        let losses = (1..=3).map(|s| Ok(t.train_until(s)?.last_loss)).collect::<candle_core::Result<Vec<_>>>()?;
        let mut out = vec![losses];
        for (_, v) in t.params() {
            out.push(v.flatten_all()?.to_vec1::<f64>()?);
        }
        Ok(out)
    })
    .unwrap()
    .remove(0)
}

#[test]
fn vectors_method_cached_through_the_config_equals_its_plain_step() {
    for loss in ["{kind: nt_xent, temperature: 0.2}", "{kind: cross_correlation, lambda: 0.01}"] {
        let plain = vectors_run(&vectors_config(loss, &[]), 1);
        for w in [2, 3] {
            let cached = vectors_run(&vectors_config(loss, &["train.cache_chunk=4"]), w);
            for (a, b) in cached.iter().flatten().zip(plain.iter().flatten()) {
                assert!((a - b).abs() <= TOL * b.abs().max(1e-2), "{loss} W={w}: {a} vs {b}");
            }
        }
    }
}

#[test]
fn cache_chunk_zero_or_larger_than_the_micro_batch_is_refused_naming_the_key() {
    let cfg = vectors_config("{kind: nt_xent}", &["train.cache_chunk=0"]);
    let e = cfg.validate(1, Path::new("cache.yaml")).unwrap_err().to_string();
    assert!(e.starts_with("cache.yaml: train.cache_chunk = 0"), "{e}");
    let cfg = vectors_config("{kind: nt_xent}", &["train.cache_chunk=7"]);
    let e = cfg.validate(3, Path::new("cache.yaml")).unwrap_err().to_string();
    assert!(e.contains("train.cache_chunk = 7 exceeds") && e.contains("(world size 3 x train.accumulate 1) = 6"), "{e}");
    assert!(cfg.validate(2, Path::new("cache.yaml")).is_ok(), "7 of 9 samples per rank is a valid chunk");
    let e = RunConfig::parse(
        &vectors_config("{kind: nt_xent}", &[]).to_yaml(),
        Path::new("c.yaml"),
        &["train.cache_chunk=-1".into()],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("at `train.cache_chunk`"), "{e}");
}

#[test]
fn cache_chunk_on_an_objective_without_embeddings_is_refused_naming_the_key() {
    let cfg = trainer_config(section(12, 1, Some(3)), sgd());
    let err = run_threads(1, |pg| {
        Ok(Trainer::new(cfg.clone(), Box::new(LossOnly(TwoViewMlp::new(Middle::KeyedDropout))), pg, None, false).map(|_| ())?)
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("train.cache_chunk is set") && err.contains("EmbeddingObjective"), "{err}");
    // Trainer::new applies the config's checks too (a TrainerConfig need not come from YAML).
    let cfg = trainer_config(section(12, 1, Some(0)), sgd());
    let err = run_threads(1, |pg| {
        Ok(Trainer::new(cfg.clone(), Box::new(TwoViewMlp::new(Middle::KeyedDropout)), pg, None, false).map(|_| ())?)
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("train.cache_chunk = 0"), "{err}");
}

/// [`TwoViewMlp`], saying that it reads `l2.weight` row by row (as Partial FC reads its
/// centres): gradient caching cannot take that.
struct RowSparse(TwoViewMlp);

impl Objective for RowSparse {
    fn build(&mut self, vb: candle_nn::VarBuilder) -> candle_core::Result<()> {
        self.0.build(vb)
    }
    fn num_samples(&self) -> usize {
        self.0.num_samples()
    }
    fn loss(&mut self, batch: &Batch, pg: &allgrad_dist::ProcessGroup) -> candle_core::Result<candle_core::Tensor> {
        self.0.loss(batch, pg)
    }
    fn embedding(&mut self) -> Option<&mut dyn EmbeddingObjective> {
        self.0.embedding()
    }
    fn has_sparse_rows(&self, name: &str) -> bool {
        name == "l2.weight"
    }
}

#[test]
fn cache_chunk_on_an_objective_with_a_row_sparse_parameter_is_refused_when_the_trainer_is_built() {
    let cfg = trainer_config(section(12, 1, Some(3)), sgd());
    // Trainer::new returns the error: no step has run, no cached gradient was computed.
    let err = run_threads(1, |pg| {
        Ok(Trainer::new(cfg.clone(), Box::new(RowSparse(TwoViewMlp::new(Middle::KeyedDropout))), pg, None, false).map(|_| ())?)
    })
    .unwrap_err()
    .to_string();
    let want = "train.cache_chunk: the objective reads l2.weight row by row (a row-sparse gradient)";
    assert!(err.contains(want) && err.contains("remove train.cache_chunk"), "{err}");
}

/// Norm-wise relative tolerance of the finite-difference check (see its comment): measured
/// up to 3.5e-9 (l1.bias).
const FD_TOL: f64 = 1e-7;

#[test]
fn cached_gradients_equal_central_finite_differences_of_the_loss() {
    // An independent reference: the derivative of the plain loss (keyed dropout makes it a
    // deterministic function of the parameters) by central differences, entry by entry.
    run_threads(1, |pg| {
        let store = ParamStore::new(4);
        let mut o = TwoViewMlp::new(Middle::KeyedDropout);
        o.build(store.var_builder(DType::F64, &Device::Cpu))?;
        let params = store.vars();
        let idx: Vec<usize> = (10..21).collect();
        let batch = Batch { indices: &idx, epoch: 0, step: 2, seed: 8 };
        let mut grads: Vec<_> = params.iter().map(|(_, v)| v.as_tensor().zeros_like()).collect::<candle_core::Result<_>>()?;
        grad_cache::cached_gradients(&mut o, &batch, &pg, 3, 1.0, &params, &mut grads)?;
        let h = 1e-6;
        let mut checked = 0;
        for ((name, var), g) in params.iter().zip(&grads) {
            let base = var.as_tensor().flatten_all()?.to_vec1::<f64>()?;
            let g = g.flatten_all()?.to_vec1::<f64>()?;
            let mut fds = Vec::with_capacity(base.len());
            for k in 0..base.len() {
                let mut at = |delta: f64| -> candle_core::Result<f64> {
                    let mut p = base.clone();
                    p[k] += delta;
                    var.set(&candle_core::Tensor::from_vec(p, var.shape(), &Device::Cpu)?)?;
                    o.loss(&batch, &pg)?.to_scalar::<f64>()
                };
                fds.push((at(h)? - at(-h)?) / (2.0 * h));
                var.set(&candle_core::Tensor::from_vec(base.clone(), var.shape(), &Device::Cpu)?)?;
                checked += 1;
            }
            // Central differences at h = 1e-6 of a loss of size ~1: its rounding (~1e-16) over
            // 2h leaves ~1e-10 in each entry, and the h² term of a smooth loss ~1e-12.
            allgrad_testkit::close::assert_rel(&g, &fds, FD_TOL, &format!("{name}: cached gradient vs finite differences"));
        }
        assert!(checked > 100, "{checked} entries checked");
        Ok(())
    })
    .unwrap();
}
