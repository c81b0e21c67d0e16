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
//! `tests/simcse_info_nce.rs`).

use allgrad_dist::{all_gather, ProcessGroup};
use candle_core::{Result, Tensor};

use crate::losses::{global_rows, l2_normalize, logsumexp};

/// Where this rank's rows sit in the global batch: (offset, global rows).
fn placement(b: usize, pg: &ProcessGroup) -> Result<(usize, usize)> {
    let sizes = pg.all_gather_slice(&[b as i64])?;
    let offset: usize = sizes[..pg.rank()].iter().map(|s| *s as usize).sum();
    Ok((offset, global_rows(b, pg)?))
}

fn check(name: &str, a: &Tensor, other: &Tensor, temperature: f64) -> Result<()> {
    if a.rank() != 2 || a.dims() != other.dims() {
        candle_core::bail!("info_nce: anchors {:?} and {name} {:?} must be [b, d] of the same shape", a.dims(), other.dims());
    }
    if !(temperature > 0.0 && temperature.is_finite()) {
        candle_core::bail!("info_nce: temperature must be positive, got {temperature}");
    }
    Ok(())
}

/// Unsupervised SimCSE loss: anchor `i` (`anchors[i]`, view 0 of local sample i) against the
/// second views of the global batch; its positive is global row `offset_r + i`. Cosine
/// similarities divided by `temperature` (0.05 in the paper).
///
/// Returns `(W / B) Σ_{i local} ℓ_i`, so that the mean over ranks is the global mean
/// `(1/B) Σ_i ℓ_i` also when ranks hold different numbers of rows.
pub fn info_nce(anchors: &Tensor, positives: &Tensor, temperature: f64, pg: &ProcessGroup) -> Result<Tensor> {
    check("positives", anchors, positives, temperature)?;
    let (offset, total) = placement(anchors.dim(0)?, pg)?;
    let candidates = all_gather(&l2_normalize(positives)?, pg)?; // [B, d]
    let logits = (l2_normalize(anchors)?.matmul(&candidates.t()?)? / temperature)?; // [b, B]
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
    temperature: f64,
    hard_negative_weight: f64,
    pg: &ProcessGroup,
) -> Result<Tensor> {
    check("positives", anchors, positives, temperature)?;
    check("hard negatives", anchors, hard_negatives, temperature)?;
    if !hard_negative_weight.is_finite() {
        candle_core::bail!("info_nce: hard_negative_weight must be finite, got {hard_negative_weight}");
    }
    let b = anchors.dim(0)?;
    let (offset, total) = placement(b, pg)?;
    let pos = all_gather(&l2_normalize(positives)?, pg)?;
    let neg = all_gather(&l2_normalize(hard_negatives)?, pg)?;
    let candidates = Tensor::cat(&[&pos, &neg], 0)?; // [2B, d]
    let mut logits = (l2_normalize(anchors)?.matmul(&candidates.t()?)? / temperature)?; // [b, 2B]
    if hard_negative_weight != 0.0 {
        let mut w = vec![0f64; b * 2 * total];
        for i in 0..b {
            w[i * 2 * total + total + offset + i] = hard_negative_weight;
        }
        let w = Tensor::from_vec(w, (b, 2 * total), logits.device())?.to_dtype(logits.dtype())?;
        logits = (logits + w)?;
    }
    cross_entropy_at(&logits, offset, total, pg.world_size())
}

/// `(W / B) Σ_i (logsumexp(logits_i) - logits_{i, offset + i})`.
fn cross_entropy_at(logits: &Tensor, offset: usize, total: usize, world: usize) -> Result<Tensor> {
    let b = logits.dim(0)?;
    let idx: Vec<u32> = (0..b).map(|i| (offset + i) as u32).collect();
    let idx = Tensor::from_vec(idx, (b, 1), logits.device())?;
    let pos = logits.gather(&idx, 1)?.squeeze(1)?;
    (logsumexp(logits)? - pos)?.sum_all()? * (world as f64 / total as f64)
}
