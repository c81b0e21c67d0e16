//! Layer normalisation over the last dimension, differentiable in the input, the scale and the
//! shift. (`candle_nn::LayerNorm` on a contiguous input uses a custom op without backward, so
//! gradients silently stop there.)
//!
//! On the CPU each row's sums are kept in 16 partial sums, so that the loops vectorise (with
//! AVX-512, AVX2 or SSE2, `crate::simd`) and give the same bits on every path.

use std::mem::MaybeUninit;

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Module, Result, Shape, Tensor, D};
use rayon::prelude::*;

use crate::backend::{cpu_float, cuda_float, dense};
use crate::cpu::{contiguous, float_kernel, fold, lane_sum, run_split, zeros, Float, SplitKernel};
use crate::error::{fail, NnError};
use crate::simd::{dispatch, SimdPlan, LANES};

/// `y = (x - mean) / sqrt(var + eps) * gamma + beta` over the last dimension of `x`, with the
/// biased variance (as PyTorch's `layer_norm`). `gamma` and `beta` have shape `(d,)` where `d`
/// is the last dimension of `x`.
///
/// On the CPU with f32/f64 the forward and the backward are fused kernels, parallel over rows;
/// the backward returns ∂x, ∂gamma and ∂beta. On CUDA (feature `cuda`) with f32/f64 they are
/// CUDA kernels (one block per row; `ALLGRAD_CUDA_FUSED=0` turns them off). Elsewhere this is
/// a composition of differentiable Candle ops (computed in f32 for f16/bf16 inputs).
///
/// # Errors
/// When `x` has rank 0, `gamma` or `beta` are not `(d,)`, or the dtypes differ.
pub fn layer_norm(x: &Tensor, gamma: &Tensor, beta: &Tensor, eps: f64) -> Result<Tensor> {
    let _timer = crate::trace::OpTimer::start("layer_norm", crate::trace::Pass::Forward, x.device());
    let d = match x.dims().last() {
        Some(&d) => d,
        None => {
            return fail(NnError::InputRank {
                op: "layer_norm",
                expected: "a tensor of rank 1 or more, not a scalar",
                shape: x.shape().clone(),
            })
        }
    };
    if gamma.dims() != [d] || beta.dims() != [d] {
        return fail(NnError::ParamShape {
            op: "layer_norm",
            what: "gamma and beta",
            shape: vec![gamma.shape().clone(), beta.shape().clone()],
            expected: format!("both must be ({d},), the last dimension of the input {:?}", x.shape()),
        });
    }
    if x.dtype() == DType::BF16 && gamma.dtype() == DType::F32 && beta.dtype() == DType::F32 {
        // A bf16 input with f32 parameters (autocast): normalised in f32, rounded back.
        return layer_norm(&x.to_dtype(DType::F32)?, gamma, beta, eps)?.to_dtype(DType::BF16);
    }
    if gamma.dtype() != x.dtype() || beta.dtype() != x.dtype() {
        return fail(NnError::DTypeMismatch {
            op: "layer_norm",
            what: "input, gamma and beta",
            dtypes: vec![x.dtype(), gamma.dtype(), beta.dtype()],
        });
    }
    if eps.is_nan() || eps < 0.0 {
        return fail(NnError::NegativeEps { eps });
    }
    if cpu_float(x) {
        x.apply_op3(gamma, beta, LayerNormOp { eps })
    } else if cuda_float(x) && matches!(x.dtype(), DType::F32 | DType::F64) {
        dense(x)?.apply_op3(&dense(gamma)?, &dense(beta)?, LayerNormOp { eps })
    } else {
        layer_norm_composed(x, gamma, beta, eps)
    }
}

/// The same function as [`layer_norm`] written with differentiable Candle ops (used off the
/// CPU, and as a reference in tests and benchmarks).
///
/// # Errors
/// As Candle's ops on mismatched shapes.
pub fn layer_norm_composed(x: &Tensor, gamma: &Tensor, beta: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let work = match dtype {
        DType::F16 | DType::BF16 => DType::F32,
        d => d,
    };
    let x = x.to_dtype(work)?;
    let xc = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    let xhat = xc.broadcast_div(&(var + eps)?.sqrt()?)?;
    xhat.to_dtype(dtype)?.broadcast_mul(gamma)?.broadcast_add(beta)
}

