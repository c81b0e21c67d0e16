//! 2-D max and average pooling with a backward for any kernel, stride and padding, and
//! adaptive average pooling (global average pooling is `adaptive_avg_pool2d(x, 1)`).
//!
//! Candle 0.11.1's `max_pool2d` / `avg_pool2d` have no padding, and their backward fails
//! whenever the kernel differs from the stride (ResNet's 3x3 / stride-2 stem pool), misplaces
//! gradients when the kernel does not divide the input, and divides max-pool gradients by the
//! kernel area.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor, ToUsize2};
use rayon::prelude::*;

use crate::backend::cpu_float;
use crate::cpu::{contiguous, float_kernel, zeros, Float, Strides4};
use crate::error::{fail, NnError};

/// How output positions map to input windows along one axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Windows {
    /// Output `o` covers `o * stride - padding .. + kernel` (clipped to the input).
    Fixed { kernel: usize, stride: usize, padding: usize },
    /// Output `o` of `out` covers `floor(o * size / out) .. ceil((o + 1) * size / out)`.
    Adaptive { size: usize, out: usize },
}

impl Windows {
    /// The input range `start..end` (clipped to `0..size`) of output position `o`.
    #[inline]
    fn range(&self, o: usize, size: usize) -> (usize, usize) {
        match *self {
            Windows::Fixed { kernel, stride, padding } => {
                let start = o * stride;
                (start.saturating_sub(padding), (start + kernel).saturating_sub(padding).min(size))
            }
            Windows::Adaptive { size, out } => (o * size / out, ((o + 1) * size).div_ceil(out)),
        }
    }
}

/// Pooling reduction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Max,
    /// Average; `Fixed` windows divide by the full kernel area (zero padding counts, as
    /// PyTorch's default `count_include_pad=True`), `Adaptive` windows by their own size.
    Avg,
}

/// The resolved geometry of one pooling.
#[derive(Clone, Copy, Debug)]
struct PoolGeom {
    kind: Kind,
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    oh: usize,
    ow: usize,
    wy: Windows,
    wx: Windows,
}

impl PoolGeom {
    /// Divisor of the average over the window of output `(oy, ox)`.
    fn divisor(&self, (y0, y1): (usize, usize), (x0, x1): (usize, usize)) -> f64 {
        match (self.wy, self.wx) {
            (Windows::Fixed { kernel: kh, .. }, Windows::Fixed { kernel: kw, .. }) => (kh * kw) as f64,
            _ => ((y1 - y0) * (x1 - x0)) as f64,
        }
    }
}

fn dims4(op: &'static str, x: &Tensor) -> Result<(usize, usize, usize, usize)> {
    match *x.dims() {
        [n, c, h, w] => Ok((n, c, h, w)),
        _ => fail(NnError::InputRank { op, expected: "(batch, channels, height, width)", shape: x.shape().clone() }),
    }
}

/// Resolves fixed-window pooling; `padding <= kernel / 2` as in PyTorch, so every window holds
/// at least one input element.
fn fixed_geometry(
    op: &'static str,
    kind: Kind,
    x: &Tensor,
    k: (usize, usize),
    s: (usize, usize),
    p: (usize, usize),
) -> Result<PoolGeom> {
    let (n, c, h, w) = dims4(op, x)?;
    if h == 0 || w == 0 {
        return fail(NnError::EmptyInput { op, shape: x.shape().clone() });
    }
    if k.0 == 0 || k.1 == 0 || s.0 == 0 || s.1 == 0 {
        return fail(NnError::PoolKernelStride { op, kernel: k, stride: s });
    }
    if 2 * p.0 > k.0 || 2 * p.1 > k.1 {
        return fail(NnError::PoolPadding { op, padding: p, kernel: k });
    }
    if k.0 > h + 2 * p.0 || k.1 > w + 2 * p.1 {
        return fail(NnError::PoolKernelTooLarge { op, kernel: k, h, w, padding: p });
    }
    Ok(PoolGeom {
        kind,
        n,
        c,
        h,
        w,
        oh: (h + 2 * p.0 - k.0) / s.0 + 1,
        ow: (w + 2 * p.1 - k.1) / s.1 + 1,
        wy: Windows::Fixed { kernel: k.0, stride: s.0, padding: p.0 },
        wx: Windows::Fixed { kernel: k.1, stride: s.1, padding: p.1 },
    })
}

fn fast_path(x: &Tensor) -> bool {
    cpu_float(x)
}

