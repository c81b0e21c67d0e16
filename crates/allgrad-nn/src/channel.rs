//! Per-channel kernels for batch normalisation on `[N, C, ...]` tensors.
//!
//! Batch norm written with Candle's broadcast ops spends most of a CPU training step in
//! reductions over strided dims (the backward of every broadcast) and in temporaries. These
//! two fused ops make it two passes over the activations forward and two backward:
//!
//! - [`channel_moments`]: per-channel `Σx` and `Σx²` as a `[2, C]` f64 tensor (so long f32
//!   sums lose no precision, nor the variance computed from them); backward `dx = g₀[c] + 2·x·g₁[c]`.
//! - [`channel_affine`]: `y = a[c]·x + b[c]`; backward `dx = a[c]·g`, `da[c] = Σ g·x`,
//!   `db[c] = Σ g` (again accumulated in f64).
//!
//! Everything in between (means, variances, scales) acts on `[C]` tensors and is cheap to
//! differentiate with ordinary Candle ops. [`channel_moments`] is one kernel on CUDA too
//! (feature `cuda`). On other devices and for dtypes other than f32/f64/bf16 (and for
//! [`channel_affine`] on CUDA) the ops fall back to compositions of differentiable Candle ops.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::backend::{cpu_float, fused_float};
use crate::cpu::{contiguous, float_kernel, widen, zeros, Float};
use crate::error::{fail, NnError};
use crate::shape::geometry;
use crate::simd::{dispatch, SimdPlan};

/// Independent partial sums per channel: the additions of one f64 chain wait on each other,
/// eight chains keep the pipeline full and let the loop vectorise.
const LANES: usize = 8;

/// Adds `Σ x` and `Σ x·y` (`y = x` when absent) of one run into the lanes, element `i` of the
/// run into lane `i % LANES`.
#[inline(always)]
fn accumulate<T: Float>(s1: &mut [f64; LANES], s2: &mut [f64; LANES], xs: &[T], ys: Option<&[T]>) {
    let full = xs.len() / LANES * LANES;
    match ys {
        None => {
            for chunk in xs[..full].chunks_exact(LANES) {
                for j in 0..LANES {
                    let v = chunk[j].to_f64();
                    s1[j] += v;
                    s2[j] += v * v;
                }
            }
            for (j, v) in xs[full..].iter().enumerate() {
                let v = v.to_f64();
                s1[j] += v;
                s2[j] += v * v;
            }
        }
        Some(ys) => {
            for (cx, cy) in xs[..full].chunks_exact(LANES).zip(ys[..full].chunks_exact(LANES)) {
                for j in 0..LANES {
                    let v = cx[j].to_f64();
                    s1[j] += v;
                    s2[j] += v * cy[j].to_f64();
                }
            }
            for (j, (v, w)) in xs[full..].iter().zip(&ys[full..]).enumerate() {
                s1[j] += v.to_f64();
                s2[j] += v.to_f64() * w.to_f64();
            }
        }
    }
}

/// Per channel, `(Σ x, Σ x·y)` over all `n` images (`y = x` for moments), in f64; each channel
/// is summed by one task in a fixed order (lanes, then the lanes in order), so the result does
/// not depend on scheduling; in `plan`'s copies ([`crate::simd`]), which give the same bits.
fn per_channel<T: Float>(plan: SimdPlan, x: &[T], y: Option<&[T]>, n: usize, c: usize, inner: usize) -> Vec<(f64, f64)> {
    let dims = (n, c, inner);
    (0..c)
        .into_par_iter()
        .map(|ch| {
            dispatch!(
                plan,
                fn sum<T: Float>(x: &[T], y: Option<&[T]>, dims: (usize, usize, usize), ch: usize) -> (f64, f64) {
                    channel(x, y, dims, ch)
                }
            )
        })
        .collect()
}

/// `(Σ x, Σ x·y)` of channel `ch`.
#[inline(always)]
fn channel<T: Float>(x: &[T], y: Option<&[T]>, (n, c, inner): (usize, usize, usize), ch: usize) -> (f64, f64) {
    let (mut s1, mut s2) = ([0f64; LANES], [0f64; LANES]);
    for img in 0..n {
        let off = (img * c + ch) * inner;
        accumulate(&mut s1, &mut s2, &x[off..off + inner], y.map(|y| &y[off..off + inner]));
    }
    (s1.iter().sum(), s2.iter().sum())
}

struct Moments;

