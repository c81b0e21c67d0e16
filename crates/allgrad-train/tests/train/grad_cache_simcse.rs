//! Gradient caching for SimCSE on the committed tiny BERT (2 layers, hidden 32), dropout ON,
//! in f64: a cached step (chunks that do not divide the local batch, so chunks pad to
//! different lengths) equals the plain step on 1, 2 and 3 ranks and the 1-rank plain step at
//! the same global batch, unsupervised and supervised; a chunk's replay is bitwise equal to
//! its first embedding. With `loss.tile` (the tiled InfoNCE), with and without caching, the
//! steps equal the untiled plain one-rank step. Unsupervised SimCSE with a queue of past keys
//! (`loss.queue`) trains the same on 1, 2 and 3 ranks, with and without caching, the queue
//! included.

use std::path::PathBuf;

use allgrad_dist::run_threads;
use allgrad_models::bert::Pooling;
use allgrad_models::simcse::{SimCse, SimCseData, SimCseLoss, SimCseModel};
use allgrad_models::{Batch, EmbeddingObjective, Objective};
use allgrad_train::optim::OptimConfig;
use allgrad_train::params::ParamStore;
use candle_core::{DType, Device};

use crate::cache_support::{assert_same_steps, largest_update, section, train, trainer_config, Outcome};

const VOCAB: [&str; 24] = [
    "a", "the", "small", "green", "frog", "jumps", "over", "log", "quickly", "river", "flows", "past", "old", "mill", "and",
    "children", "play", "near", "water", "stone", "bridge", "at", "night", "qwertyx",
];

/// Sentence `i` of variant `v`: 1 to 12 words, so lengths differ within chunks, across
/// chunks and across ranks ("qwertyx" is not in the vocabulary).
fn sentence(i: usize, v: usize) -> String {
    let n = 1 + (i * 7 + v * 5) % 12;
    (0..n).map(|k| VOCAB[(i * 5 + k * 7 + v * 3) % VOCAB.len()]).collect::<Vec<_>>().join(" ")
}

fn simcse(supervised: bool) -> candle_core::Result<SimCse> {
    simcse_tiled(supervised, None)
}

/// [`simcse`] with `loss.tile`.
fn simcse_tiled(supervised: bool, tile: Option<usize>) -> candle_core::Result<SimCse> {
    simcse_queued(supervised, tile, None)
}

/// [`simcse`] with `loss.tile` and `loss.queue`.
fn simcse_queued(supervised: bool, tile: Option<usize>, queue: Option<usize>) -> candle_core::Result<SimCse> {
    let model = SimCseModel {
        dir: PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../allgrad-models/tests/data/tiny-bert"),
        pretrained: !supervised,
        pooling: if supervised { Pooling::Cls } else { Pooling::ClsBeforePooler },
        mlp_head: !supervised,
        max_len: 16,
    };
    let data = if supervised {
        SimCseData::Triplets((0..24).map(|i| [sentence(i, 0), sentence(i, 1), sentence(i + 50, 2)]).collect())
    } else {
        SimCseData::Sentences((0..24).map(|i| sentence(i, 0)).collect())
    };
    let loss = SimCseLoss { temperature: 0.05, hard_negative_weight: if supervised { 0.4 } else { 0.0 }, tile, queue };
    SimCse::new(model, loss, data, Device::Cpu, DType::F64)
}

fn run(supervised: bool, w: usize, chunk: Option<usize>) -> Outcome {
    run_tiled(supervised, w, chunk, None)
}

fn run_tiled(supervised: bool, w: usize, chunk: Option<usize>, tile: Option<usize>) -> Outcome {
    let sgd = OptimConfig::Sgd { lr: 0.05, momentum: 0.9, nesterov: false, weight_decay: 0.0 };
    train(w, &trainer_config(section(12, 1, chunk), sgd), 2, || simcse_tiled(supervised, tile))
}

/// The attention key bias adds `q · b_k` to every score of a query row, which the softmax
/// cancels: its true gradient is 0 and the computed one rounding noise, not comparable.
const NOISE_ONLY: [&str; 1] = ["attention.self.key.bias"];

fn assert_cached_equals_plain(supervised: bool) {
    let one = run(supervised, 1, None);
    assert!(largest_update(&one) > 1e-4, "2 steps moved no parameter ({:e})", largest_update(&one));
    // Local batches 12, 6, 4; chunks 5, 4, 3 divide none of them.
    for (w, chunk) in [(1, 5), (2, 4), (3, 3)] {
        let cached = run(supervised, w, Some(chunk));
        let what = format!("supervised {supervised}, W={w}, chunk {chunk}");
        assert_same_steps(&cached, &run(supervised, w, None), 1e-10, &NOISE_ONLY, &format!("{what} vs plain"));
        assert_same_steps(&cached, &one, 1e-10, &NOISE_ONLY, &format!("{what} vs 1-rank plain"));
    }
}

