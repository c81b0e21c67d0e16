//! Distributed contrastive losses, written with the differentiable collectives.

use allgrad_dist::{all_gather, all_reduce, ProcessGroup, ReduceOp};
use candle_core::{DType, Device, Result, Tensor, D};
use serde::{Deserialize, Serialize};

use crate::error::fail;
use crate::tiled::{scaled_dot_cross_entropy_with, KeyQueue, Pairs, Tiling};
use crate::ModelError;

pub use crate::temperature::Temperature;
pub use crate::tiled::TILED_LOSSES;

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
        /// Compute the loss in blocks of `tile x tile` logits ([`nt_xent_tiled`]; [`Tiling`]).
        /// Absent: the whole `2b x 2B` logits at once ([`nt_xent`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tile: Option<usize>,
        /// Also score every anchor against the candidates (both views) of the last `queue`
        /// global batches ([`nt_xent_tiled_queued`]; [`Tiling`]). Needs `tile`. Absent: none.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        queue: Option<usize>,
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
        /// Not available: this loss has no pairwise logits to tile (its largest intermediate is
        /// the `d x d` cross-correlation); the key is read only to refuse it with that reason.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tile: Option<usize>,
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
        LossConfig::NtXent { temperature: default_temperature(), tile: None, queue: None }
    }
}

impl LossConfig {
    /// The loss of this rank's embeddings `z1`, `z2` (`[b, d]`, rows = samples). A config with
    /// `queue` needs the queue: [`LossConfig::compute_queued`].
    pub fn compute(&self, z1: &Tensor, z2: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
        self.compute_queued(z1, z2, None, pg)
    }

    /// [`LossConfig::compute`] with the queue of past batches' keys ([`LossConfig::new_queue`]),
    /// which it reads and then updates; `None` exactly when the config has no `queue`.
    /// bf16 embeddings (autocast) are cast to f32 first: the logits, the loss and what it
    /// communicates are f32.
    pub fn compute_queued(&self, z1: &Tensor, z2: &Tensor, queue: Option<&mut KeyQueue>, pg: &ProcessGroup) -> Result<Tensor> {
        let (z1, z2) = (&allgrad_nn::autocast::full(z1)?, &allgrad_nn::autocast::full(z2)?);
        match (self, queue) {
            (&LossConfig::NtXent { temperature, tile: None, queue: None }, None) => nt_xent(z1, z2, temperature, pg),
            (&LossConfig::NtXent { temperature, tile: Some(tile), queue: None }, None) => nt_xent_tiled(z1, z2, temperature, tile, pg),
            (&LossConfig::NtXent { temperature, tile: Some(tile), queue: Some(_) }, Some(q)) => {
                nt_xent_tiled_queued(z1, z2, temperature, tile, q, pg)
            }
            (LossConfig::CrossCorrelation { tile: Some(_), .. }, _) => fail(Self::no_tiled_form()),
            (&LossConfig::CrossCorrelation { lambda, scale, tile: None }, None) => cross_correlation(z1, z2, lambda, pg)? * scale,
            (cfg, q) => fail(ModelError::LossKey {
                key: "queue",
                msg: format!(
                    "loss: a queue of past keys must be given exactly when the config has loss.queue (config {cfg:?}, queue given: {})",
                    q.is_some()
                ),
            }),
        }
    }

    /// The queue of past batches' keys that `loss.queue` asks for (`None` without it), from
    /// the checked [`LossConfig::tiling`].
    pub fn new_queue(&self) -> Result<Option<KeyQueue>> {
        self.tiling()?.new_queue()
    }

    /// `loss.tile` and `loss.queue`, checked ([`Tiling::new`]); the cross-correlation, which
    /// has no tiled form, refuses `tile`. The error names the key.
    pub fn tiling(&self) -> std::result::Result<Tiling, ModelError> {
        match *self {
            LossConfig::NtXent { tile, queue, .. } => Tiling::new(tile, queue),
            LossConfig::CrossCorrelation { tile: Some(_), .. } => Err(Self::no_tiled_form()),
            LossConfig::CrossCorrelation { tile: None, .. } => Ok(Tiling::UNTILED),
        }
    }

