//! The trait between a method and the trainer, and what it speaks of: a step's [`Batch`], the
//! rows of a sharded parameter ([`RowRange`]) and a row-sparse gradient ([`SparseRows`]); and
//! what the methods with a queue of past keys do alike as objectives (`QueueBuffer`).

use allgrad_dist::ProcessGroup;
use std::collections::HashMap;
use std::ops::Range;

use candle_core::{Result, Tensor};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use crate::tiled::{load_queue_buffers, queue_buffers, KeyQueue};

/// Where a step's local batch comes from. Every random choice an objective makes (views,
/// augmentations, dropout) must be keyed by `(seed, epoch, global sample index, ...)` or
/// `(seed, step, ...)`, never by the rank or a sample's local position, so that a run on W
/// ranks equals a run on one rank at the same global batch.
#[derive(Clone, Copy, Debug)]
pub struct Batch<'a> {
    /// Global indices of this rank's samples (its contiguous part of the global batch).
    pub indices: &'a [usize],
    /// Epoch, from 0.
    pub epoch: usize,
    /// Optimizer step, from 0.
    pub step: usize,
    /// The run's seed.
    pub seed: u64,
}

impl<'a> Batch<'a> {
    /// The samples `rows` of this batch (positions in [`Batch::indices`]), same epoch, step
    /// and seed: a chunk of it. Panics if `rows` is out of range, like slice indexing.
    pub fn part(&self, rows: Range<usize>) -> Batch<'a> {
        Batch { indices: &self.indices[rows], ..*self }
    }
}

/// A method: parameters plus the loss of a local batch.
///
/// The trainer optimises `J = (1/W) Σ_r L_r` where `L_r` is what [`Objective::loss`] returns
/// on rank r. A loss that depends on other ranks' data must reach it through the
/// differentiable collectives of `allgrad_dist` (their backward follows the sum rule); the
/// trainer then scales gradients by 1/W and sums replicated parameters across ranks.
pub trait Objective: Send {
    /// Creates the parameters through `vb`. Initialisation is seeded by the parameter's name,
    /// so it does not depend on the world size or on the order of creation.
    fn build(&mut self, vb: VarBuilder) -> Result<()>;

    /// Number of samples in the training set.
    fn num_samples(&self) -> usize;

    /// The micro-batches this rank will pass to [`Objective::loss`] next, in order (the rest
    /// of `epoch`, or up to where the run stops), so that the objective can prepare them
    /// ahead, e.g. build augmented views on worker threads while the model computes. A hint
    /// only: `loss` must still accept any batch.
    fn plan(&mut self, _epoch: usize, _seed: u64, _batches: &[Vec<usize>]) -> Result<()> {
        Ok(())
    }

    /// Whether the training samples are a stream read in order (webdataset shards): the
    /// trainer then hands out sample indices unshuffled, so that they are positions in the
    /// epoch (the stream shuffles itself, keyed, the same for any W). Default: false.
    fn sequential(&self) -> bool {
        false
    }

    /// This rank's loss (a scalar) on its part of the global batch.
    fn loss(&mut self, batch: &Batch, pg: &ProcessGroup) -> Result<Tensor>;

    /// The objective as a function of per-sample embeddings, when it is one (see
    /// [`EmbeddingObjective`]): the trainer needs it for gradient caching
    /// (`train.cache_chunk`). Default: `None`, and a run with `train.cache_chunk` is refused.
    fn embedding(&mut self) -> Option<&mut dyn EmbeddingObjective> {
        None
    }

    /// Whether a parameter is sharded across ranks (each rank holds a different part, as in a
    /// class-sharded classification head). Sharded parameters are not all-reduced.
    fn is_sharded(&self, _name: &str) -> bool {
        false
    }

    /// Called by the trainer before [`Objective::build`] with the group the run trains on: an
    /// objective with sharded parameters sizes its shard from the rank and the world size.
    /// Default: nothing.
    fn bind(&mut self, _pg: &ProcessGroup) -> Result<()> {
        Ok(())
    }

    /// The global rows (dim 0) that a sharded parameter holds on this rank, a contiguous
    /// range: with it, a checkpoint can be resumed on a different world size (the rows are
    /// re-sharded on load). Default: none (the parameter resumes only at the same W).
    fn shard_rows(&self, _name: &str) -> Option<RowRange> {
        None
    }

    /// The rows (dim 0) of parameter `name` that the optimizer may change at `step`, asked
    /// after the step's last loss: `None` (the default) for all. Rows marked false keep their
    /// value and their optimizer state (momentum, Adam moments) bit for bit, as if they were
    /// not part of the model this step: neither weight decay nor momentum moves them
    /// (Partial FC's unsampled class centres under `head.unsampled: frozen`).
    fn updated_rows(&self, _name: &str, _step: usize) -> Option<Vec<bool>> {
        None
    }

