//! Gradient caching (GradCache, Gao et al. 2021) across ranks: global batches beyond
//! activation memory, with the gradient of the plain step.
//!
//! With `train.cache_chunk: N`, a micro-batch of an objective that is a function of
//! per-sample embeddings ([`allgrad_models::EmbeddingObjective`]) is processed in two passes:
//!
//! 1. **Embed without a graph.** Each chunk of N samples (the last one may be shorter) is
//!    embedded and detached, so its activations are freed before the next chunk. The
//!    objective's buffers ([`allgrad_models::Objective::buffers`]: batch-norm running
//!    statistics) are restored afterwards, before the loss: this pass changes no state, and
//!    state the loss updates (a queue of past keys) is kept.
//! 2. **Loss and its gradient with respect to the embeddings.** The embeddings of the
//!    micro-batch become a leaf `E`; `loss_of_embeddings(E)` runs with its collectives (the
//!    all_gather of NT-Xent or InfoNCE reaches the global batch and its backward follows the
//!    sum rule), and `(L_r / (W · accumulate))` is backpropagated: this gives `G = ∂J/∂E`
//!    and the gradients of parameters used by the loss itself (a learned temperature, a
//!    classification head).
//! 3. **Replay with the graph.** Each chunk is embedded again, now with its graph, and
//!    `Σ (E_chunk ⊙ G_chunk)` is backpropagated; by the chain rule its parameter gradient is
//!    the chunk's share of `∂J/∂θ`. The chunks' gradients are summed, then the step goes on
//!    as a plain one: the sum over ranks of replicated gradients, the norm check, clipping
//!    and the optimizer.
//!
//! So the gradient equals the plain step's whenever the replay's embeddings equal the first
//! pass's, and the embeddings of a chunk equal its rows of the whole batch's. Keyed random
//! streams (dropout, augmentations keyed by the global sample index) make the first true by
//! construction; the trainer checks it for every chunk and stops with
//! [`TrainError::CacheReplay`] when a replay differs by more than [`replay_tolerance`].
//!
//! **Batch statistics.** A network with batch norm normalises each chunk with the chunk's
//! statistics (SyncBatchNorm: those of chunk k of every rank together), in both passes
//! alike, so the replay is exact; but these are not the statistics of the whole batch. A
//! cached step therefore equals a plain step for networks without batch statistics (MLPs,
//! BERT with dropout, LayerNorm) and, with batch norm, a plain step whose network also
//! normalises per chunk ("ghost" batch norm). With SyncBatchNorm, a chunk holds W · N
//! samples, so a W-rank cached run equals a one-rank run only where both normalise the same
//! groups of samples. The running statistics are updated once per chunk, by the second pass.
//!
//! Memory: the activations of one chunk, plus the embeddings of the micro-batch and the
//! loss's graph over them. Time: about one extra forward pass.

use std::ops::Range;

use allgrad_dist::ProcessGroup;
use allgrad_models::{Batch, EmbeddingObjective, Objective};
use candle_core::backprop::GradStore;
use candle_core::{DType, Result, Tensor, Var};

use crate::config::TrainSection;
use crate::error::{TrainError, TrainResult};

/// Largest `max |E2 − E1| / max |E1|` tolerated between a chunk's replayed embeddings `E2`
/// and its first-pass embeddings `E1` of dtype `dtype`. Keyed randomness makes them bitwise
/// equal on the CPU; the margin is for accelerator kernels that do not reproduce bit for bit
/// (their sums may run in another order each time, which moves a result by a few units in the
/// last place of its partial sums, times the depth of the network): 1e-10 in f64, 1e-4 in
/// f32, 1e-2 in f16 and bf16 (unit roundoff 2⁻¹¹ and 2⁻⁸). An unkeyed dropout mask changes
/// embeddings by far more.
pub fn replay_tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-10,
        DType::F32 => 1e-4,
        _ => 1e-2,
    }
}