impl CustomOp1 for Moments {
    fn name(&self) -> &'static str {
        "allgrad-channel-moments"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, c, inner) = geometry(l.dims(), "channel_moments")?;
        let plan = crate::simd::for_kernel()?;
        fn run<T: Float>(plan: SimdPlan, x: &[T], n: usize, c: usize, inner: usize) -> Vec<f64> {
            let sums = per_channel(plan, x, None, n, c, inner);
            sums.iter().map(|s| s.0).chain(sums.iter().map(|s| s.1)).collect()
        }
        // The sums are f64 whatever the input's dtype (see `channel_moments`).
        let out = match s {
            CpuStorage::F32(v) => CpuStorage::F64(run(plan, &contiguous(v, l), n, c, inner)),
            CpuStorage::F64(v) => CpuStorage::F64(run(plan, &contiguous(v, l), n, c, inner)),
            CpuStorage::BF16(v) => CpuStorage::F64(run(plan, &widen(&contiguous(v, l)), n, c, inner)),
            _ => return fail(NnError::UnsupportedDType { op: "channel_moments", dtype: s.dtype() }),
        };
        Ok((out, Shape::from((2, c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::channel_moments(s, l)
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        // d/dx (Σx·g₀ + Σx²·g₁) = g₀ + 2x·g₁, per channel.
        let g = g.to_dtype(x.dtype())?;
        let g0 = g.get(0)?;
        let g1 = (g.get(1)? * 2.0)?;
        Ok(Some(channel_affine(&x.detach(), &g1, &g0)?.detach()))
    }
}

/// Per-channel `[Σx, Σx²]` of an `[N, C, ...]` tensor, as a `[2, C]` f64 tensor (whatever
/// the input's dtype: `Σx²/n − mean²` cancels digits when the mean is large beside the
/// deviation, and f32 moments would leave that difference to f32 rounding); see the module
/// docs. One pass on the CPU and one kernel on CUDA (feature `cuda`).
pub fn channel_moments(x: &Tensor) -> Result<Tensor> {
    let (_, c, _) = geometry(x.dims(), "channel_moments")?;
    if fused_float(x) {
        return x.contiguous()?.apply_op1(Moments);
    }
    let flat = x.transpose(0, 1)?.contiguous()?.reshape((c, ()))?.to_dtype(DType::F64)?;
    Tensor::stack(&[flat.sum(1)?, flat.sqr()?.sum(1)?], 0)
}

struct Affine;

impl CustomOp3 for Affine {
    fn name(&self) -> &'static str {
        "allgrad-channel-affine"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sa: &CpuStorage,
        la: &Layout,
        sb: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, c, inner) = geometry(lx.dims(), "channel_affine")?;
        fn run<T: Float>(x: &[T], a: &[T], b: &[T], c: usize, inner: usize) -> Vec<T> {
            let mut out = zeros(x.len());
            out.par_chunks_mut(inner.max(1)).zip(x.par_chunks(inner.max(1))).enumerate().for_each(|(row, (o, xs))| {
                let ch = row % c;
                let (s, t) = (a[ch], b[ch]);
                for (o, v) in o.iter_mut().zip(xs) {
                    *o = *v * s + t;
                }
            });
            out
        }
        let out = float_kernel!("channel_affine", sx => x, sa => a, sb => b;
            run(&contiguous(x, lx), &contiguous(a, la), &contiguous(b, lb), c, inner));
        Ok((out, lx.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        a: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let g = g.contiguous()?;
        let dx = channel_affine(&g, a, &a.zeros_like()?)?.detach();
        // db[c] = Σ g, da[c] = Σ g·x: one parallel pass over the native slices, summed in f64.
        let sums = g.apply_op2_no_bwd(&x.detach().contiguous()?, &GradDots)?;
        let db = sums.get(0)?.to_dtype(x.dtype())?;
        let da = sums.get(1)?.to_dtype(x.dtype())?;
        Ok((Some(dx), Some(da), Some(db)))
    }
}

/// Per channel `[Σ g, Σ g·x]` of two `[N, C, ...]` tensors as a `[2, C]` f64 tensor: the
/// parameter gradients of [`channel_affine`].
struct GradDots;

impl CustomOp2 for GradDots {
    fn name(&self) -> &'static str {
        "allgrad-channel-grad-dots"
    }

    fn cpu_fwd(&self, sg: &CpuStorage, lg: &Layout, sx: &CpuStorage, lx: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, c, inner) = geometry(lg.dims(), "channel_affine backward")?;
        let plan = crate::simd::for_kernel()?;
        fn run<T: Float>(plan: SimdPlan, g: &[T], x: &[T], n: usize, c: usize, inner: usize) -> Vec<f64> {
            let sums = per_channel(plan, g, Some(x), n, c, inner);
            sums.iter().map(|s| s.0).chain(sums.iter().map(|s| s.1)).collect()
        }
        let out = match (sg, sx) {
            (CpuStorage::F32(g), CpuStorage::F32(x)) => run(plan, &contiguous(g, lg), &contiguous(x, lx), n, c, inner),
            (CpuStorage::F64(g), CpuStorage::F64(x)) => run(plan, &contiguous(g, lg), &contiguous(x, lx), n, c, inner),
            (CpuStorage::BF16(g), CpuStorage::BF16(x)) => {
                run(plan, &widen(&contiguous(g, lg)), &widen(&contiguous(x, lx)), n, c, inner)
            }
            _ => return fail(NnError::UnsupportedDType { op: "channel_affine backward", dtype: sg.dtype() }),
        };
        Ok((CpuStorage::F64(out), Shape::from((2, c))))
    }
}

/// `y = a[c]·x + b[c]` for an `[N, C, ...]` tensor `x` and `[C]` tensors `a`, `b`; see the
/// module docs.
pub fn channel_affine(x: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (_, c, _) = geometry(x.dims(), "channel_affine")?;
    if a.dims() != [c] || b.dims() != [c] {
        return fail(NnError::ParamShape {
            op: "channel_affine",
            what: "a and b",
            shape: vec![a.shape().clone(), b.shape().clone()],
            expected: format!("x has {c} channels"),
        });
    }
    if cpu_float(x) && a.dtype() == x.dtype() && b.dtype() == x.dtype() {
        return x.contiguous()?.apply_op3(&a.contiguous()?, &b.contiguous()?, Affine);
    }
    let shape: Vec<usize> = (0..x.rank()).map(|d| if d == 1 { c } else { 1 }).collect();
    x.broadcast_mul(&a.reshape(shape.as_slice())?)?.broadcast_add(&b.reshape(shape.as_slice())?)
}