    /// The row-sparse gradient of a sharded parameter at the last [`Objective::loss`] call:
    /// `Some` when that loss read only some rows (dim 0) of `name`, and read them through
    /// [`SparseRows::leaf`] instead of the parameter itself. The parameter then has no
    /// gradient in the backward's store; its gradient is the leaf's gradient at rows
    /// [`SparseRows::rows`] and zero in every other row, and no tensor of the parameter's
    /// full size is formed for it. Asked by the trainer after every loss call (micro-batch);
    /// default: `None` (the parameter is on the graph as itself, its gradient dense).
    ///
    /// How the optimizer treats the rows left out is [`Objective::updated_rows`]'s answer:
    /// `None` (all rows may change) makes the update equal the dense update with a zero
    /// gradient in those rows (weight decay and momentum still move them, applied lazily);
    /// `Some(mask)` keeps them as they are.
    fn sparse_rows(&self, _name: &str) -> Option<SparseRows> {
        None
    }

    /// Whether [`Objective::sparse_rows`] may answer `Some` for `name` in this run. Asked once,
    /// when the trainer is built (after [`Objective::build`]), so that what a row-sparse
    /// gradient cannot go with (gradient caching, `train.cache_chunk`) is refused then, before
    /// any step. An objective that implements `sparse_rows` implements this too. Default: false.
    fn has_sparse_rows(&self, _name: &str) -> bool {
        false
    }

    /// The rows (dim 0, sorted, distinct) of sharded parameter `name` that the next
    /// [`Objective::loss`] call, on `batch`, will read, when it reads only some of them
    /// through [`Objective::sparse_rows`]: the trainer calls it before every loss call and
    /// brings those rows up to date first (rows a row-sparse update left behind). Called on
    /// every rank with its part of the same step, so it may use collectives (the face head
    /// gathers the global batch's labels). Default: `None` (no row-sparse reads).
    fn rows_to_read(&mut self, _name: &str, _batch: &Batch, _pg: &ProcessGroup) -> Result<Option<Vec<u32>>> {
        Ok(None)
    }

    /// Evaluation metrics (name, value), logged at the end of every epoch and of the run.
    fn evaluate(&mut self, _pg: &ProcessGroup) -> Result<Vec<(String, f64)>> {
        Ok(Vec::new())
    }

    /// The number of samples of every global micro-batch this run will see
    /// (`train.global_batch / train.accumulate`), told by the trainer before a checkpoint's
    /// buffers are loaded: an objective whose buffers depend on it (a queue of past keys)
    /// checks them against it. Default: nothing to check.
    fn expect_batch(&mut self, _global_micro_batch: usize) -> Result<()> {
        Ok(())
    }

    /// Non-trainable state by name (batch-norm running statistics, ...), saved in every
    /// checkpoint beside the parameters. Default: none. An objective with buffers should keep
    /// them identical on every rank (SyncBatchNorm does, by construction); the trainer saves
    /// rank 0's.
    fn buffers(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(Vec::new())
    }

    /// Where the training stream this rank reads stands (the streams of `webdataset` shards it
    /// reads, after the last batch it took), saved in checkpoints (every rank's merged). Default:
    /// none (the data is not a stream, or its position is the sampler's).
    fn stream_state(&self) -> Result<Option<allgrad_data::webdataset::StreamState>> {
        Ok(None)
    }

    /// Resumes the training stream from a checkpoint's [`Objective::stream_state`] (every
    /// rank's merged): the streams read on from there instead of from the epoch's start.
    /// Default: an error, so a saved position is never dropped silently.
    fn resume_stream(&mut self, _state: allgrad_data::webdataset::StreamState) -> Result<()> {
        candle_core::bail!("this objective reads no stream, but the checkpoint holds a stream position (stream.json)")
    }

    /// Restores what [`Objective::buffers`] returned (on resume). Default: an error unless
    /// `buffers` is empty, so state is never dropped silently.
    fn load_buffers(&mut self, buffers: &HashMap<String, Tensor>) -> Result<()> {
        if let Some(name) = buffers.keys().next() {
            candle_core::bail!("this objective has no buffers, but the checkpoint holds {name} (and {} more)", buffers.len() - 1);
        }
        Ok(())
    }
}

/// The rows of a parameter that one loss call read, and where their gradient lands: see
/// [`Objective::sparse_rows`].
#[derive(Clone, Debug)]
pub struct SparseRows {
    /// Local rows (dim 0) of the parameter, sorted and distinct.
    pub rows: Vec<u32>,
    /// A variable holding those rows' values in that order (`[rows.len(), ...]`, a leaf of
    /// the loss's graph): its gradient in the backward's store is theirs. `None` when `rows`
    /// is empty.
    pub leaf: Option<Tensor>,
}

