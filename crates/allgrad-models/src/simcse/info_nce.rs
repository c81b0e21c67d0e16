//! SimCSE's InfoNCE over the global batch, in the local-loss form.
//!
//! Each rank scores its own anchors against the candidates of EVERY rank, gathered with the
//! differentiable `all_gather` (its backward sends each rank the gradient of all ranks'
//! losses with respect to its rows: the sum rule). Logits per rank are `b x B` (or `b x 2B`
//! with hard negatives), so memory per rank falls with W. With the trainer's 1/W scaling and
//! summation of replicated gradients, W ranks train exactly like one process on the global
//! batch.
//!
//! The alternative found in public SimCSE code gathers without a backward, puts the local
//! tensor back into its slot and computes the loss of the whole global batch on every rank:
//! after the data-parallel average, every gradient is 1/W of the truth (shown by a test in
//! `tests/models/simcse_info_nce.rs`).

use allgrad_dist::{all_gather, ProcessGroup};
use candle_core::{Result, Tensor};

use crate::losses::{l2_normalize, logsumexp, placement, Temperature};
use crate::tiled::{scaled_dot_cross_entropy_with, KeyQueue, Pairs};

fn check(name: &str, a: &Tensor, other: &Tensor, temperature: &Temperature) -> Result<()> {
    if a.rank() != 2 || a.dims() != other.dims() {
        candle_core::bail!("info_nce: anchors {:?} and {name} {:?} must be [b, d] of the same shape", a.dims(), other.dims());
    }
    temperature.check()
}

/// Unsupervised SimCSE loss: anchor `i` (`anchors[i]`, view 0 of local sample i) against the
/// second views of the global batch; its positive is global row `offset_r + i`. Cosine
/// similarities divided by `temperature` (0.05 in the paper; an `f64` or a learned scalar
/// tensor, [`Temperature`]).
///
/// Returns `(W / B) Σ_{i local} ℓ_i`, so that the mean over ranks is the global mean
/// `(1/B) Σ_i ℓ_i` also when ranks hold different numbers of rows.
pub fn info_nce(anchors: &Tensor, positives: &Tensor, temperature: impl Into<Temperature>, pg: &ProcessGroup) -> Result<Tensor> {
    let temperature = temperature.into();
    check("positives", anchors, positives, &temperature)?;
    let (offset, total) = placement(anchors.dim(0)?, pg)?;
    let candidates = all_gather(&l2_normalize(positives)?, pg)?; // [B, d]
    let logits = temperature.divide(&l2_normalize(anchors)?.matmul(&candidates.t()?)?)?; // [b, B]
    cross_entropy_at(&logits, offset, total, pg.world_size())
}

/// Supervised SimCSE loss: anchors against the positives AND the hard negatives of the
/// global batch (`b x 2B` logits); anchor `i`'s positive is column `offset_r + i`, and
/// `hard_negative_weight` is added to the logit of its own hard negative (column
/// `B + offset_r + i`), as in the paper's code (0: no reweighting). Scaled as [`info_nce`].
pub fn info_nce_hard_negatives(
    anchors: &Tensor,
    positives: &Tensor,
    hard_negatives: &Tensor,
    temperature: impl Into<Temperature>,
    hard_negative_weight: f64,
    pg: &ProcessGroup,
) -> Result<Tensor> {
    let temperature = temperature.into();
    check("positives", anchors, positives, &temperature)?;
    check("hard negatives", anchors, hard_negatives, &temperature)?;
    if !hard_negative_weight.is_finite() {
        candle_core::bail!("info_nce: hard_negative_weight must be finite, got {hard_negative_weight}");
    }
    let b = anchors.dim(0)?;
    let (offset, total) = placement(b, pg)?;
    let pos = all_gather(&l2_normalize(positives)?, pg)?;
    let neg = all_gather(&l2_normalize(hard_negatives)?, pg)?;
    let candidates = Tensor::cat(&[&pos, &neg], 0)?; // [2B, d]
    let mut logits = temperature.divide(&l2_normalize(anchors)?.matmul(&candidates.t()?)?)?; // [b, 2B]
    if hard_negative_weight != 0.0 {
        // The weight at column `total + offset + i` of row i, made on the device from kept
        // numbers (no upload).
        let n = allgrad_nn::transfer::numbers(2 * total, logits.device())?;
        let own = n.narrow(0, total + offset, b)?.reshape((b, 1))?;
        let hit = own.broadcast_eq(&n.reshape((1, 2 * total))?)?.to_dtype(logits.dtype())?;
        logits = (logits + hit.affine(hard_negative_weight, 0.0)?)?;
    }
    cross_entropy_at(&logits, offset, total, pg.world_size())
}