#[test]
fn cached_unsupervised_simcse_equals_the_plain_step_on_1_2_3_ranks_and_1_rank() {
    assert_cached_equals_plain(false);
}

#[test]
fn cached_supervised_simcse_equals_the_plain_step_on_1_2_3_ranks_and_1_rank() {
    assert_cached_equals_plain(true);
}

/// `loss.tile`: the tiled InfoNCE, alone on 2 ranks and with caching on 3, takes the steps of
/// the untiled plain step on one rank.
#[test]
fn tiled_simcse_with_and_without_caching_equals_the_untiled_plain_step_on_one_rank() {
    for supervised in [false, true] {
        let one = run(supervised, 1, None);
        for (w, chunk, tile) in [(2, None, 5), (3, Some(3), 7)] {
            let tiled = run_tiled(supervised, w, chunk, Some(tile));
            let what = format!("supervised {supervised}, W={w}, chunk {chunk:?}, tile {tile}");
            assert_same_steps(&tiled, &one, 1e-10, &NOISE_ONLY, &what);
        }
    }
}

/// Unsupervised SimCSE with `loss.tile: 5` and `loss.queue: 2`: 3 steps on `w` ranks.
fn run_queued(w: usize, chunk: Option<usize>, queue: Option<usize>) -> Outcome {
    let sgd = OptimConfig::Sgd { lr: 0.05, momentum: 0.9, nesterov: false, weight_decay: 0.0 };
    train(w, &trainer_config(section(12, 1, chunk), sgd), 3, || simcse_queued(false, Some(5), queue))
}

#[test]
fn unsupervised_simcse_with_a_queue_of_past_keys_trains_the_same_on_1_2_3_ranks_with_and_without_caching() {
    let one = run_queued(1, None, Some(2));
    let without = run_queued(1, None, None);
    // Step 1: the queue is empty; step 2: one past batch's keys are more negatives.
    allgrad_testkit::close::assert_elem_rel(&one.losses[..1], &without.losses[..1], 1e-10, f64::MIN_POSITIVE, "step 1");
    assert!(
        (one.losses[1] - without.losses[1]).abs() > 1e-3,
        "step 2: the queued keys did not change the loss: {:?}",
        one.losses
    );
    // After 3 steps the queue holds the 2 newest batches: 12 positives each, 32 wide.
    let queue = one.buffers.get("loss.queue").expect("the queue is among the buffers");
    assert_eq!(queue.len(), 2 * 12 * 32);
    for (w, chunk) in [(2, None), (3, Some(3))] {
        let what = format!("queue 2, W={w}, chunk {chunk:?} vs W=1");
        assert_same_steps(&run_queued(w, chunk, Some(2)), &one, 1e-10, &NOISE_ONLY, &what);
    }
}

#[test]
fn simcse_chunk_replay_is_bitwise_equal_and_matches_its_rows_of_the_whole_batch() {
    run_threads(1, |pg| {
        for supervised in [false, true] {
            let mut o = simcse(supervised)?;
            o.build(ParamStore::new(9).var_builder(DType::F64, &Device::Cpu))?;
            let idx = [4usize, 17, 0, 9, 22, 13];
            let batch = Batch { indices: &idx, epoch: 0, step: 3, seed: 9 };
            let first = o.embed(&batch, 1..4, &pg)?;
            let _other = o.embed(&batch, 4..6, &pg)?;
            let again = o.embed(&batch, 1..4, &pg)?;
            assert_eq!(first.dims(), &[3, if supervised { 3 } else { 2 }, 32]);
            assert_eq!(first.flatten_all()?.to_vec1::<f64>()?, again.flatten_all()?.to_vec1::<f64>()?, "replay differs");
            // The whole batch pads to a longer sentence: equal up to rounding.
            let whole = o.embed(&batch, 0..6, &pg)?.narrow(0, 1, 3)?;
            let diff = (&whole - &first)?.abs()?.max_all()?.to_scalar::<f64>()?;
            assert!(diff <= 1e-12, "supervised {supervised}: chunk vs whole batch rows differ by {diff:e}");
            let next = o.embed(&Batch { step: 4, ..batch }, 1..4, &pg)?;
            let moved = (&next - &first)?.abs()?.max_all()?.to_scalar::<f64>()?;
            assert!(moved > 1e-4, "supervised {supervised}: dropout masks did not change with the step ({moved:e})");
        }
        Ok(())
    })
    .unwrap();
}
