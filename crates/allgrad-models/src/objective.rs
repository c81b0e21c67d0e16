//! The trait between a method and the trainer.

use allgrad_dist::ProcessGroup;
use std::collections::HashMap;

use candle_core::{Result, Tensor};
use candle_nn::VarBuilder;

use crate::face::RowRange;

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

    /// This rank's loss (a scalar) on its part of the global batch.
    fn loss(&mut self, batch: &Batch, pg: &ProcessGroup) -> Result<Tensor>;

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
    /// (Partial FC's unsampled class centres).
    fn updated_rows(&self, _name: &str, _step: usize) -> Option<Vec<bool>> {
        None
    }

    /// Evaluation metrics (name, value), logged at the end of every epoch and of the run.
    fn evaluate(&mut self, _pg: &ProcessGroup) -> Result<Vec<(String, f64)>> {
        Ok(Vec::new())
    }

    /// Non-trainable state by name (batch-norm running statistics, ...), saved in every
    /// checkpoint beside the parameters. Default: none. An objective with buffers should keep
    /// them identical on every rank (SyncBatchNorm does, by construction); the trainer saves
    /// rank 0's.
    fn buffers(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(Vec::new())
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