/// The configuration of a [`LayerNorm`] built with [`LayerNorm::from_vb`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerNormConfig {
    /// Added to the variance before the square root (non-negative).
    pub eps: f64,
}

impl Default for LayerNormConfig {
    fn default() -> Self {
        Self { eps: 1e-5 }
    }
}

/// A layer-norm layer over the last dimension: scale, shift and epsilon, applied with
/// [`layer_norm`].
#[derive(Clone, Debug)]
pub struct LayerNorm {
    gamma: Tensor,
    beta: Tensor,
    eps: f64,
}

impl LayerNorm {
    /// A layer from its scale `gamma (d,)` and shift `beta (d,)`.
    ///
    /// # Errors
    /// When `gamma` and `beta` are not both `(d,)` for the same `d`.
    pub fn new(gamma: Tensor, beta: Tensor, eps: f64) -> Result<Self> {
        if gamma.rank() != 1 || gamma.dims() != beta.dims() {
            return fail(NnError::ParamShape {
                op: "LayerNorm",
                what: "gamma and beta",
                shape: vec![gamma.shape().clone(), beta.shape().clone()],
                expected: "both must be (d,)".into(),
            });
        }
        Ok(Self { gamma, beta, eps })
    }

    /// A layer over `d` features with its parameters created through `vb` (as
    /// `candle_nn::layer_norm`): `weight` (the scale) starting at 1 and `bias` (the shift) at 0.
    ///
    /// # Errors
    /// When `cfg.eps` is negative or NaN, or `vb` fails.
    pub fn from_vb(d: usize, cfg: LayerNormConfig, vb: candle_nn::VarBuilder) -> Result<Self> {
        if cfg.eps.is_nan() || cfg.eps < 0.0 {
            return fail(NnError::NegativeEps { eps: cfg.eps });
        }
        let gamma = vb.get_with_hints(d, "weight", candle_nn::Init::Const(1.0))?;
        let beta = vb.get_with_hints(d, "bias", candle_nn::Init::Const(0.0))?;
        Self::new(gamma, beta, cfg.eps)
    }

    /// The scale, `(d,)`.
    pub fn gamma(&self) -> &Tensor {
        &self.gamma
    }

    /// The shift, `(d,)`.
    pub fn beta(&self) -> &Tensor {
        &self.beta
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        layer_norm(x, &self.gamma, &self.beta, self.eps)
    }
}

struct LayerNormOp {
    eps: f64,
}

/// The backward kernel: inputs `(x, gamma, grad)`, outputs `[∂x, ∂gamma, ∂beta]`.
struct LayerNormBackward {
    eps: f64,
}

/// Rows per parallel task, so that each task has some work.
fn rows_per_task(d: usize) -> usize {
    (16384 / d.max(1)).max(1)
}

impl CustomOp3 for LayerNormOp {
    fn name(&self) -> &'static str {
        "allgrad-layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let level = crate::simd::for_kernel()?;
        let out = float_kernel!("layer_norm", s1 => x, s2 => g, s3 => b;
            ln_fwd(&contiguous(x, l1), &contiguous(g, l2), &contiguous(b, l3), self.eps, level));
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::layer_norm(s1, l1, (s2, l2), (s3, l3), self.eps)
    }

    fn bwd(
        &self,
        x: &Tensor,
        gamma: &Tensor,
        beta: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let _timer = crate::trace::OpTimer::start("layer_norm", crate::trace::Pass::Backward, x.device());
        let kernel = LayerNormBackward { eps: self.eps };
        let (dx, dgamma, dbeta) = if x.device().is_cuda() {
            // One flat [∂x; ∂gamma; ∂beta] from the CUDA kernels.
            let (rows_d, d) = (x.elem_count(), gamma.elem_count());
            let grad = grad.to_dtype(x.dtype())?.contiguous()?;
            let flat = x.detach().apply_op3_no_bwd(&gamma.detach(), &grad, &kernel)?;
            (flat.narrow(0, 0, rows_d)?.reshape(x.shape())?, flat.narrow(0, rows_d, d)?, flat.narrow(0, rows_d + d, d)?)
        } else {
            let shapes = [x.shape().clone(), gamma.shape().clone(), gamma.shape().clone()];
            let grads = run_split(&kernel, [x, gamma, grad], &shapes)?;
            let Ok([dx, dgamma, dbeta]) = <[Tensor; 3]>::try_from(grads) else { unreachable!("three shapes, three gradients") };
            (dx, dgamma, dbeta)
        };
        Ok((x.track_op().then_some(dx), gamma.track_op().then_some(dgamma), beta.track_op().then_some(dbeta)))
    }
}

