//! Dropout with masks drawn from keyed random streams (ARCHITECTURE.md, "Why W ranks equal one").
//!
//! A mask entry depends only on `(seed, step, global sample index, view, layer, site,
//! position)` and the entry's place within that position, never on the rank, the sample's
//! place in the local batch or the padded length of the batch, so a run on W ranks draws
//! exactly the masks of a run on one rank over the same global batch. (Padding only appends
//! positions, and each position has its own stream; within the attention probabilities of
//! one query position, values are drawn key position by key position, so the entries of real
//! keys do not move when padded keys are added after them.)

use candle_core::{DType, Device, Result, Shape, Tensor, WithDType};
use rayon::prelude::*;

use crate::rng::stream;

/// Where in the network a dropout mask is applied (one word of the stream key).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Site {
    /// After the embedding LayerNorm.
    Embeddings = 1,
    /// On the attention probabilities.
    AttentionProbs = 2,
    /// On the attention output projection, before the residual.
    AttentionOutput = 3,
    /// On the feed-forward output, before the residual.
    FeedForward = 4,
}

/// The key of one forward pass's dropout masks: run seed, optimizer step, and for each row
/// of the batch its global sample index and view (SimCSE encodes every sentence twice, as
/// views 0 and 1, in one batch).
#[derive(Clone, Debug)]
pub struct DropoutKey {
    /// The run's seed.
    pub seed: u64,
    /// Optimizer step.
    pub step: u64,
    /// `(global sample index, view)` of each batch row.
    pub rows: Vec<(u64, u64)>,
}

/// Bernoulli keep/drop from one `u64` of the stream (`unit < p` drops), scaled by `1/(1-p)`.
fn draw(rng: &mut crate::rng::KeyedRng, p: f64, scale: f64) -> f64 {
    if allgrad_rng::unit(rng) < p {
        0.0
    } else {
        scale
    }
}

/// `x` in `residual`'s dtype when it is bf16 beside an f32 residual (a dense layer's output
/// under autocast), otherwise `x`: PyTorch's type promotion of their sum, which keeps BERT's
/// residual stream f32.
pub(crate) fn promote_to(x: &Tensor, residual: &Tensor) -> Result<Tensor> {
    if x.dtype() == DType::BF16 && residual.dtype() == DType::F32 {
        x.to_dtype(DType::F32)
    } else {
        Ok(x.clone())
    }
}

impl DropoutKey {
    fn stream(&self, row: usize, layer: usize, site: Site, position: usize) -> crate::rng::KeyedRng {
        let (sample, view) = self.rows[row];
        stream(&[self.seed, self.step, sample, view, layer as u64, site as u64, position as u64])
    }

    fn check_rows(&self, b: usize) -> Result<()> {
        if self.rows.len() != b {
            candle_core::bail!("dropout: the key names {} rows, the batch has {b}", self.rows.len());
        }
        Ok(())
    }

    /// Dropout with probability `p` on `x` (`[b, len, width]`): for each row and position, a
    /// stream of `width` draws.
    pub fn apply(&self, x: &Tensor, p: f64, layer: usize, site: Site) -> Result<Tensor> {
        if p == 0.0 {
            return Ok(x.clone());
        }
        allgrad_nn::dropout_mask(x, &self.mask(x, p, layer, site)?, None)
    }

    /// `dropout(x) + residual`, fused: the same mask as [`DropoutKey::apply`] (a plain sum when
    /// `p` is 0). A bf16 `x` (a dense layer under autocast) with an f32 residual is promoted
    /// to f32 first, as PyTorch promotes the sum: the residual stream stays f32.
    pub fn apply_residual(&self, x: &Tensor, residual: &Tensor, p: f64, layer: usize, site: Site) -> Result<Tensor> {
        let x = &promote_to(x, residual)?;
        if p == 0.0 {
            return x + residual;
        }
        allgrad_nn::dropout_mask(x, &self.mask(x, p, layer, site)?, Some(residual))
    }

    /// The scaled keep mask of `x` (`[b, len, width]`) at `site`.
    fn mask(&self, x: &Tensor, p: f64, layer: usize, site: Site) -> Result<Tensor> {
        let (b, _, width) = x.dims3()?;
        self.check_rows(b)?;
        let scale = 1.0 / (1.0 - p);
        mask_tensor(x.shape(), x.dtype(), x.device(), &|row, m| {
            for (pos, m) in m.chunks_mut(width.max(1)).enumerate() {
                let mut rng = self.stream(row, layer, site, pos);
                m.iter_mut().for_each(|v| *v = draw(&mut rng, p, scale));
            }
        })
    }

    /// The scaled keep mask (`0` or `1/(1-p)`) of dropout with probability `p` on attention
    /// probabilities of shape `(b, heads, len_q, len_k)`, for [`allgrad_nn::attention`]: for
    /// each row and query position, a stream drawn key by key, head by head.
    pub fn attention_mask(
        &self,
        (b, heads, lq, lk): (usize, usize, usize, usize),
        p: f64,
        layer: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        self.check_rows(b)?;
        let scale = 1.0 / (1.0 - p);
        mask_tensor(&Shape::from((b, heads, lq, lk)), dtype, device, &|row, m| {
            for q in 0..lq {
                let mut rng = self.stream(row, layer, Site::AttentionProbs, q);
                for k in 0..lk {
                    for h in 0..heads {
                        m[(h * lq + q) * lk + k] = draw(&mut rng, p, scale);
                    }
                }
            }
        })
    }
}

/// A mask of `shape` (whose first dimension is the batch row), each row's entries written by
/// `fill(row, entries)` in f64, the rows in parallel, stored in `dtype` on `device`. The values
/// do not depend on the number of threads.
fn mask_tensor(shape: &Shape, dtype: DType, device: &Device, fill: &(dyn Fn(usize, &mut [f64]) + Sync)) -> Result<Tensor> {
    fn build<T: WithDType>(rows: usize, per_row: usize, fill: &(dyn Fn(usize, &mut [f64]) + Sync)) -> Vec<T> {
        let mut out = vec![T::from_f64(0.0); rows * per_row];
        out.par_chunks_mut(per_row.max(1)).enumerate().for_each(|(row, o)| {
            let mut row_mask = vec![0f64; o.len()];
            fill(row, &mut row_mask);
            o.iter_mut().zip(row_mask).for_each(|(o, v)| *o = T::from_f64(v));
        });
        out
    }
    let rows = shape.dims().first().copied().unwrap_or(1);
    let per_row = shape.elem_count() / rows.max(1);
    match dtype {
        DType::F32 => Tensor::from_vec(build::<f32>(rows, per_row, fill), shape, device),
        _ => Tensor::from_vec(build::<f64>(rows, per_row, fill), shape, device)?.to_dtype(dtype),
    }
}
