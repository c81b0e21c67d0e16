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
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Storage, Tensor, WithDType, D};
use rayon::prelude::*;

use super::margin::Margin;
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

/// The margin softmax cross-entropy of the global batch from this rank's cosines, as
/// [`parallel_cross_entropy`] of the margined logits, without forming them: `cos` `[B, c]`
/// (c ≥ 1) the cosines of the global batch against this rank's (sampled) classes, `cols[i]`
/// the column of sample i's class (`u32::MAX` where another rank holds it). The logits are
/// `s·cos` except `s·f(cos)` in the target column ([`Margin`]).
///
/// On the CPU (f32, f64) one pass over `cos` yields, per row, the sum of
/// `exp(s·cos − m)` over the non-target columns and the target cosine; its backward writes the
/// cosines' gradient in one pass. So the step keeps `cos` and its gradient, where the composed
/// form ([`parallel_margin_cross_entropy_composed`], taken on other devices) keeps the scaled
/// cosines, the logits, their shifted exponentials and as many gradients, each `[B, c]`. The
/// shift `m` is, per row, the largest `s·cos` or target logit over all ranks (the loss does not
/// depend on it; it keeps every exponential at most 1).
pub fn parallel_margin_cross_entropy(cos: &Tensor, cols: &[u32], margin: Margin, pg: &ProcessGroup) -> Result<Tensor> {
    let (b, c) = check_cos(cos, cols)?;
    // The fused kernel is the CPU's own (it reads the row maxima and target cosines on the host);
    // a device, and the CPU on the device path, take the composed form.
    if allgrad_nn::transfer::takes_device_path(cos.device()) || !matches!(cos.dtype(), DType::F32 | DType::F64) {
        return parallel_margin_cross_entropy_composed(cos, cols, margin, pg);
    }
    let (dev, dtype) = (cos.device().clone(), cos.dtype());
    let has: Vec<f64> = cols.iter().map(|c| f64::from(u8::from(*c != u32::MAX))).collect();
    // The shift (no gradient): per row max(s·max_j cos_ij, target logit), then over ranks.
    let detached = cos.detach();
    let row_max: Vec<f64> = detached.max_keepdim(D::Minus1)?.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
    let safe = Tensor::from_vec(cols.iter().map(|c| if *c == u32::MAX { 0 } else { *c }).collect::<Vec<_>>(), (b, 1), &dev)?;
    let at_target: Vec<f64> = detached.gather(&safe, 1)?.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
    let local: Vec<f64> = (0..b)
        .map(|i| {
            let z = margin.s * row_max[i];
            if has[i] > 0.0 {
                z.max(margin.s * margin.value_and_slope(at_target[i]).0)
            } else {
                z
            }
        })
        .collect();
    // `[B, 1]` in the cosines' dtype, as `parallel_cross_entropy` reduces it: a rank without
    // sampled classes takes that path and meets this call.
    let local = Tensor::from_vec(local, (b, 1), &dev)?.to_dtype(dtype)?;
    let shift: Vec<f64> = pg.all_reduce(&local, ReduceOp::Max)?.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;

    let out = cos.contiguous()?.apply_op1(SumExp { s: margin.s, cols: cols.to_vec(), shift: shift.clone(), columns: c })?;
    let rest = out.narrow(1, 0, 1)?.squeeze(1)?; // Σ over non-target columns of exp(s·cos − m)
    let t = out.narrow(1, 1, 1)?.squeeze(1)?; // target cosines (0 where none)
    let has = Tensor::from_vec(has, b, &dev)?.to_dtype(dtype)?;
    let shift = Tensor::from_vec(shift, b, &dev)?.to_dtype(dtype)?;
    let target = ((margin.apply(&t)? * margin.s)? * &has)?;
    // exp(target − m) where this rank holds the class; the argument is 0 elsewhere, then masked.
    let local = (rest + (((&target - &shift)? * &has)?.exp()? * &has)?)?;
    let sum = all_reduce(&local, ReduceOp::Sum, pg)?;
    let target = all_reduce(&target, ReduceOp::Sum, pg)?;
    ((sum.log()? + shift)? - target)?.mean_all()
}