/// [`TrainSection::check_cache_chunk`], and that `objective` can be cached: its
/// [`Objective::embedding`] is `Some`, and none of its parameters (`params`, by name) has a
/// row-sparse gradient ([`Objective::has_sparse_rows`]), which gradient caching does not take.
/// What [`crate::Trainer::new`] checks, after the objective's `build`: every refusal of
/// `train.cache_chunk` comes before the first step.
pub(crate) fn check_setup(
    train: &TrainSection,
    world_size: usize,
    objective: &mut dyn Objective,
    params: &[(String, Var)],
) -> TrainResult<()> {
    if train.cache_chunk.is_none() {
        return Ok(());
    }
    train.check_cache_chunk(world_size).map_err(TrainError::Setup)?;
    embedding(objective)?;
    match params.iter().find(|(n, _)| objective.has_sparse_rows(n)) {
        Some((name, _)) => Err(TrainError::Setup(format!(
            "train.cache_chunk: the objective reads {name} row by row (a row-sparse gradient), which gradient caching \
             does not take; remove train.cache_chunk"
        ))),
        None => Ok(()),
    }
}

fn embedding(objective: &mut dyn Objective) -> TrainResult<&mut dyn EmbeddingObjective> {
    objective.embedding().ok_or_else(|| {
        TrainError::Setup(
            "train.cache_chunk is set, but this method's objective is not a function of per-sample embeddings \
             (its Objective::embedding returns None): remove train.cache_chunk, or implement \
             allgrad_models::EmbeddingObjective for it"
                .into(),
        )
    })
}

/// The chunks of a batch of `n` samples: `chunk` samples each, the last one shorter when
/// `chunk` does not divide `n`.
pub fn chunks(n: usize, chunk: usize) -> Vec<Range<usize>> {
    let chunk = chunk.max(1);
    (0..n).step_by(chunk).map(|s| s..(s + chunk).min(n)).collect()
}

/// One micro-batch of a cached step (see the module docs): adds the gradients of
/// `L_r / loss_divisor` with respect to `params` into `grads` (same order) and returns the
/// loss `L_r`. `loss_divisor` is `W · accumulate` in the trainer. Every rank must call it
/// with batches of the same size (the chunks' collectives pair up across ranks).
pub fn cached_gradients(
    objective: &mut dyn Objective,
    batch: &Batch,
    pg: &ProcessGroup,
    chunk: usize,
    loss_divisor: f64,
    params: &[(String, Var)],
    grads: &mut [Tensor],
) -> TrainResult<f64> {
    let step = cached_step(objective, batch, pg, chunk, loss_divisor, params, grads)?;
    // The loss and every chunk's replay figures in one read, as the trainer's device path does.
    let mut read: Vec<&Tensor> = vec![&step.loss];
    for r in &step.replays {
        read.extend([&r.diff, &r.scale]);
    }
    let figures = allgrad_nn::transfer::read_batched(&read)?;
    for (r, v) in step.replays.iter().zip(figures[1..].chunks(2)) {
        r.verify(v[0], v[1])?;
    }
    Ok(figures[0])
}

/// A cached micro-batch's results as tensors, read by nobody yet: what the device path of the
/// trainer reads in its one batched read after the update.
pub struct CachedStep {
    /// The loss `L_r`, detached, f64, `[]`.
    pub loss: Tensor,
    /// The replay checks of its chunks, to verify once their figures are read.
    pub replays: Vec<ReplayCheck>,
}

/// The check that a chunk embedded again gave what it gave the first time ([`TrainError::CacheReplay`]
/// otherwise): the largest difference and the largest magnitude, as `[]` f64 tensors.
pub struct ReplayCheck {
    /// `max |replay − first|`.
    pub diff: Tensor,
    /// `max |first|`.
    pub scale: Tensor,
    chunk: usize,
    rows: Range<usize>,
    step: usize,
    dtype: DType,
}

impl ReplayCheck {
    /// The check on the read figures `diff` and `scale`.
    pub fn verify(&self, diff: f64, scale: f64) -> TrainResult<()> {
        // Non-finite embeddings are the loss check's to report, not a replay failure.
        if diff.is_finite() && scale.is_finite() && diff > replay_tolerance(self.dtype) * scale {
            return Err(TrainError::CacheReplay { step: self.step + 1, chunk: self.chunk, rows: self.rows.clone(), diff, scale });
        }
        Ok(())
    }
}