/// An objective whose loss is a function of per-sample embeddings: `loss(batch) =
/// loss_of_embeddings(embed(batch))`, where row i of the embeddings depends only on sample i
/// (and on the parameters). SimCLR, SimCSE, BarlowTwins and classification heads on
/// embeddings are of this form.
///
/// It lets the trainer cache gradients (GradCache; `train.cache_chunk: N` in the run
/// config): it embeds the local batch in chunks of N samples without keeping activations,
/// computes the loss of all local embeddings (whose collectives reach the global batch) and
/// its gradient with respect to the embeddings, then embeds each chunk again with the graph
/// and backpropagates the cached gradient of its rows. Activation memory is that of one
/// chunk; the gradient is that of the plain step (see `allgrad_train::grad_cache`).
///
/// Two rules make the second embedding of a chunk equal the first:
/// - every random choice (dropout, augmentation) is keyed by the global sample index (and
///   seed, epoch or step, view), never by the call or the chunk, as [`Objective`] already
///   asks;
/// - batch statistics: a network with batch norm normalises each chunk with the chunk's
///   statistics (over every rank's chunk with SyncBatchNorm), the same in both passes, but
///   not those of the whole batch. A cached step then equals a plain step only for networks
///   without batch statistics, or against a plain step that also normalises per chunk.
///
/// A method gets gradient caching with a few lines:
///
/// ```
/// use std::ops::Range;
/// use allgrad_dist::ProcessGroup;
/// use allgrad_models::{Batch, EmbeddingObjective, Objective};
/// use candle_core::{Device, Result, Tensor};
/// use candle_nn::{Linear, Module, VarBuilder};
///
/// struct Mine { layer: Option<Linear> }
///
/// impl EmbeddingObjective for Mine {
///     fn embed(&mut self, batch: &Batch, rows: Range<usize>, _pg: &ProcessGroup) -> Result<Tensor> {
///         // Inputs of the chunk's samples, keyed by their global index.
///         let x: Vec<f32> = batch.indices[rows.clone()].iter().map(|&i| i as f32).collect();
///         let x = Tensor::from_vec(x, (rows.len(), 1), &Device::Cpu)?;
///         let Some(layer) = &self.layer else { candle_core::bail!("used before build") };
///         layer.forward(&x) // [chunk, d]
///     }
///     fn loss_of_embeddings(&mut self, z: &Tensor, _batch: &Batch, _pg: &ProcessGroup) -> Result<Tensor> {
///         z.sqr()?.mean_all() // with collectives (all_gather, ...) for a global loss
///     }
/// }
///
/// impl Objective for Mine {
///     fn build(&mut self, vb: VarBuilder) -> Result<()> {
///         self.layer = Some(candle_nn::linear(1, 4, vb.pp("embed"))?);
///         Ok(())
///     }
///     fn num_samples(&self) -> usize { 64 }
///     fn loss(&mut self, batch: &Batch, pg: &ProcessGroup) -> Result<Tensor> {
///         allgrad_models::loss_of_embedded_batch(self, batch, pg)
///     }
///     fn embedding(&mut self) -> Option<&mut dyn EmbeddingObjective> {
///         Some(self)
///     }
/// }
/// ```
pub trait EmbeddingObjective {
    /// The embeddings of samples `rows` of `batch` (positions in `batch.indices`; the trainer
    /// passes the whole batch, then chunks of it): a tensor whose dim 0 has one entry per
    /// sample of `rows`, in order (further dims are free, e.g. `[n, views, d]`). Training
    /// mode (dropout on, batch statistics). Called twice per chunk in a cached step, with
    /// the same arguments; both calls must return the same values.
    fn embed(&mut self, batch: &Batch, rows: Range<usize>, pg: &ProcessGroup) -> Result<Tensor>;

    /// This rank's loss (a scalar, as [`Objective::loss`]) from the embeddings of all its
    /// samples (`embed`'s chunks concatenated along dim 0, one entry per sample of
    /// `batch.indices`).
    fn loss_of_embeddings(&mut self, embeddings: &Tensor, batch: &Batch, pg: &ProcessGroup) -> Result<Tensor>;
}

/// The plain loss of an [`EmbeddingObjective`]: the embeddings of the whole batch, then their
/// loss. What [`Objective::loss`] of such an objective returns.
pub fn loss_of_embedded_batch(objective: &mut dyn EmbeddingObjective, batch: &Batch, pg: &ProcessGroup) -> Result<Tensor> {
    let z = objective.embed(batch, 0..batch.indices.len(), pg)?;
    objective.loss_of_embeddings(&z, batch, pg)
}

