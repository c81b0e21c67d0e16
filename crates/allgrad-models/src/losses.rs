//! Distributed contrastive losses, written with the differentiable collectives.

use allgrad_dist::{all_gather, all_reduce, ProcessGroup, ReduceOp};
use candle_core::{DType, Result, Tensor, D};
use serde::{Deserialize, Serialize};

use crate::error::fail;
use crate::ModelError;

/// The `loss` section of a run: which distributed loss compares the two views' embeddings.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum LossConfig {
    /// NT-Xent over global negatives ([`nt_xent`]; a local loss: each rank scores its own
    /// anchors). SimCLR's loss.
    NtXent {
        /// Softmax temperature.
        #[serde(default = "default_temperature")]
        temperature: f64,
    },
    /// Cross-correlation redundancy reduction ([`cross_correlation`]; a replicated loss: the
    /// same on every rank). BarlowTwins' loss.
    CrossCorrelation {
        /// Weight of the off-diagonal terms.
        #[serde(default = "default_lambda")]
        lambda: f64,
        /// Factor applied to the whole loss (1: none); a smaller scale acts like a smaller
        /// learning rate for optimizers that are not scale-invariant.
        #[serde(default = "one")]
        scale: f64,
    },
}

fn default_temperature() -> f64 {
    0.2
}
fn default_lambda() -> f64 {
    0.005
}
fn one() -> f64 {
    1.0
}

impl Default for LossConfig {
    fn default() -> Self {
        LossConfig::NtXent { temperature: default_temperature() }
    }
}

impl LossConfig {
    /// The loss of this rank's embeddings `z1`, `z2` (`[b, d]`, rows = samples). bf16
    /// embeddings (autocast) are cast to f32 first: the logits, the loss and what it
    /// communicates are f32.
    pub fn compute(&self, z1: &Tensor, z2: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
        let (z1, z2) = (&allgrad_nn::autocast::full(z1)?, &allgrad_nn::autocast::full(z2)?);
        match *self {
            LossConfig::NtXent { temperature } => nt_xent(z1, z2, temperature, pg),
            LossConfig::CrossCorrelation { lambda, scale } => cross_correlation(z1, z2, lambda, pg)? * scale,
        }
    }

    /// The `kind` tag (`nt_xent`, `cross_correlation`).
    pub fn kind(&self) -> &'static str {
        match self {
            LossConfig::NtXent { .. } => "nt_xent",
            LossConfig::CrossCorrelation { .. } => "cross_correlation",
        }
    }

    /// Checks the values; the error names the key.
    pub fn validate(&self) -> std::result::Result<(), ModelError> {
        let bad = |key, expected, value| Err(ModelError::LossValue { key, expected, value });
        match *self {
            LossConfig::NtXent { temperature } if !(temperature > 0.0 && temperature.is_finite()) => {
                bad("temperature", "positive", temperature)
            }
            LossConfig::CrossCorrelation { lambda, .. } if !(lambda >= 0.0 && lambda.is_finite()) => {
                bad("lambda", "non-negative", lambda)
            }
            LossConfig::CrossCorrelation { scale, .. } if !(scale > 0.0 && scale.is_finite()) => bad("scale", "positive", scale),
            _ => Ok(()),
        }
    }
}

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
        return fail(ModelError::ViewShapes { loss: "nt_xent", z1: z1.dims().to_vec(), z2: z2.dims().to_vec() });
    }
    if temperature.is_nan() || temperature <= 0.0 {
        return fail(ModelError::LossValue { key: "temperature", expected: "positive", value: temperature });
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

/// Each column of `z` (`[b, d]`, this rank's rows of a global batch of `n` rows) centred
/// and scaled to unit variance with the GLOBAL batch's mean and (biased) variance, as a
/// batch norm without affine parameters: the sums go through the differentiable all_reduce,
/// so gradients reach every rank's rows exactly as in one process.
pub fn standardise_global(z: &Tensor, n: f64, pg: &ProcessGroup) -> Result<Tensor> {
    let mean = (all_reduce(&z.sum_keepdim(0)?, ReduceOp::Sum, pg)? / n)?;
    let centred = z.broadcast_sub(&mean)?;
    let var = (all_reduce(&centred.sqr()?.sum_keepdim(0)?, ReduceOp::Sum, pg)? / n)?;
    centred.broadcast_div(&(var + 1e-5)?.sqrt()?)
}

/// The redundancy-reduction loss of a `[d, d]` cross-correlation matrix:
/// `Σ_i (1 - c_ii)^2 + λ Σ_{i≠j} c_ij^2`.
pub fn redundancy_reduction(c: &Tensor, lambda: f64) -> Result<Tensor> {
    let d = c.dim(0)?;
    if c.dims() != [d, d] {
        return fail(ModelError::NotSquare { shape: c.dims().to_vec() });
    }
    let eye = Tensor::eye(d, DType::F32, c.device())?.to_dtype(c.dtype())?;
    let diag = (c * &eye)?.sum(1)?;
    let on_diag = (1.0 - diag.clone())?.sqr()?.sum_all()?;
    let off_diag = (c.sqr()?.sum_all()? - diag.sqr()?.sum_all()?)?;
    on_diag + (off_diag * lambda)?
}

/// Rows in the global batch: this rank's `b` summed over the group.
pub fn global_rows(b: usize, pg: &ProcessGroup) -> Result<usize> {
    let mut n = [b as i64];
    pg.all_reduce_slice(&mut n, ReduceOp::Sum)?;
    Ok(n[0] as usize)
}

/// The cross-correlation (redundancy reduction) loss over the GLOBAL batch: each view's
/// embeddings are standardised per dimension with global batch statistics (sums through the
/// differentiable all_reduce), `c = z1n^T z2n / N` is summed across ranks the same way, and
/// `loss = Σ_i (1 - c_ii)^2 + λ Σ_{i≠j} c_ij^2`. Every rank computes the same (replicated)
/// loss.
///
/// The sum of `c` over ranks must be differentiable: a raw all_reduce (identity backward)
/// leaves each rank only its own rows' share of `dL/dc`, so after the data-parallel average
/// every gradient is 1/W of the truth (a test in `tests/losses.rs` shows it). LARS rescales
/// each weight matrix's update and hides that for weights; biases and batch-norm parameters,
/// excluded from LARS, then learn W times too slowly.
pub fn cross_correlation(z1: &Tensor, z2: &Tensor, lambda: f64, pg: &ProcessGroup) -> Result<Tensor> {
    if z1.dims() != z2.dims() || z1.rank() != 2 {
        return fail(ModelError::ViewShapes { loss: "cross_correlation", z1: z1.dims().to_vec(), z2: z2.dims().to_vec() });
    }
    let rows = global_rows(z1.dim(0)?, pg)?;
    if rows < 2 {
        return fail(ModelError::GlobalBatchTooSmall { rows });
    }
    let n = rows as f64;
    let z1n = standardise_global(z1, n, pg)?;
    let z2n = standardise_global(z2, n, pg)?;
    let c = (all_reduce(&z1n.t()?.matmul(&z2n)?, ReduceOp::Sum, pg)? / n)?; // [d, d]
    redundancy_reduction(&c, lambda)
}