/// 2-D max pooling over `(batch, channels, height, width)` with `kernel`, `stride` and
/// `padding` (each a `usize` for both axes or an `(h, w)` pair). Padding never wins the max;
/// it may be at most half the kernel. The output size is `(in + 2 * padding - kernel) / stride + 1`
/// (floor mode).
///
/// Backward (any kernel and stride): each output's gradient goes to the input element that
/// produced the max. Ties go to the first maximal element of the window in row-major order
/// (as in PyTorch; Candle's own backward splits ties equally). A NaN in a window is its max and
/// takes the gradient. Overlapping windows add up.
///
/// On devices other than the CPU, or dtypes other than f32/f64, this is a composition of
/// differentiable Candle ops (strided views stacked and reduced with `max`), whose backward
/// gives every tied maximum the full gradient.
///
/// # Errors
/// When the input is not rank 4, a size is zero, the padding exceeds half the kernel, or the
/// kernel exceeds the padded input.
pub fn max_pool2d(x: &Tensor, kernel: impl ToUsize2, stride: impl ToUsize2, padding: impl ToUsize2) -> Result<Tensor> {
    let _timer = crate::trace::OpTimer::start("pool", crate::trace::Pass::Forward, x.device());
    let (k, s, p) = (kernel.to_usize2(), stride.to_usize2(), padding.to_usize2());
    let g = fixed_geometry("max_pool2d", Kind::Max, x, k, s, p)?;
    if !fast_path(x) {
        return pool_composed(x, &g);
    }
    x.apply_op1(Pool2d { g })
}

/// 2-D average pooling over `(batch, channels, height, width)` with `kernel`, `stride` and
/// `padding` (each a `usize` or an `(h, w)` pair). Zero padding is counted in the divisor,
/// which is always `kernel_h * kernel_w` (PyTorch's default `count_include_pad=True`); floor
/// mode. Backward works for any kernel and stride: each input element receives the sum over
/// the windows containing it of `grad / (kernel_h * kernel_w)`.
///
/// On devices other than the CPU, or dtypes other than f32/f64, this is a composition of
/// differentiable Candle ops (strided views stacked and averaged).
///
/// # Errors
/// As [`max_pool2d`].
pub fn avg_pool2d(x: &Tensor, kernel: impl ToUsize2, stride: impl ToUsize2, padding: impl ToUsize2) -> Result<Tensor> {
    let _timer = crate::trace::OpTimer::start("pool", crate::trace::Pass::Forward, x.device());
    let (k, s, p) = (kernel.to_usize2(), stride.to_usize2(), padding.to_usize2());
    let g = fixed_geometry("avg_pool2d", Kind::Avg, x, k, s, p)?;
    if !fast_path(x) {
        return pool_composed(x, &g);
    }
    x.apply_op1(Pool2d { g })
}

/// Adaptive 2-D average pooling to an `output` size (a `usize` or an `(h, w)` pair): output
/// `(i, j)` averages rows `floor(i * H / oh) .. ceil((i + 1) * H / oh)` and the matching columns,
/// as PyTorch's `adaptive_avg_pool2d`. `adaptive_avg_pool2d(x, 1)` is global average pooling,
/// shaped `(batch, channels, 1, 1)`.
///
/// On devices other than the CPU, or dtypes other than f32/f64, only `output == (1, 1)` is
/// supported (as a differentiable mean).
///
/// # Errors
/// When the input is not rank 4, or an output size is zero or larger than the input's.
pub fn adaptive_avg_pool2d(x: &Tensor, output: impl ToUsize2) -> Result<Tensor> {
    let _timer = crate::trace::OpTimer::start("pool", crate::trace::Pass::Forward, x.device());
    let (oh, ow) = output.to_usize2();
    let (n, c, h, w) = dims4("adaptive_avg_pool2d", x)?;
    if oh == 0 || ow == 0 || oh > h || ow > w {
        return fail(NnError::AdaptiveOutput { oh, ow, h, w });
    }
    if !fast_path(x) {
        if (oh, ow) != (1, 1) {
            return fail(NnError::AdaptiveOffCpu { oh, ow, dtype: x.dtype(), device: format!("{:?}", x.device().location()) });
        }
        return x.mean_keepdim(3)?.mean_keepdim(2);
    }
    let g = PoolGeom {
        kind: Kind::Avg,
        n,
        c,
        h,
        w,
        oh,
        ow,
        wy: Windows::Adaptive { size: h, out: oh },
        wx: Windows::Adaptive { size: w, out: ow },
    };
    x.apply_op1(Pool2d { g })
}