    /// The `kind` tag (`nt_xent`, `cross_correlation`).
    pub fn kind(&self) -> &'static str {
        match self {
            LossConfig::NtXent { .. } => "nt_xent",
            LossConfig::CrossCorrelation { .. } => "cross_correlation",
        }
    }

    /// `loss.tile`, when set.
    pub fn tile(&self) -> Option<usize> {
        match *self {
            LossConfig::NtXent { tile, .. } | LossConfig::CrossCorrelation { tile, .. } => tile,
        }
    }

    fn no_tiled_form() -> ModelError {
        ModelError::LossKey {
            key: "tile",
            msg: format!(
                "the cross_correlation loss has no tiled form: it holds no pairwise logits, its largest intermediate is the \
                 d x d cross-correlation, whatever the batch (remove loss.tile). Losses with a tiled form: {TILED_LOSSES}"
            ),
        }
    }

    /// Checks the values, the tiling last ([`LossConfig::tiling`]; a cross-correlation's
    /// `tile` first: it is refused whatever the values); the error names the key.
    pub fn validate(&self) -> std::result::Result<(), ModelError> {
        let bad = |key, expected, value| Err(ModelError::LossValue { key, expected, value });
        match *self {
            LossConfig::NtXent { temperature, .. } if !(temperature > 0.0 && temperature.is_finite()) => {
                bad("temperature", "positive", temperature)
            }
            LossConfig::CrossCorrelation { lambda, tile: None, .. } if !(lambda >= 0.0 && lambda.is_finite()) => {
                bad("lambda", "non-negative", lambda)
            }
            LossConfig::CrossCorrelation { scale, tile: None, .. } if !(scale > 0.0 && scale.is_finite()) => {
                bad("scale", "positive", scale)
            }
            _ => self.tiling().map(drop),
        }
    }
}

/// Rows scaled to unit L2 norm (differentiable; `eps` guards zero rows).
pub fn l2_normalize(x: &Tensor) -> Result<Tensor> {
    let norm = x.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?;
    let norm = norm.broadcast_maximum(&allgrad_nn::transfer::constant(&norm, 1e-12)?)?;
    x.broadcast_div(&norm)
}

/// log Σ_j exp(x_ij) over the last dim, stable (the shift is detached: it cancels exactly).
pub fn logsumexp(x: &Tensor) -> Result<Tensor> {
    let m = x.max_keepdim(D::Minus1)?.detach();
    (x.broadcast_sub(&m)?.exp()?.sum_keepdim(D::Minus1)?.log()? + m)?.squeeze(D::Minus1)
}

/// Where this rank's `b` rows sit in the global batch: (offset, global rows). One collective.
pub(crate) fn placement(b: usize, pg: &ProcessGroup) -> Result<(usize, usize)> {
    let sizes = pg.all_gather_slice(&[b as i64])?;
    let offset: usize = sizes[..pg.rank()].iter().map(|s| *s as usize).sum();
    let total: usize = sizes.iter().map(|s| *s as usize).sum();
    Ok((offset, total))
}

fn check_views(loss: &'static str, z1: &Tensor, z2: &Tensor, temperature: &Temperature) -> Result<()> {
    if z1.dims() != z2.dims() || z1.rank() != 2 {
        return fail(ModelError::ViewShapes { loss, z1: z1.dims().to_vec(), z2: z2.dims().to_vec() });
    }
    temperature.check()
}

/// NT-Xent's pairing of this rank's `2b` anchors (view 1 of its samples, then view 2) with the
/// `2B` gathered candidates (view 1 of every rank's samples, then view 2): anchor `a`'s own
/// column and its positive (the other view of the same sample).
fn nt_xent_columns(b: usize, offset: usize, total: usize) -> (impl Fn(usize) -> usize, impl Fn(usize) -> usize) {
    let me = move |a: usize| if a < b { offset + a } else { total + offset + a - b };
    let positive = move |a: usize| if a < b { total + offset + a } else { offset + a - b };
    (me, positive)
}

/// NT-Xent's per-shape constants on `device`: the `[2b, 2B]` mask (−∞ on each anchor's own
/// column, 0 elsewhere, in `dtype`) and the `[2b, 1]` column of each anchor's positive. Built
/// and uploaded once per (b, offset, B, dtype, device) and kept (the last few shapes): a step
/// uploads nothing for them (at batch 1024 the mask is 16 MiB).
fn nt_xent_constants(b: usize, offset: usize, total: usize, dtype: DType, device: &Device) -> Result<(Tensor, Tensor)> {
    type Entry = ((usize, usize, usize, DType), Device, (Tensor, Tensor));
    static CACHE: std::sync::Mutex<Vec<Entry>> = std::sync::Mutex::new(Vec::new());
    const KEPT: usize = 16;
    let key = (b, offset, total, dtype);
    let mut cache = CACHE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, _, t)) = cache.iter().find(|(k, d, _)| *k == key && d.same_device(device)) {
        return Ok(t.clone());
    }
    // Anchor i (view 1) is column offset+i; anchor b+i (view 2) is column B+offset+i.
    let (me, positive) = nt_xent_columns(b, offset, total);
    let mut mask = vec![0f32; 2 * b * 2 * total];
    for a in 0..2 * b {
        mask[a * 2 * total + me(a)] = f32::NEG_INFINITY;
    }
    let mask = allgrad_nn::transfer::upload(mask, (2 * b, 2 * total), device)?.to_dtype(dtype)?;
    let pos_idx: Vec<u32> = (0..2 * b).map(|a| positive(a) as u32).collect();
    let pos_idx = allgrad_nn::transfer::upload(pos_idx, (2 * b, 1), device)?;
    if cache.len() >= KEPT {
        cache.remove(0);
    }
    cache.push((key, device.clone(), (mask.clone(), pos_idx.clone())));
    Ok((mask, pos_idx))
}