/// A contiguous range of rows of a parameter sharded by rows across ranks: this rank holds
/// global rows `start .. start + len` of `total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowRange {
    /// First global row held here.
    pub start: usize,
    /// Rows held here.
    pub len: usize,
    /// Rows of the whole (unsharded) parameter.
    pub total: usize,
}

impl RowRange {
    /// Rank `rank`'s part of `total` rows split over `world` ranks: contiguous, the first
    /// `total % world` ranks one row longer (`total % world` need not be 0).
    pub fn split(total: usize, rank: usize, world: usize) -> RowRange {
        let (base, extra) = (total / world.max(1), total % world.max(1));
        let start = rank * base + rank.min(extra);
        RowRange { start, len: base + usize::from(rank < extra), total }
    }

    /// One past the last global row held here.
    pub fn end(&self) -> usize {
        self.start + self.len
    }

    /// The local row of global row `row`, if this range holds it.
    pub fn local(&self, row: usize) -> Option<usize> {
        (row >= self.start && row < self.end()).then(|| row - self.start)
    }
}

/// A method's queue of past keys (`loss.queue`; `None` without it) as state of the run: what
/// [`Objective::expect_batch`], [`Objective::buffers`] and [`Objective::load_buffers`] do
/// with it, the same for every method that has one (vectors, SimCSE, the two-view method).
pub(crate) struct QueueBuffer {
    queue: Option<KeyQueue>,
    /// Keys a global micro-batch pushes per sample (both views, or a positive and a hard
    /// negative: 2; a positive: 1).
    keys_per_sample: usize,
    /// The objective, named in errors.
    objective: &'static str,
}

impl QueueBuffer {
    /// `queue` of an objective whose batches push `keys_per_sample` keys per sample.
    pub(crate) fn new(queue: Option<KeyQueue>, keys_per_sample: usize, objective: &'static str) -> Self {
        QueueBuffer { queue, keys_per_sample, objective }
    }

    /// The queue, for the loss to read and update (`None` without `loss.queue`).
    pub(crate) fn queue(&mut self) -> Option<&mut KeyQueue> {
        self.queue.as_mut()
    }

    /// [`Objective::expect_batch`]: the queue holds the keys of a global micro-batch.
    pub(crate) fn expect_batch(&mut self, global_micro_batch: usize) -> Result<()> {
        let rows = self.keys_per_sample * global_micro_batch;
        self.queue.as_mut().map_or(Ok(()), |q| q.expect_rows(rows))
    }

    /// [`Objective::buffers`] of an objective whose only buffer is the queue.
    pub(crate) fn buffers(&self) -> Result<Vec<(String, Tensor)>> {
        queue_buffers(self.queue.as_ref())
    }

    /// [`Objective::load_buffers`] of an objective whose only buffer is the queue: any other
    /// buffer is an error naming it and the objective.
    pub(crate) fn load_buffers(&mut self, buffers: &HashMap<String, Tensor>) -> Result<()> {
        load_queue_buffers(self.queue.as_mut(), buffers, self.objective)
    }

    /// Appends the queue to an objective's other buffers (nothing without a queue or before
    /// its first batch).
    pub(crate) fn save_into(&self, buffers: &mut Vec<(String, Tensor)>) -> Result<()> {
        self.queue.as_ref().map_or(Ok(()), |q| q.save_into(buffers))
    }

    /// Restores the queue from an objective's `buffers` and returns the others.
    pub(crate) fn load_from(&mut self, buffers: &HashMap<String, Tensor>) -> Result<HashMap<String, Tensor>> {
        match &mut self.queue {
            Some(q) => q.load_from(buffers),
            None => Ok(buffers.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uneven_split_covers_every_row_once_in_rank_order() {
        for (total, world) in [(10, 3), (7, 4), (12, 4), (5, 1), (3, 3)] {
            let ranges: Vec<RowRange> = (0..world).map(|r| RowRange::split(total, r, world)).collect();
            let mut next = 0;
            for r in &ranges {
                assert_eq!(r.start, next, "{total} over {world}: {ranges:?}");
                next = r.end();
            }
            assert_eq!(next, total);
            let (lo, hi) = (ranges.iter().map(|r| r.len).min().unwrap(), ranges.iter().map(|r| r.len).max().unwrap());
            assert!(hi - lo <= 1, "{ranges:?}");
        }
        let r = RowRange::split(10, 1, 3);
        assert_eq!((r.start, r.len, r.local(3), r.local(6), r.local(7)), (4, 3, None, Some(2), None));
    }
}