/// Pooling written with differentiable Candle ops, for devices and dtypes without a CPU
/// kernel: the `kh * kw` strided views of the padded input are stacked on a new last axis and
/// reduced. Backward works for any kernel and stride; for max, Candle's reduction gives every
/// tied maximum the full gradient. Uses `kh * kw` times the output's memory.
fn pool_composed(x: &Tensor, g: &PoolGeom) -> Result<Tensor> {
    let (Windows::Fixed { kernel: kh, stride: sh, padding: ph }, Windows::Fixed { kernel: kw, stride: sw, padding: pw }) =
        (g.wy, g.wx)
    else {
        return fail(NnError::InputRank { op: "pool2d (composed)", expected: "fixed windows", shape: Shape::from((g.oh, g.ow)) });
    };
    let fill = match g.kind {
        Kind::Max => f64::NEG_INFINITY,
        Kind::Avg => 0.0,
    };
    // Rows ki + sh * j (j < oh) of the padded input are read; pad the end so that the
    // (oh, sh) reshape below has whole blocks.
    let (need_h, need_w) = (kh - 1 + sh * g.oh, kw - 1 + sw * g.ow);
    let x = pad_axis(x, 2, ph, need_h.saturating_sub(g.h + ph), fill)?;
    let x = pad_axis(&x, 3, pw, need_w.saturating_sub(g.w + pw), fill)?;
    let mut views = Vec::with_capacity(kh * kw);
    for ki in 0..kh {
        for kj in 0..kw {
            let v = x
                .narrow(2, ki, sh * g.oh)?
                .narrow(3, kj, sw * g.ow)?
                .reshape((g.n, g.c, g.oh, sh, g.ow, sw))?
                .narrow(3, 0, 1)?
                .narrow(5, 0, 1)?
                .reshape((g.n, g.c, g.oh, g.ow))?;
            views.push(v);
        }
    }
    let stacked = Tensor::stack(&views, 4)?;
    match g.kind {
        Kind::Max => stacked.max(4),
        Kind::Avg => stacked.sum(4)? / (kh * kw) as f64,
    }
}

/// Pads axis `dim` with `before` and `after` copies of `value`.
fn pad_axis(x: &Tensor, dim: usize, before: usize, after: usize, value: f64) -> Result<Tensor> {
    let block = |len: usize| -> Result<Tensor> {
        let mut dims = x.dims().to_vec();
        dims[dim] = len;
        Tensor::full(value, dims, x.device())?.to_dtype(x.dtype())
    };
    match (before, after) {
        (0, 0) => Ok(x.clone()),
        (0, a) => Tensor::cat(&[x, &block(a)?], dim),
        (b, 0) => Tensor::cat(&[&block(b)?, x], dim),
        (b, a) => Tensor::cat(&[&block(b)?, x, &block(a)?], dim),
    }
}

/// [`max_pool2d`] written with differentiable Candle ops (the path taken off the CPU and for
/// dtypes other than f32/f64): strided views of the padded input stacked and reduced with
/// `max`. Works on any device, for any kernel and stride, at `kh * kw` times the output's memory;
/// tied maxima each receive the full gradient.
///
/// # Errors
/// As [`max_pool2d`].
pub fn max_pool2d_composed(x: &Tensor, kernel: impl ToUsize2, stride: impl ToUsize2, padding: impl ToUsize2) -> Result<Tensor> {
    let (k, s, p) = (kernel.to_usize2(), stride.to_usize2(), padding.to_usize2());
    pool_composed(x, &fixed_geometry("max_pool2d", Kind::Max, x, k, s, p)?)
}

/// [`avg_pool2d`] written with differentiable Candle ops (the path taken off the CPU and for
/// dtypes other than f32/f64), with the same divisor `kh * kw`.
///
/// # Errors
/// As [`avg_pool2d`].
pub fn avg_pool2d_composed(x: &Tensor, kernel: impl ToUsize2, stride: impl ToUsize2, padding: impl ToUsize2) -> Result<Tensor> {
    let (k, s, p) = (kernel.to_usize2(), stride.to_usize2(), padding.to_usize2());
    pool_composed(x, &fixed_geometry("avg_pool2d", Kind::Avg, x, k, s, p)?)
}

/// The forward custom op.
struct Pool2d {
    g: PoolGeom,
}

/// The backward kernel: inputs `(x, grad)`, output ∂x (contiguous, shaped like `x`).
struct Pool2dBackward {
    g: PoolGeom,
}

impl CustomOp1 for Pool2d {
    fn name(&self) -> &'static str {
        match self.g.kind {
            Kind::Max => "allgrad-max-pool2d",
            Kind::Avg => "allgrad-avg-pool2d",
        }
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let g = &self.g;
        let shape = Shape::from((g.n, g.c, g.oh, g.ow));
        let out = float_kernel!(self.name(), s => x; pool_fwd(x, l, g));
        Ok((out, shape))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let _timer = crate::trace::OpTimer::start("pool", crate::trace::Pass::Backward, x.device());
        let grad = grad.contiguous()?;
        Ok(Some(x.detach().apply_op2_no_bwd(&grad, &Pool2dBackward { g: self.g })?))
    }
}