/// NT-Xent (normalised temperature-scaled cross entropy) over the GLOBAL batch, in the
/// local-loss form: this rank's 2b anchors (both views of its b samples) are scored against
/// all 2B candidates of every rank, so the logits are (2b x 2B) and memory per rank falls
/// with W. Each anchor's positive is the other view of the same sample; its own embedding
/// is masked out. Returns `(W / 2B) Σ_{local anchors} ℓ_a`: the mean over this rank's anchors
/// when every rank holds b = B / W samples, and in any case a value whose mean over ranks is
/// the single-process loss on the global batch (uneven shards too).
///
/// `z1`, `z2`: `[b, d]` embeddings of the two views (normalised here). `temperature`: an
/// `f64`, or a learned scalar tensor ([`Temperature`]).
pub fn nt_xent(z1: &Tensor, z2: &Tensor, temperature: impl Into<Temperature>, pg: &ProcessGroup) -> Result<Tensor> {
    let temperature = temperature.into();
    check_views("nt_xent", z1, z2, &temperature)?;
    let b = z1.dim(0)?;
    let z1 = l2_normalize(z1)?;
    let z2 = l2_normalize(z2)?;
    // Where this rank's samples sit in the global batch.
    let (offset, total) = placement(b, pg)?;
    let g1 = all_gather(&z1, pg)?;
    let g2 = all_gather(&z2, pg)?;
    let candidates = Tensor::cat(&[&g1, &g2], 0)?; // [2B, d]
    let anchors = Tensor::cat(&[&z1, &z2], 0)?; // [2b, d]
    let logits = temperature.divide(&anchors.matmul(&candidates.t()?)?)?; // [2b, 2B]

    let (mask, pos_idx) = nt_xent_constants(b, offset, total, logits.dtype(), logits.device())?;
    let pos = logits.gather(&pos_idx, 1)?.squeeze(1)?;
    let lse = logsumexp(&(logits + mask)?)?;
    (lse - pos)?.sum_all()? * (pg.world_size() as f64 / (2 * total) as f64)
}

/// [`nt_xent`] computed in `tile x tile` blocks of logits ([`crate::tiled`]): the same loss and
/// gradients (to rounding), with memory per rank for the loss linear in the batch (the
/// embeddings) plus a few blocks, never the `2b x 2B` logits. The candidates are gathered whole
/// with the differentiable all_gather, as in [`nt_xent`].
pub fn nt_xent_tiled(
    z1: &Tensor,
    z2: &Tensor,
    temperature: impl Into<Temperature>,
    tile: usize,
    pg: &ProcessGroup,
) -> Result<Tensor> {
    nt_xent_tiled_impl(z1, z2, &temperature.into(), tile, None, pg)
}

/// [`nt_xent_tiled`] with the keys of past global batches as more negatives: every anchor is
/// also scored against `queue`'s keys (no gradient reaches them), then this batch's `2B`
/// normalised candidates (the same on every rank) are pushed into the queue.
pub fn nt_xent_tiled_queued(
    z1: &Tensor,
    z2: &Tensor,
    temperature: impl Into<Temperature>,
    tile: usize,
    queue: &mut KeyQueue,
    pg: &ProcessGroup,
) -> Result<Tensor> {
    nt_xent_tiled_impl(z1, z2, &temperature.into(), tile, Some(queue), pg)
}

fn nt_xent_tiled_impl(
    z1: &Tensor,
    z2: &Tensor,
    temperature: &Temperature,
    tile: usize,
    queue: Option<&mut KeyQueue>,
    pg: &ProcessGroup,
) -> Result<Tensor> {
    check_views("nt_xent", z1, z2, temperature)?;
    let b = z1.dim(0)?;
    let z1 = l2_normalize(z1)?;
    let z2 = l2_normalize(z2)?;
    let (offset, total) = placement(b, pg)?;
    let candidates = Tensor::cat(&[&all_gather(&z1, pg)?, &all_gather(&z2, pg)?], 0)?; // [2B, d]
    let anchors = Tensor::cat(&[&z1, &z2], 0)?; // [2b, d]
    let (me, positive) = nt_xent_columns(b, offset, total);
    let pairs =
        Pairs { target: Some((0..2 * b).map(&positive).collect()), exclude: Some((0..2 * b).map(&me).collect()), boost: None };
    let extra = match &queue {
        Some(q) => q.keys()?,
        None => None,
    };
    let sum = scaled_dot_cross_entropy_with(&anchors, &candidates, extra.as_ref(), temperature, pairs, tile)?;
    if let Some(q) = queue {
        q.push(&candidates)?;
    }
    sum * (pg.world_size() as f64 / (2 * total) as f64)
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
/// every gradient is 1/W of the truth (a test in `tests/models/losses.rs` shows it). LARS rescales
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
