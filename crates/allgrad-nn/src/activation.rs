//! ReLU, the residual `relu(a + b)` and GELU, fused, multi-threaded, with a one-pass backward.
//!
//! Candle's CPU `relu` is a single-threaded map, and its backward builds the mask from
//! `zeros_like`, `ge`, a dtype cast, a multiply and an add: five passes over the activation,
//! each allocating. A ResNet has one ReLU per convolution, so on a CPU these passes are a
//! visible share of a training step. Here the forward is one parallel pass, and the backward
//! one parallel pass `∂x = g · [y > 0]` reading the output `y` (for `relu(a + b)` the same
//! gradient goes to both inputs). The derivative at 0 is 0, as in PyTorch.
//!
//! GELU in its exact form, `x/2 · (1 + erf(x/√2))` (BERT's), is likewise one parallel pass
//! forward and one backward, `∂x = g · (Φ(x) + x·φ(x))` with `Φ(x) = (1 + erf(x/√2))/2` and
//! `φ` the standard normal density, recomputed from `x`. In f64 `erf` is Candle's exact one; in
//! f32 it is the vectorised formula of `vmath` (absolute error below 3e-7), whose tail's
//! `e^(−x²/2)` is also the density's: one exponential per element, and each pass a single loop
//! over the elements with no intermediate buffer. Composed from
//! Candle's ops it takes five passes forward and about twice as many backward. (Candle's fused `gelu_erf` has a
//! backward with `1/√(2π)` rounded to 6 digits: gradients off by about 1e-6 relative, which a
//! finite-difference check in f64 sees.)

use std::borrow::Cow;
use std::mem::MaybeUninit;

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::backend::{dense, fused_float};
use crate::cpu::{contiguous, float_kernel, zeros, Float, GRAIN};
use crate::error::{fail, NnError};
use crate::simd::SimdPlan;

/// `out[i] = max(a[i] + b[i], 0)` (`b` absent: `max(a[i], 0)`), in parallel.
fn relu_kernel<T: Float>(a: &[T], b: Option<&[T]>) -> Vec<T> {
    let zero = T::from_f64(0.0);
    let mut out = zeros(a.len());
    out.par_chunks_mut(GRAIN).enumerate().for_each(|(i, o)| {
        let xs = &a[i * GRAIN..i * GRAIN + o.len()];
        match b {
            None => o.iter_mut().zip(xs).for_each(|(o, &x)| *o = if x > zero { x } else { zero }),
            Some(b) => {
                let ys = &b[i * GRAIN..i * GRAIN + o.len()];
                o.iter_mut().zip(xs.iter().zip(ys)).for_each(|(o, (&x, &y))| {
                    let s = x + y;
                    *o = if s > zero { s } else { zero };
                })
            }
        }
    });
    out
}

/// `∂x[i] = g[i]` where `y[i] > 0`, else 0, in parallel.
fn mask_kernel<T: Float>(y: &[T], g: &[T]) -> Vec<T> {
    let zero = T::from_f64(0.0);
    let mut out = zeros(y.len());
    out.par_chunks_mut(GRAIN).enumerate().for_each(|(i, o)| {
        let (ys, gs) = (&y[i * GRAIN..i * GRAIN + o.len()], &g[i * GRAIN..i * GRAIN + o.len()]);
        o.iter_mut().zip(ys.iter().zip(gs)).for_each(|(o, (&y, &g))| *o = if y > zero { g } else { zero });
    });
    out
}

struct Relu;

impl CustomOp1 for Relu {
    fn name(&self) -> &'static str {
        "allgrad-relu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = float_kernel!("relu", s => x; relu_kernel(&contiguous(x, l), None));
        Ok((out, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::relu(s, l, None)
    }

    fn bwd(&self, _x: &Tensor, y: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        let _timer = crate::trace::OpTimer::start("relu", crate::trace::Pass::Backward, y.device());
        Ok(Some(masked(y, g)?))
    }
}

struct AddRelu;

impl CustomOp2 for AddRelu {
    fn name(&self) -> &'static str {
        "allgrad-add-relu"
    }