/// On CUDA the backward's kernels write the flat `[∂x; ∂gamma; ∂beta]` (on the CPU the
/// backward runs through `run_split`).
impl CustomOp3 for LayerNormBackward {
    fn name(&self) -> &'static str {
        "allgrad-layer-norm-backward"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("allgrad-nn internal error: the CPU layer_norm backward runs through `run_split`")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::layer_norm_backward(s1, l1, (s2, l2), (s3, l3), self.eps)
    }
}

impl SplitKernel<3> for LayerNormBackward {
    const OP: &'static str = "layer_norm backward";

    fn run<T: Float>(&self, [(x, lx), (g, lg), (gy, lgy)]: [(&[T], &Layout); 3]) -> Result<Vec<Vec<T>>> {
        let level = crate::simd::for_kernel()?;
        Ok(ln_bwd(&contiguous(x, lx), &contiguous(g, lg), &contiguous(gy, lgy), self.eps, level))
    }
}

/// Mean and `1 / sqrt(var + eps)` of one row (two passes, biased variance), in lane sums.
#[inline(always)]
fn moments<T: Float>(row: &[T], eps: f64) -> (T, T) {
    let d = T::from_f64(row.len() as f64);
    let mean = lane_sum(row, row, |v, _| v) / d;
    let ss = lane_sum(row, row, |v, _| (v - mean) * (v - mean));
    let rstd = T::from_f64(1.0) / (ss / d + T::from_f64(eps)).sqrt();
    (mean, rstd)
}

/// One task's rows of the forward; writes every element of `ys`.
#[inline(always)]
fn ln_fwd_rows<T: Float>(ys: &mut [MaybeUninit<T>], xs: &[T], gamma: &[T], beta: &[T], eps: f64) {
    let d = gamma.len();
    for (yr, xr) in ys.chunks_mut(d).zip(xs.chunks(d)) {
        let (mean, rstd) = moments(xr, eps);
        for (((o, &v), &g), &b) in yr.iter_mut().zip(xr).zip(gamma).zip(beta) {
            o.write((v - mean) * rstd * g + b);
        }
    }
}

fn ln_fwd<T: Float>(x: &[T], gamma: &[T], beta: &[T], eps: f64, level: SimdPlan) -> Vec<T> {
    let d = gamma.len();
    if d == 0 || x.is_empty() {
        return zeros(x.len());
    }
    let rows = rows_per_task(d);
    let mut y = Vec::with_capacity(x.len());
    y.spare_capacity_mut()[..x.len()].par_chunks_mut(rows * d).zip(x.par_chunks(rows * d)).for_each(|(ys, xs)| {
        dispatch!(
            level,
            fn rows<T: Float>(ys: &mut [MaybeUninit<T>], xs: &[T], gamma: &[T], beta: &[T], eps: f64) -> () {
                ln_fwd_rows(ys, xs, gamma, beta, eps)
            }
        )
    });
    // SAFETY: the chunks cover the first `x.len()` elements (whole rows: `x.len()` is a multiple
    // of `d`) and `ln_fwd_rows` writes every element of its chunk.
    unsafe { y.set_len(x.len()) };
    y
}