impl CustomOp2 for Pool2dBackward {
    fn name(&self) -> &'static str {
        "allgrad-pool2d-backward"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let g = &self.g;
        let shape = Shape::from((g.n, g.c, g.h, g.w));
        let out = float_kernel!("pool2d backward", s1 => x, s2 => gy; pool_bwd(x, l1, &contiguous(gy, l2), g));
        Ok((out, shape))
    }
}

/// Planes (one `(n, c)` pair each) per parallel task, so that each task has some work.
fn planes_per_task(g: &PoolGeom) -> usize {
    (16384 / (g.h * g.w).max(1)).max(1)
}

/// Position of the max of a window as `(row, col)`; the first max in row-major order, a NaN
/// counting as the max.
#[inline]
fn argmax<T: Float>(x: &[T], base: usize, st: &Strides4, ys: (usize, usize), xs: (usize, usize)) -> (usize, usize) {
    let mut best = (ys.0, xs.0);
    let mut bv = T::NEG_INFINITY;
    for iy in ys.0..ys.1 {
        for ix in xs.0..xs.1 {
            let v = x[base + iy * st.h + ix * st.w];
            if v.is_nan() {
                return (iy, ix);
            }
            if v > bv {
                bv = v;
                best = (iy, ix);
            }
        }
    }
    best
}

fn pool_fwd<T: Float>(x: &[T], l: &Layout, g: &PoolGeom) -> Vec<T> {
    let st = Strides4::of(l);
    let plane_out = g.oh * g.ow;
    let mut out = zeros(g.n * g.c * plane_out);
    if out.is_empty() {
        return out;
    }
    let per_task = planes_per_task(g);
    out.par_chunks_mut(per_task * plane_out).enumerate().for_each(|(task, ys)| {
        for (j, y) in ys.chunks_mut(plane_out).enumerate() {
            let plane = task * per_task + j;
            let base = st.offset + (plane / g.c) * st.n + (plane % g.c) * st.c;
            for oy in 0..g.oh {
                let yr = g.wy.range(oy, g.h);
                for ox in 0..g.ow {
                    let xr = g.wx.range(ox, g.w);
                    y[oy * g.ow + ox] = match g.kind {
                        Kind::Max => {
                            let (iy, ix) = argmax(x, base, &st, yr, xr);
                            x[base + iy * st.h + ix * st.w]
                        }
                        Kind::Avg => {
                            let mut sum = T::from_f64(0.0);
                            for iy in yr.0..yr.1 {
                                for ix in xr.0..xr.1 {
                                    sum += x[base + iy * st.h + ix * st.w];
                                }
                            }
                            sum / T::from_f64(g.divisor(yr, xr))
                        }
                    };
                }
            }
        }
    });
    out
}

fn pool_bwd<T: Float>(x: &[T], l: &Layout, gy: &[T], g: &PoolGeom) -> Vec<T> {
    let st = Strides4::of(l);
    let (plane_in, plane_out) = (g.h * g.w, g.oh * g.ow);
    let mut dx = zeros(g.n * g.c * plane_in);
    if dx.is_empty() || plane_out == 0 {
        return dx;
    }
    let per_task = planes_per_task(g);
    dx.par_chunks_mut(per_task * plane_in).enumerate().for_each(|(task, dxs)| {
        for (j, d) in dxs.chunks_mut(plane_in).enumerate() {
            let plane = task * per_task + j;
            let base = st.offset + (plane / g.c) * st.n + (plane % g.c) * st.c;
            let gp = &gy[plane * plane_out..(plane + 1) * plane_out];
            // Write before the first read (see the note in conv.rs's backward).
            d.fill(T::from_f64(0.0));
            for oy in 0..g.oh {
                let yr = g.wy.range(oy, g.h);
                for ox in 0..g.ow {
                    let xr = g.wx.range(ox, g.w);
                    let gv = gp[oy * g.ow + ox];
                    match g.kind {
                        Kind::Max => {
                            let (iy, ix) = argmax(x, base, &st, yr, xr);
                            d[iy * g.w + ix] += gv;
                        }
                        Kind::Avg => {
                            let share = gv / T::from_f64(g.divisor(yr, xr));
                            for iy in yr.0..yr.1 {
                                for v in &mut d[iy * g.w + xr.0..iy * g.w + xr.1] {
                                    *v += share;
                                }
                            }
                        }
                    }
                }
            }
        }
    });
    dx
}
