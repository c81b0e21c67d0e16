//! Distributed contrastive losses, written with the differentiable collectives.

use allgrad_dist::{all_gather, all_reduce, ProcessGroup, ReduceOp};
use candle_core::{DType, Result, Tensor, D};

/// Rows scaled to unit L2 norm (differentiable; `eps` guards zero rows).
pub fn l2_normalize(x: &Tensor) -> Result<Tensor> {
    let norm = x.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?.maximum(1e-12)?;
    x.broadcast_div(&norm)
}

/// log Σ_j exp(x_ij) over the last dim, stable (the shift is detached: it cancels exactly).
pub fn logsumexp(x: &Tensor) -> Result<Tensor> {
    let m = x.max_keepdim(D::Minus1)?.detach();
    (x.broadcast_sub(&m)?.exp()?.sum_keepdim(D::Minus1)?.log()? + m)?.squeeze(D::Minus1)
}

/// NT-Xent (normalised temperature-scaled cross entropy) over the GLOBAL batch, in the
/// local-loss form: this rank's 2b anchors (both views of its b samples) are scored against
/// all 2B candidates of every rank, so the logits are (2b x 2B) and memory per rank falls
/// with W. Each anchor's positive is the other view of the same sample; its own embedding
/// is masked out. Returns the mean over this rank's anchors; the mean over ranks of that is
/// the single-process loss on the global batch.
///
/// `z1`, `z2`: `[b, d]` embeddings of the two views (normalised here).
pub fn nt_xent(z1: &Tensor, z2: &Tensor, temperature: f64, pg: &ProcessGroup) -> Result<Tensor> {
    if z1.dims() != z2.dims() || z1.rank() != 2 {
        candle_core::bail!("nt_xent: the two views must be [b, d] of the same shape, got {:?} and {:?}", z1.dims(), z2.dims());
    }
    if !(temperature > 0.0) {
        candle_core::bail!("nt_xent: temperature must be positive, got {temperature}");
    }
    let b = z1.dim(0)?;
    let z1 = l2_normalize(z1)?;
    let z2 = l2_normalize(z2)?;
    // Where this rank's samples sit in the global batch.
    let sizes = pg.all_gather_slice(&[b as i64])?;
    let offset: usize = sizes[..pg.rank()].iter().map(|s| *s as usize).sum();
    let total: usize = sizes.iter().map(|s| *s as usize).sum();
    let g1 = all_gather(&z1, pg)?;
    let g2 = all_gather(&z2, pg)?;
    let candidates = Tensor::cat(&[&g1, &g2], 0)?; // [2B, d]
    let anchors = Tensor::cat(&[&z1, &z2], 0)?; // [2b, d]
    let logits = (anchors.matmul(&candidates.t()?)? / temperature)?; // [2b, 2B]

    // Anchor i (view 1) is column offset+i; anchor b+i (view 2) is column B+offset+i.
    let me = |a: usize| if a < b { offset + a } else { total + offset + a - b };
    let positive = |a: usize| if a < b { total + offset + a } else { offset + a - b };
    let mut mask = vec![0f32; 2 * b * 2 * total];
    for a in 0..2 * b {
        mask[a * 2 * total + me(a)] = f32::NEG_INFINITY;
    }
    let mask = Tensor::from_vec(mask, (2 * b, 2 * total), logits.device())?.to_dtype(logits.dtype())?;
    let pos_idx: Vec<u32> = (0..2 * b).map(|a| positive(a) as u32).collect();
    let pos_idx = Tensor::from_vec(pos_idx, (2 * b, 1), logits.device())?;
    let pos = logits.gather(&pos_idx, 1)?.squeeze(1)?;
    let lse = logsumexp(&(logits + mask)?)?;
    (lse - pos)?.mean_all()
}

/// The cross-correlation (redundancy reduction) loss over the GLOBAL batch: each view's
/// embeddings are standardised per dimension with global batch statistics (sums through the
/// differentiable all_reduce), `c = z1n^T z2n / N` is summed across ranks the same way, and
/// `loss = Σ_i (1 - c_ii)^2 + λ Σ_{i≠j} c_ij^2`. Every rank computes the same (replicated)
/// loss.
pub fn cross_correlation(z1: &Tensor, z2: &Tensor, lambda: f64, pg: &ProcessGroup) -> Result<Tensor> {
    if z1.dims() != z2.dims() || z1.rank() != 2 {
        candle_core::bail!(
            "cross_correlation: the two views must be [b, d] of the same shape, got {:?} and {:?}",
            z1.dims(),
            z2.dims()
        );
    }
    let d = z1.dim(1)?;
    let n_local = [z1.dim(0)? as i64];
    let mut n = n_local;
    pg.all_reduce_slice(&mut n, ReduceOp::Sum)?;
    let n = n[0] as f64;
    if n < 2.0 {
        candle_core::bail!("cross_correlation: the global batch needs at least 2 samples, got {n}");
    }
    let standardise = |z: &Tensor| -> Result<Tensor> {
        let mean = (all_reduce(&z.sum_keepdim(0)?, ReduceOp::Sum, pg)? / n)?;
        let centred = z.broadcast_sub(&mean)?;
        let var = (all_reduce(&centred.sqr()?.sum_keepdim(0)?, ReduceOp::Sum, pg)? / n)?;
        centred.broadcast_div(&(var + 1e-5)?.sqrt()?)
    };
    let z1n = standardise(z1)?;
    let z2n = standardise(z2)?;
    let c = (all_reduce(&z1n.t()?.matmul(&z2n)?, ReduceOp::Sum, pg)? / n)?; // [d, d]
    let eye = Tensor::eye(d, DType::F32, z1.device())?.to_dtype(c.dtype())?;
    let diag = (&c * &eye)?.sum(1)?;
    let on_diag = (1.0 - diag.clone())?.sqr()?.sum_all()?;
    let off_diag = (c.sqr()?.sum_all()? - diag.sqr()?.sum_all()?)?;
    on_diag + (off_diag * lambda)?
}