/// One row's `(Σ ĝ, Σ ĝ·x̂)` with `ĝ = ∂y·gamma`, in [`LANES`] partial sums combined by [`fold`]
/// (the order of [`lane_sum`]), adding its `∂y·x̂` into `dg` and `∂y` into `db` in the same pass.
#[inline(always)]
fn ln_bwd_sums<T: Float>(gr: &[T], xr: &[T], gamma: &[T], (mean, rstd): (T, T), dg: &mut [T], db: &mut [T]) -> (T, T) {
    let zero = T::from_f64(0.0);
    let (mut sa, mut sb) = ([zero; LANES], [zero; LANES]);
    let d = gamma.len();
    let full = d / LANES * LANES;
    let mut step = |at: usize, width: usize| {
        let r = at..at + width;
        let (gc, xc, wc) = (&gr[r.clone()], &xr[r.clone()], &gamma[r.clone()]);
        let (dgc, dbc) = (&mut dg[r.clone()], &mut db[r]);
        for j in 0..width {
            let xhat = (xc[j] - mean) * rstd;
            let gh = gc[j] * wc[j];
            sa[j] += gh;
            sb[j] += gh * xhat;
            dgc[j] += gc[j] * xhat;
            dbc[j] += gc[j];
        }
    };
    for at in (0..full).step_by(LANES) {
        // A constant trip count, so that the lanes vectorise.
        step(at, LANES);
    }
    step(full, d - full);
    (fold(sa), fold(sb))
}

/// One task's rows of the backward: writes every element of `∂x`, adds the rows' `∂gamma` and
/// `∂beta` into `dg` and `db`.
#[inline(always)]
fn ln_bwd_rows<T: Float>(dxs: &mut [MaybeUninit<T>], xs: &[T], gs: &[T], gamma: &[T], eps: f64, dg: &mut [T], db: &mut [T]) {
    let d = gamma.len();
    let inv_d = T::from_f64(1.0 / d as f64);
    for ((dxr, xr), gr) in dxs.chunks_mut(d).zip(xs.chunks(d)).zip(gs.chunks(d)) {
        let (mean, rstd) = moments(xr, eps);
        // a = mean(ĝ), b = mean(ĝ·x̂).
        let (sa, sb) = ln_bwd_sums(gr, xr, gamma, (mean, rstd), dg, db);
        let (a, b) = (sa * inv_d, sb * inv_d);
        for ((o, &g), (&v, &w)) in dxr.iter_mut().zip(gr).zip(xr.iter().zip(gamma)) {
            let xhat = (v - mean) * rstd;
            o.write(rstd * (g * w - a - xhat * b));
        }
    }
}

/// Per row, with `x̂ = (x - mean) · rstd` and `ĝ = ∂y · gamma`:
/// `∂x = rstd · (ĝ - mean(ĝ) - x̂ · mean(ĝ · x̂))`, `∂gamma = Σ_rows ∂y · x̂`, `∂beta = Σ_rows ∂y`.
/// Row blocks accumulate their own ∂gamma/∂beta, summed in block order (deterministic).
fn ln_bwd<T: Float>(x: &[T], gamma: &[T], gy: &[T], eps: f64, level: SimdPlan) -> Vec<Vec<T>> {
    let zero = T::from_f64(0.0);
    let d = gamma.len();
    let (mut dgamma, mut dbeta) = (zeros(d), zeros(d));
    if d == 0 || x.is_empty() {
        return vec![zeros(x.len()), dgamma, dbeta];
    }
    let rows = rows_per_task(d);
    let mut dx = Vec::with_capacity(x.len());
    let parts: Vec<Vec<T>> = dx.spare_capacity_mut()[..x.len()]
        .par_chunks_mut(rows * d)
        .zip(x.par_chunks(rows * d))
        .zip(gy.par_chunks(rows * d))
        .map(|((dxs, xs), gs)| {
            let mut acc = vec![zero; 2 * d];
            let (dg, db) = acc.split_at_mut(d);
            dispatch!(
                level,
                fn rows<T: Float>(
                    dxs: &mut [MaybeUninit<T>],
                    xs: &[T],
                    gs: &[T],
                    gamma: &[T],
                    eps: f64,
                    dg: &mut [T],
                    db: &mut [T],
                ) -> () {
                    ln_bwd_rows(dxs, xs, gs, gamma, eps, dg, db)
                }
            );
            acc
        })
        .collect();
    // SAFETY: the chunks cover the first `x.len()` elements (whole rows) and `ln_bwd_rows`
    // writes every element of its chunk.
    unsafe { dx.set_len(x.len()) };
    for part in parts {
        for (o, v) in dgamma.iter_mut().chain(dbeta.iter_mut()).zip(&part) {
            *o += *v;
        }
    }
    vec![dx, dgamma, dbeta]
}
