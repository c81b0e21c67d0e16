//! Softmax and log-softmax over the last dimension, with backward. (Candle's
//! `candle_nn::ops::softmax_last_dim` is a custom op without backward, so gradients silently
//! stop there.)

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

use crate::backend::cpu_float;
use crate::cpu::{contiguous, float_kernel, zeros, Float};
use crate::error::{fail, NnError};

/// `softmax(x)_i = exp(x_i - max x) / Σ_j exp(x_j - max x)` over the last dimension.
///
/// On the CPU with f32/f64 the forward and backward (`∂x = y · (∂y - Σ ∂y · y)`) are fused
/// kernels, parallel over rows; elsewhere this is Candle's differentiable composition
/// `candle_nn::ops::softmax(x, D::Minus1)`.
///
/// # Errors
/// When `x` is a scalar.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    apply(x, Kind::Softmax)
}

/// `log_softmax(x)_i = x_i - max x - ln Σ_j exp(x_j - max x)` over the last dimension
/// (stable for any finite logits).
///
/// On the CPU with f32/f64 the forward and backward (`∂x = ∂y - softmax(x) · Σ ∂y`) are fused
/// kernels, parallel over rows; elsewhere this is Candle's differentiable composition
/// `candle_nn::ops::log_softmax(x, D::Minus1)`.
///
/// # Errors
/// When `x` is a scalar.
pub fn log_softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    apply(x, Kind::LogSoftmax)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Softmax,
    LogSoftmax,
}

fn apply(x: &Tensor, kind: Kind) -> Result<Tensor> {
    if x.rank() == 0 {
        return fail(NnError::InputRank {
            op: kind.name(),
            expected: "a tensor of rank 1 or more, not a scalar",
            shape: x.shape().clone(),
        });
    }
    if cpu_float(x) {
        return x.apply_op1(SoftmaxOp { kind });
    }
    match kind {
        Kind::Softmax => candle_nn::ops::softmax(x, D::Minus1),
        Kind::LogSoftmax => candle_nn::ops::log_softmax(x, D::Minus1),
    }
}

impl Kind {
    fn name(&self) -> &'static str {
        match self {
            Kind::Softmax => "softmax_last_dim",
            Kind::LogSoftmax => "log_softmax_last_dim",
        }
    }
}

struct SoftmaxOp {
    kind: Kind,
}

/// The backward kernel: inputs `(y, grad)` where `y` is the forward's output; output ∂x.
struct SoftmaxBackward {
    kind: Kind,
}

/// Rows per parallel task, so that each task has some work.
pub(crate) fn rows_per_task(d: usize) -> usize {
    (16384 / d.max(1)).max(1)
}

impl CustomOp1 for SoftmaxOp {
    fn name(&self) -> &'static str {
        match self.kind {
            Kind::Softmax => "allgrad-softmax",
            Kind::LogSoftmax => "allgrad-log-softmax",
        }
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let d = l.dims().last().copied().unwrap_or(1);
        let out = float_kernel!(self.kind.name(), s => x; softmax_fwd(&contiguous(x, l), d, self.kind));
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(res.detach().apply_op2_no_bwd(&grad.detach(), &SoftmaxBackward { kind: self.kind })?))
    }
}

impl CustomOp2 for SoftmaxBackward {
    fn name(&self) -> &'static str {
        "allgrad-softmax-backward"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let d = l1.dims().last().copied().unwrap_or(1);
        let out = float_kernel!("softmax backward", s1 => y, s2 => g; softmax_bwd(&contiguous(y, l1), &contiguous(g, l2), d, self.kind));
        Ok((out, l1.shape().clone()))
    }
}

/// Max `m` and `Σ exp(x - m)` of one row; `(0, 1)` for a row of only `-inf` (a fully masked
/// row), so that softmax gives zeros and log-softmax `-inf` rather than NaN. Callers subtract
/// `m` before anything else, which keeps `x - m` exact for large logits.
#[inline]
pub(crate) fn max_and_sum_exp<T: Float>(row: &[T]) -> (T, T) {
    let mut m = T::NEG_INFINITY;
    for &v in row {
        if v > m || v.is_nan() {
            m = v;
        }
    }
    if m == T::NEG_INFINITY {
        return (T::from_f64(0.0), T::from_f64(1.0));
    }
    let mut s = T::from_f64(0.0);
    for &v in row {
        s += (v - m).exp();
    }
    (m, s)
}

fn softmax_fwd<T: Float>(x: &[T], d: usize, kind: Kind) -> Vec<T> {
    let mut y = zeros(x.len());
    if d == 0 || x.is_empty() {
        return y;
    }
    let rows = rows_per_task(d);
    y.par_chunks_mut(rows * d).zip(x.par_chunks(rows * d)).for_each(|(ys, xs)| {
        for (yr, xr) in ys.chunks_mut(d).zip(xs.chunks(d)) {
            let (m, sum) = max_and_sum_exp(xr);
            match kind {
                Kind::LogSoftmax => {
                    let lse = sum.ln();
                    for (o, &v) in yr.iter_mut().zip(xr) {
                        *o = (v - m) - lse;
                    }
                }
                Kind::Softmax => {
                    let inv = T::from_f64(1.0) / sum;
                    for (o, &v) in yr.iter_mut().zip(xr) {
                        *o = (v - m).exp() * inv;
                    }
                }
            }
        }
    });
    y
}

fn softmax_bwd<T: Float>(y: &[T], g: &[T], d: usize, kind: Kind) -> Vec<T> {
    let mut dx = zeros(y.len());
    if d == 0 || y.is_empty() {
        return dx;
    }
    let rows = rows_per_task(d);
    dx.par_chunks_mut(rows * d).zip(y.par_chunks(rows * d)).zip(g.par_chunks(rows * d)).for_each(|((dxs, ys), gs)| {
        for ((dr, yr), gr) in dxs.chunks_mut(d).zip(ys.chunks(d)).zip(gs.chunks(d)) {
            match kind {
                Kind::Softmax => {
                    let mut dot = T::from_f64(0.0);
                    for (&a, &b) in yr.iter().zip(gr) {
                        dot += a * b;
                    }
                    for ((o, &a), &b) in dr.iter_mut().zip(yr).zip(gr) {
                        *o = a * (b - dot);
                    }
                }
                Kind::LogSoftmax => {
                    let mut sum = T::from_f64(0.0);
                    for &b in gr {
                        sum += b;
                    }
                    for ((o, &a), &b) in dr.iter_mut().zip(yr).zip(gr) {
                        *o = b - a.exp() * sum;
                    }
                }
            }
        }
    });
    dx
}
