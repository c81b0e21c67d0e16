//! Softmax and log-softmax over the last dimension, with backward. (Candle's
//! `candle_nn::ops::softmax_last_dim` is a custom op without backward, so gradients silently
//! stop there.)

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

use crate::backend::cpu_float;
use crate::cpu::{contiguous, float_kernel, lane_sum, zeros, Float};
use crate::error::{fail, NnError};
use crate::simd::{dispatch, SimdPlan, LANES};

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
        let level = crate::simd::for_kernel()?;
        let out = float_kernel!(self.kind.name(), s => x; softmax_fwd(&contiguous(x, l), d, self.kind, level));
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
        let level = crate::simd::for_kernel()?;
        let out = float_kernel!("softmax backward", s1 => y, s2 => g; softmax_bwd(&contiguous(y, l1), &contiguous(g, l2), d, self.kind, level));
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

/// The largest element of a row, NaN when any is NaN, `-inf` for an empty row or one of only
/// `-inf`: [`LANES`] running maxima (element `i` into `i mod LANES`), then combined, so that
/// the loop vectorises.
#[inline(always)]
fn row_max<T: Float>(row: &[T]) -> T {
    let pick = |m: T, v: T| {
        if m.is_nan() || !(v > m || v.is_nan()) {
            m
        } else {
            v
        }
    };
    let mut acc = [T::NEG_INFINITY; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        let c: &[T; LANES] = c.try_into().expect("exact chunk");
        for j in 0..LANES {
            acc[j] = pick(acc[j], c[j]);
        }
    }
    for (j, &v) in tail.iter().enumerate() {
        acc[j] = pick(acc[j], v);
    }
    acc.into_iter().fold(T::NEG_INFINITY, pick)
}

/// `row ← softmax(row)` in place at `level` (a row of only `-inf` gives zeros): the max
/// subtracted, the vectorised `exp` (`crate::vmath` in f32), the sum in lane sums.
#[inline(always)]
fn softmax_row<T: Float>(row: &mut [T], level: SimdPlan) {
    let m = row_max(row);
    if m == T::NEG_INFINITY {
        row.fill(T::from_f64(0.0));
        return;
    }
    row.iter_mut().for_each(|v| *v -= m);
    T::exp_in_place(level, row);
    let inv = T::from_f64(1.0) / lane_sum(row, row, |v, _| v);
    row.iter_mut().for_each(|v| *v *= inv);
}

/// `out ← log_softmax(x)` of one row at `level` (a row of only `-inf` stays `-inf`);
/// `out` also holds the exponentials on the way.
#[inline(always)]
fn log_softmax_row<T: Float>(out: &mut [T], x: &[T], level: SimdPlan) {
    let m = row_max(x);
    if m == T::NEG_INFINITY {
        out.copy_from_slice(x);
        return;
    }
    out.iter_mut().zip(x).for_each(|(o, &v)| *o = v - m);
    T::exp_in_place(level, out);
    let lse = lane_sum(out, out, |v, _| v).ln();
    out.iter_mut().zip(x).for_each(|(o, &v)| *o = (v - m) - lse);
}

/// One task's rows of the forward.
#[inline(always)]
fn fwd_rows<T: Float>(ys: &mut [T], xs: &[T], d: usize, kind: Kind, level: SimdPlan) {
    for (yr, xr) in ys.chunks_mut(d).zip(xs.chunks(d)) {
        match kind {
            Kind::Softmax => {
                yr.copy_from_slice(xr);
                softmax_row(yr, level);
            }
            Kind::LogSoftmax => log_softmax_row(yr, xr, level),
        }
    }
}

fn softmax_fwd<T: Float>(x: &[T], d: usize, kind: Kind, level: SimdPlan) -> Vec<T> {
    let mut y = zeros(x.len());
    if d == 0 || x.is_empty() {
        return y;
    }
    let rows = rows_per_task(d);
    y.par_chunks_mut(rows * d).zip(x.par_chunks(rows * d)).for_each(|(ys, xs)| {
        dispatch!(
            level,
            fn rows<T: Float>(ys: &mut [T], xs: &[T], d: usize, kind: Kind, level: SimdPlan) -> () {
                fwd_rows(ys, xs, d, kind, level)
            }
        )
    });
    y
}

/// One task's rows of the backward: softmax `∂x = y·(g − Σ y·g)`, log-softmax
/// `∂x = g − e^y·Σ g`, the sums in lane sums.
#[inline(always)]
fn bwd_rows<T: Float>(dxs: &mut [T], ys: &[T], gs: &[T], d: usize, kind: Kind, level: SimdPlan) {
    for ((dr, yr), gr) in dxs.chunks_mut(d).zip(ys.chunks(d)).zip(gs.chunks(d)) {
        match kind {
            Kind::Softmax => {
                let dot = lane_sum(yr, gr, |a, b| a * b);
                for ((o, &a), &b) in dr.iter_mut().zip(yr).zip(gr) {
                    *o = a * (b - dot);
                }
            }
            Kind::LogSoftmax => {
                let sum = lane_sum(gr, gr, |b, _| b);
                dr.copy_from_slice(yr);
                T::exp_in_place(level, dr);
                for (o, &b) in dr.iter_mut().zip(gr) {
                    *o = b - *o * sum;
                }
            }
        }
    }
}

fn softmax_bwd<T: Float>(y: &[T], g: &[T], d: usize, kind: Kind, level: SimdPlan) -> Vec<T> {
    let mut dx = zeros(y.len());
    if d == 0 || y.is_empty() {
        return dx;
    }
    let rows = rows_per_task(d);
    dx.par_chunks_mut(rows * d).zip(y.par_chunks(rows * d)).zip(g.par_chunks(rows * d)).for_each(|((dxs, ys), gs)| {
        dispatch!(
            level,
            fn rows<T: Float>(dxs: &mut [T], ys: &[T], gs: &[T], d: usize, kind: Kind, level: SimdPlan) -> () {
                bwd_rows(dxs, ys, gs, d, kind, level)
            }
        )
    });
    dx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_max_is_the_plain_maximum_and_nan_when_any_element_is() {
        let plain = |row: &[f64]| {
            if row.iter().any(|v| v.is_nan()) {
                f64::NAN
            } else {
                row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v))
            }
        };
        // Lengths around the lanes' multiples, the maximum at every position, NaN at a few.
        for len in [0, 1, 5, 15, 16, 17, 33, 40] {
            let base: Vec<f64> = (0..len).map(|i| ((i * 7919) % 23) as f64 - 11.0).collect();
            for at in 0..len {
                let mut row = base.clone();
                row[at] = 100.0;
                assert_eq!(row_max(&row), plain(&row), "len {len}, max at {at}");
                row[at] = f64::NAN;
                assert!(row_max(&row).is_nan(), "len {len}, NaN at {at}");
            }
            assert_eq!(row_max(&vec![f64::NEG_INFINITY; len]), f64::NEG_INFINITY, "len {len} of -inf");
        }
    }
}