/// [`cached_gradients`] without a read: the loss and the replay checks as tensors.
pub fn cached_step(
    objective: &mut dyn Objective,
    batch: &Batch,
    pg: &ProcessGroup,
    chunk: usize,
    loss_divisor: f64,
    params: &[(String, Var)],
    grads: &mut [Tensor],
) -> TrainResult<CachedStep> {
    let ranges = chunks(batch.indices.len(), chunk);
    let saved = objective.buffers()?;

    // Pass 1: embeddings without a graph, chunk by chunk.
    let emb = embedding(objective)?;
    let mut parts = Vec::with_capacity(ranges.len());
    for r in &ranges {
        let z = emb.embed(batch, r.clone(), pg)?;
        check_rows(&z, r)?;
        parts.push(z.detach());
    }
    let cached = Var::from_tensor(&Tensor::cat(&parts, 0)?)?;
    drop(parts);

    // The first pass changed no state: restore the buffers (batch-norm running statistics)
    // before the loss, which may update state of its own (a queue of past keys, `loss.queue`).
    if !saved.is_empty() {
        objective.load_buffers(&saved.into_iter().collect())?;
    }
    let emb = embedding(objective)?;

    // The loss of all local embeddings and its gradient G with respect to them.
    let loss = emb.loss_of_embeddings(cached.as_tensor(), batch, pg)?;
    if loss.rank() != 0 {
        return Err(TrainError::Setup(format!("the objective's loss must be a scalar, got shape {:?}", loss.dims())));
    }
    let value = loss.detach().to_dtype(DType::F64)?;
    let store = (loss / loss_divisor)?.backward_release()?;
    add_grads(params, &store, grads)?;
    let g = store.get(cached.as_tensor()).cloned().ok_or_else(|| {
        TrainError::Setup("loss_of_embeddings does not depend on the embeddings it was given: nothing to cache".into())
    })?;
    drop(store);

    // Pass 2: each chunk again, with its graph; backpropagate its rows of G.
    let emb = embedding(objective)?;
    let mut replays = Vec::with_capacity(ranges.len());
    for (k, r) in ranges.iter().enumerate() {
        let z = emb.embed(batch, r.clone(), pg)?;
        let first = cached.as_tensor().narrow(0, r.start, r.len())?;
        replays.push(check_replay(&z, &first, k, r, batch.step)?);
        // The chunk's graph is freed during its backward (`backward_release`).
        let store = (z * g.narrow(0, r.start, r.len())?)?.sum_all()?.backward_release()?;
        add_grads(params, &store, grads)?;
    }
    Ok(CachedStep { loss: value, replays })
}

/// `grads[i] += store[params[i]]` where the store has one.
fn add_grads(params: &[(String, Var)], store: &GradStore, grads: &mut [Tensor]) -> Result<()> {
    for ((_, v), acc) in params.iter().zip(grads.iter_mut()) {
        if let Some(g) = store.get(v) {
            *acc = (&*acc + g)?;
        }
    }
    Ok(())
}

fn check_rows(z: &Tensor, rows: &Range<usize>) -> TrainResult<()> {
    if z.rank() == 0 || z.dim(0)? != rows.len() {
        return Err(TrainError::Setup(format!(
            "EmbeddingObjective::embed returned shape {:?} for samples {rows:?} of the batch: dim 0 must have one entry \
             per sample ({})",
            z.dims(),
            rows.len()
        )));
    }
    Ok(())
}

fn check_replay(replay: &Tensor, first: &Tensor, chunk: usize, rows: &Range<usize>, step: usize) -> TrainResult<ReplayCheck> {
    if replay.dims() != first.dims() {
        return Err(TrainError::Setup(format!(
            "EmbeddingObjective::embed returned shape {:?} for samples {rows:?} the second time, {:?} the first",
            replay.dims(),
            first.dims()
        )));
    }
    let f64_max = |t: Tensor| -> Result<Tensor> { t.to_dtype(DType::F64)?.abs()?.max_all() };
    let diff = f64_max((replay.detach() - first)?)?;
    let scale = f64_max(first.clone())?;
    Ok(ReplayCheck { diff, scale, chunk, rows: rows.clone(), step, dtype: first.dtype() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_batch_in_order_with_a_shorter_last_one() {
        assert_eq!(chunks(7, 3), vec![0..3, 3..6, 6..7]);
        assert_eq!(chunks(6, 3), vec![0..3, 3..6]);
        assert_eq!(chunks(2, 5), vec![0..2]);
    }
}
