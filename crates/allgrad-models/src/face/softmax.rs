//! Softmax cross-entropy over classes sharded across ranks, without any rank holding the
//! C-wide logits.
//!
//! Rank r holds the logits of the whole global batch against its own classes, `[B, c_r]`.
//! For every sample i: the row maximum `m_i` over all ranks (a plain all_reduce Max of the
//! local maxima, detached: the loss does not depend on the shift), `S_i = Σ_r Σ_j
//! exp(z_ij − m_i)` and the target logit `T_i` (held by one rank, 0 on the others), both
//! through the DIFFERENTIABLE all_reduce Sum. The loss is the global-batch mean of
//! `log S_i + m_i − T_i`, the same number on every rank (a replicated loss): the sum rule
//! sends each rank `W · ∂L/∂z_r`, and the trainer's 1/W makes it the single-process gradient.

use allgrad_dist::{all_reduce, ProcessGroup, ReduceOp};
use candle_core::{Result, Tensor, D};

use crate::ModelError;

/// The mean over the global batch of the cross-entropy; `logits`: `[B, c_r]` this rank's
/// columns (at least one), `target`: `[B]` the target logit of each sample where this rank
/// holds its class and 0 elsewhere (a tensor on the graph of `logits`).
pub fn parallel_cross_entropy(logits: &Tensor, target: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    let (b, c) = logits.dims2()?;
    if c == 0 || target.dims() != [b] {
        return Err(ModelError::HeadInput(format!(
            "parallel_cross_entropy needs [B, c >= 1] logits and [B] targets, got {:?} and {:?}",
            logits.dims(),
            target.dims()
        ))
        .into());
    }
    let local_max = logits.max_keepdim(D::Minus1)?.detach();
    let max = pg.all_reduce(&local_max, ReduceOp::Max)?;
    let local_sum = logits.broadcast_sub(&max)?.exp()?.sum(D::Minus1)?;
    let sum = all_reduce(&local_sum, ReduceOp::Sum, pg)?;
    let target = all_reduce(target, ReduceOp::Sum, pg)?;
    ((sum.log()? + max.squeeze(D::Minus1)?)? - target)?.mean_all()
}