/// [`parallel_margin_cross_entropy`] composed of Candle ops: the margined logits `[B, c]`,
/// then [`parallel_cross_entropy`]. The reference of the fused form, and its path off the CPU.
pub fn parallel_margin_cross_entropy_composed(cos: &Tensor, cols: &[u32], margin: Margin, pg: &ProcessGroup) -> Result<Tensor> {
    let (b, c) = check_cos(cos, cols)?;
    let dev = cos.device();
    let has: Vec<f64> = cols.iter().map(|c| f64::from(u8::from(*c != u32::MAX))).collect();
    let cols_t = Tensor::from_vec(cols.to_vec(), (b, 1), dev)?;
    let safe = Tensor::from_vec(cols.iter().map(|c| if *c == u32::MAX { 0 } else { *c }).collect::<Vec<_>>(), (b, 1), dev)?;
    let has = Tensor::from_vec(has, b, dev)?.to_dtype(cos.dtype())?;
    let t = cos.gather(&safe, 1)?.squeeze(1)?;
    let target = ((margin.apply(&t)? * margin.s)? * has)?; // [B]
    let onehot = cols_t.broadcast_eq(&allgrad_nn::transfer::numbers(c, dev)?.unsqueeze(0)?)?;
    let logits = onehot.where_cond(&target.unsqueeze(1)?.broadcast_as(cos.shape())?, &(cos * margin.s)?)?;
    parallel_cross_entropy(&logits, &target, pg)
}

fn check_cos(cos: &Tensor, cols: &[u32]) -> Result<(usize, usize)> {
    let (b, c) = cos.dims2()?;
    if c == 0 || cols.len() != b || cols.iter().any(|k| *k != u32::MAX && *k as usize >= c) {
        return Err(ModelError::HeadInput(format!(
            "the margin cross-entropy needs [B, c >= 1] cosines and B target columns below c, got {:?} and {} columns",
            cos.dims(),
            cols.len()
        ))
        .into());
    }
    Ok((b, c))
}

/// Per row of the cosines `[B, c]`: `Σ_{j ≠ col} exp(s·cos_j − m)` and `cos_col` (0 without a
/// target column), as `[B, 2]`; see [`parallel_margin_cross_entropy`].
struct SumExp {
    s: f64,
    cols: Vec<u32>,
    shift: Vec<f64>,
    columns: usize,
}

impl SumExp {
    fn forward<T: WithDType>(&self, x: &[T]) -> Vec<T> {
        let c = self.columns;
        let mut out = vec![T::from_f64(0.0); 2 * x.len() / c];
        out.par_chunks_mut(2).zip(x.par_chunks(c)).enumerate().for_each(|(i, (o, row))| {
            let (m, col) = (self.shift[i], self.cols[i] as usize);
            let mut acc = 0f64;
            for (j, v) in row.iter().enumerate() {
                if j != col {
                    acc += (self.s * v.to_f64() - m).exp();
                }
            }
            o[0] = T::from_f64(acc);
            if let Some(v) = row.get(col) {
                o[1] = *v;
            }
        });
        out
    }

    /// The cosines' gradient from the outputs' `g` (`[B, 2]` row-major, f64): `g0·s·exp(s·cos
    /// − m)` in the non-target columns, `g1` in the target column.
    fn backward<T: WithDType>(&self, x: &[T], g: &[f64]) -> Vec<T> {
        let c = self.columns;
        let mut grad = vec![T::from_f64(0.0); x.len()];
        grad.par_chunks_mut(c).zip(x.par_chunks(c)).enumerate().for_each(|(i, (d, row))| {
            let (m, col, g0, g1) = (self.shift[i], self.cols[i] as usize, g[2 * i], g[2 * i + 1]);
            for (j, (d, v)) in d.iter_mut().zip(row).enumerate() {
                *d = T::from_f64(if j == col { g1 } else { g0 * self.s * (self.s * v.to_f64() - m).exp() });
            }
        });
        grad
    }
}

impl CustomOp1 for SumExp {
    fn name(&self) -> &'static str {
        "allgrad-face-sum-exp"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let (b, _) = layout.shape().dims2()?;
        let Some((lo, hi)) = layout.contiguous_offsets() else { candle_core::bail!("{}: non-contiguous cosines", self.name()) };
        let out = match storage {
            CpuStorage::F32(v) => CpuStorage::F32(self.forward(&v[lo..hi])),
            CpuStorage::F64(v) => CpuStorage::F64(self.forward(&v[lo..hi])),
            other => candle_core::bail!("{}: unsupported dtype {:?}", self.name(), other.dtype()),
        };
        Ok((out, Shape::from((b, 2))))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let g: Vec<f64> = grad_res.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
        let (storage, layout) = arg.storage_and_layout();
        let Some((lo, hi)) = layout.contiguous_offsets() else { candle_core::bail!("{}: non-contiguous cosines", self.name()) };
        let grad = match &*storage {
            Storage::Cpu(CpuStorage::F32(v)) => Tensor::from_vec(self.backward(&v[lo..hi], &g), arg.shape(), arg.device())?,
            Storage::Cpu(CpuStorage::F64(v)) => Tensor::from_vec(self.backward(&v[lo..hi], &g), arg.shape(), arg.device())?,
            _ => candle_core::bail!("{}: the cosines must be f32 or f64 on the CPU", self.name()),
        };
        Ok(Some(grad))
    }
}