/// [`info_nce`] computed in `tile x tile` blocks of logits ([`crate::tiled`]): the same loss and
/// gradients (to rounding), never holding the `b x B` logits. The positives are gathered whole
/// with the differentiable all_gather, as in [`info_nce`].
pub fn info_nce_tiled(
    anchors: &Tensor,
    positives: &Tensor,
    temperature: impl Into<Temperature>,
    tile: usize,
    pg: &ProcessGroup,
) -> Result<Tensor> {
    tiled_impl(anchors, positives, None, &temperature.into(), 0.0, tile, None, pg)
}

/// [`info_nce_hard_negatives`] computed in `tile x tile` blocks of logits ([`crate::tiled`]):
/// the same loss and gradients (to rounding), never holding the `b x 2B` logits.
pub fn info_nce_hard_negatives_tiled(
    anchors: &Tensor,
    positives: &Tensor,
    hard_negatives: &Tensor,
    temperature: impl Into<Temperature>,
    hard_negative_weight: f64,
    tile: usize,
    pg: &ProcessGroup,
) -> Result<Tensor> {
    tiled_impl(anchors, positives, Some(hard_negatives), &temperature.into(), hard_negative_weight, tile, None, pg)
}

/// [`info_nce_tiled`] (with `hard_negatives`: [`info_nce_hard_negatives_tiled`]) with the keys
/// of past global batches as more negatives: every anchor is also scored against `queue`'s keys
/// (no gradient), then this batch's normalised candidates (positives, and hard negatives when
/// given; the same on every rank) are pushed into the queue.
#[allow(clippy::too_many_arguments)]
pub fn info_nce_tiled_queued(
    anchors: &Tensor,
    positives: &Tensor,
    hard_negatives: Option<&Tensor>,
    temperature: impl Into<Temperature>,
    hard_negative_weight: f64,
    tile: usize,
    queue: &mut KeyQueue,
    pg: &ProcessGroup,
) -> Result<Tensor> {
    tiled_impl(anchors, positives, hard_negatives, &temperature.into(), hard_negative_weight, tile, Some(queue), pg)
}

#[allow(clippy::too_many_arguments)]
fn tiled_impl(
    anchors: &Tensor,
    positives: &Tensor,
    hard_negatives: Option<&Tensor>,
    temperature: &Temperature,
    hard_negative_weight: f64,
    tile: usize,
    queue: Option<&mut KeyQueue>,
    pg: &ProcessGroup,
) -> Result<Tensor> {
    check("positives", anchors, positives, temperature)?;
    if let Some(n) = hard_negatives {
        check("hard negatives", anchors, n, temperature)?;
    }
    if !hard_negative_weight.is_finite() {
        candle_core::bail!("info_nce: hard_negative_weight must be finite, got {hard_negative_weight}");
    }
    let b = anchors.dim(0)?;
    let (offset, total) = placement(b, pg)?;
    let mut candidates = all_gather(&l2_normalize(positives)?, pg)?; // [B, d]
    let mut boost = None;
    if let Some(n) = hard_negatives {
        candidates = Tensor::cat(&[&candidates, &all_gather(&l2_normalize(n)?, pg)?], 0)?; // [2B, d]
        if hard_negative_weight != 0.0 {
            boost = Some(((0..b).map(|i| total + offset + i).collect(), hard_negative_weight));
        }
    }
    let pairs = Pairs { target: Some((0..b).map(|i| offset + i).collect()), exclude: None, boost };
    let extra = match &queue {
        Some(q) => q.keys()?,
        None => None,
    };
    let sum = scaled_dot_cross_entropy_with(&l2_normalize(anchors)?, &candidates, extra.as_ref(), temperature, pairs, tile)?;
    if let Some(q) = queue {
        q.push(&candidates)?;
    }
    sum * (pg.world_size() as f64 / total as f64)
}

/// `(W / B) Σ_i (logsumexp(logits_i) - logits_{i, offset + i})`.
fn cross_entropy_at(logits: &Tensor, offset: usize, total: usize, world: usize) -> Result<Tensor> {
    let b = logits.dim(0)?;
    // The columns `offset..offset + b`, a view of numbers kept on the device (no upload).
    let idx = allgrad_nn::transfer::numbers(offset + b, logits.device())?.narrow(0, offset, b)?.reshape((b, 1))?;
    let pos = logits.gather(&idx, 1)?.squeeze(1)?;
    (logsumexp(logits)? - pos)?.sum_all()? * (world as f64 / total as f64)
}