    fn cpu_fwd(&self, sa: &CpuStorage, la: &Layout, sb: &CpuStorage, lb: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = float_kernel!("add_relu", sa => a, sb => b; relu_kernel(&contiguous(a, la), Some(&contiguous(b, lb))));
        Ok((out, la.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sa: &candle_core::CudaStorage,
        la: &Layout,
        sb: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::relu(sa, la, Some((sb, lb)))
    }

    fn bwd(&self, _a: &Tensor, _b: &Tensor, y: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let _timer = crate::trace::OpTimer::start("relu", crate::trace::Pass::Backward, y.device());
        let d = masked(y, g)?;
        Ok((Some(d.clone()), Some(d)))
    }
}

/// The backward's kernel as an untracked op on (y, g).
struct Mask;

impl CustomOp2 for Mask {
    fn name(&self) -> &'static str {
        "allgrad-relu-backward"
    }

    fn cpu_fwd(&self, sy: &CpuStorage, ly: &Layout, sg: &CpuStorage, lg: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = float_kernel!("relu backward", sy => y, sg => g; {
            let (y, g): (Cow<[_]>, Cow<[_]>) = (contiguous(y, ly), contiguous(g, lg));
            mask_kernel(&y, &g)
        });
        Ok((out, ly.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sy: &candle_core::CudaStorage,
        ly: &Layout,
        sg: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::relu_backward(sy, ly, sg, lg)
    }
}

/// `g` where `y > 0`, else 0, untracked: the ReLU's backward from its output `y` (also the
/// gradient of batch norm's skip input).
pub(crate) fn masked(y: &Tensor, g: &Tensor) -> Result<Tensor> {
    dense(&y.detach())?.apply_op2_no_bwd(&dense(&g.detach().to_dtype(y.dtype())?)?, &Mask)
}

/// `out[i] = f(chunk of x, chunk of g)` over every element, in parallel tasks of [`GRAIN`]
/// elements that each write their chunk of `out` once (no zeroing pass first).
fn elementwise<T: Float>(x: &[T], g: Option<&[T]>, f: impl Fn(&mut [MaybeUninit<T>], &[T], &[T]) + Sync) -> Vec<T> {
    let len = x.len();
    let mut out = Vec::with_capacity(len);
    out.spare_capacity_mut()[..len].par_chunks_mut(GRAIN).enumerate().for_each(|(t, o)| {
        let at = t * GRAIN;
        let gs = g.map_or(&[][..], |g| &g[at..at + o.len()]);
        f(o, &x[at..at + o.len()], gs)
    });
    // SAFETY: the chunks cover the first `len` elements and each `f` writes all of its chunk
    // (the GELU passes below write every element of `o`).
    unsafe { out.set_len(len) };
    out
}

/// GELU of every element, in parallel, at `level`, in one pass (`crate::vmath` for f32).
fn gelu_kernel<T: Float>(x: &[T], level: SimdPlan) -> Vec<T> {
    elementwise(x, None, |o, xs, _| T::gelu_into(level, o, xs))
}

/// The GELU's input gradient `g · GELU'(x)`, in parallel, at `level`, in one pass with one
/// exponential per element (erf's tail and the normal density share it).
fn gelu_grad_kernel<T: Float>(x: &[T], g: &[T], level: SimdPlan) -> Vec<T> {
    elementwise(x, Some(g), |o, xs, gs| T::gelu_grad_into(level, o, xs, gs))
}

struct Gelu;

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "allgrad-gelu-erf"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let level = crate::simd::for_kernel()?;
        let out = float_kernel!("gelu_erf", s => x; gelu_kernel(&contiguous(x, l), level));
        Ok((out, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::gelu(s, l)
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        let _timer = crate::trace::OpTimer::start("gelu", crate::trace::Pass::Backward, x.device());
        Ok(Some(dense(&x.detach())?.apply_op2_no_bwd(&dense(&g.detach().to_dtype(x.dtype())?)?, &GeluGrad)?))
    }
}

/// The GELU backward's kernel as an untracked op on (x, g).
struct GeluGrad;

impl CustomOp2 for GeluGrad {
    fn name(&self) -> &'static str {
        "allgrad-gelu-erf-backward"
    }

    fn cpu_fwd(&self, sx: &CpuStorage, lx: &Layout, sg: &CpuStorage, lg: &Layout) -> Result<(CpuStorage, Shape)> {
        let level = crate::simd::for_kernel()?;
        let out = float_kernel!("gelu_erf backward", sx => x, sg => g; {
            let (x, g): (Cow<[_]>, Cow<[_]>) = (contiguous(x, lx), contiguous(g, lg));
            gelu_grad_kernel(&x, &g, level)
        });
        Ok((out, lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sx: &candle_core::CudaStorage,
        lx: &Layout,
        sg: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::gelu_backward(sx, lx, sg, lg)
    }
}

/// GELU in its exact form, `x/2 · (1 + erf(x/√2))`, fused and parallel on the CPU (f32/f64/
/// bf16) and one kernel on CUDA (feature `cuda`), with an exact one-pass backward; see the
/// module docs. Elsewhere the same formula composed from Candle's `erf`, whose backward is
/// exact.
pub fn gelu_erf(x: &Tensor) -> Result<Tensor> {
    let _timer = crate::trace::OpTimer::start("gelu", crate::trace::Pass::Forward, x.device());
    if !fused_float(x) {
        return gelu_erf_composed(x);
    }
    dense(x)?.apply_op1(Gelu)
}

/// [`gelu_erf`] composed from Candle's differentiable ops (`erf`, whose backward is exact): the
/// path for other devices and dtypes, and the fused kernels' reference.
pub fn gelu_erf_composed(x: &Tensor) -> Result<Tensor> {
    let half = x.affine(0.5, 0.0)?;
    half * x.affine(std::f64::consts::FRAC_1_SQRT_2, 0.0)?.erf()?.affine(1.0, 1.0)?
}

/// `max(x, 0)`, fused and parallel on the CPU (f32/f64/bf16) and one kernel on CUDA (feature
/// `cuda`), with a one-pass backward (derivative 0 at 0) that keeps only the output; Candle's
/// `relu` elsewhere.
pub fn relu(x: &Tensor) -> Result<Tensor> {
    let _timer = crate::trace::OpTimer::start("relu", crate::trace::Pass::Forward, x.device());
    if !fused_float(x) {
        return x.relu();
    }
    dense(x)?.apply_op1(Relu)
}

/// PyTorch's `nn.PReLU(C)`: `max(x, 0) + a_c · min(x, 0)` with one slope `a_c` per channel
/// (dim 1 of `[N, C]` or `[N, C, ...]`), composed from [`relu`] and broadcast products (no fused
/// kernel: the face backbones that use it spend their time in the convolutions), so its
/// backward is that of the composition: `∂/∂x` is 1 or `a_c`, `∂/∂a_c` sums `min(x, 0)`. The
/// slopes are cast to `x`'s dtype (f32 slopes on bf16 activations under autocast, with an f32
/// gradient).
///
/// # Errors
/// When `x` has fewer than 2 dims or `a` is not `[C]`.
pub fn prelu(x: &Tensor, a: &Tensor) -> Result<Tensor> {
    let c = if x.rank() >= 2 { x.dim(1)? } else { 0 };
    if a.dims() != [c] {
        return fail(NnError::ShapeMismatch { op: "prelu", shapes: vec![x.shape().clone(), a.shape().clone()] });
    }
    let mut shape = vec![1; x.rank()];
    shape[1] = c;
    let pos = relu(x)?;
    let neg = (x - &pos)?;
    pos + neg.broadcast_mul(&a.to_dtype(x.dtype())?.reshape(shape)?)?
}

/// `max(a + b, 0)` in one pass (a residual connection and its activation; one kernel on CUDA
/// with feature `cuda`), with a one-pass backward giving both inputs the same gradient;
/// `(a + b).relu()` off the fast path.
///
/// # Errors
/// When `a` and `b` differ in shape or dtype.
pub fn add_relu(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let _timer = crate::trace::OpTimer::start("relu", crate::trace::Pass::Forward, a.device());
    if a.dims() != b.dims() {
        return fail(NnError::ShapeMismatch { op: "add_relu", shapes: vec![a.shape().clone(), b.shape().clone()] });
    }
    if a.dtype() != b.dtype() {
        return fail(NnError::DTypeMismatch { op: "add_relu", what: "a and b", dtypes: vec![a.dtype(), b.dtype()] });
    }
    if !fused_float(a) || !b.device().same_device(a.device()) {
        return (a + b)?.relu();
    }
    dense(a)?.apply_op2(&dense(b)?, AddRelu)
}
