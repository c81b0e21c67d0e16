//! Batch normalisation as one fused CPU op, with the ReLU, or the residual `relu(· + skip)`,
//! that follows it in a ResNet folded in, or a residual whose shortcut is itself batch
//! normalised (`relu(bn(x) + bn'(x'))`, a ResNet's downsampling shortcut).
//!
//! Composed from [`crate::channel_moments`], [`crate::channel_affine`] and a separate ReLU, a
//! training step's batch norm makes three passes over the activation forward (statistics,
//! affine, activation) and about six backward: the activation's mask, the affine's `∂x` and its
//! `∂γ, ∂β` sums, the moments' `∂x`, and Candle's single-threaded sum of the two `∂x` paths.
//! [`batch_norm`] takes the statistics from the caller (who may have summed them over ranks) and
//! differentiates the whole layer in closed form, in two passes: the per-channel sums, then `∂x`.
//!
//! With batch statistics `μ`, `σ² ` (biased, over `N` values per channel), `a = γ/σ`,
//! `x̂ = (x − μ)/σ`, `y = tail(a·x + β − μ·a)` and `g' = ∂L/∂y` masked by `[y > 0]` when the
//! tail has a ReLU (the derivative at 0 is 0, as in [`crate::relu`]):
//!
//! ```text
//! ∂x = a·(g' − Σg'/N − x̂·Σ(g'·x̂)/N)      ∂γ = Σ g'·x̂      ∂β = Σ g'      ∂skip = g'
//! ```
//!
//! With a normalised shortcut ([`BnTail::AddBnRelu`]) `y = max(a·x + b + a'·x' + b', 0)`, and each
//! branch gets its `∂x` by the formula above with its own `a`, `x̂` and sums, from the one masked
//! `g'`. Only the two inputs and `y` are kept for the backward: the shortcut's normalised values,
//! which a separate batch norm would keep as its output, are never stored.
//!
//! The sums in `∂x` run over the same values as the statistics: with SyncBatchNorm, over every
//! rank's batch. The caller's [`ChannelSum`] sums the two per-channel partial sums over ranks
//! between the passes (an all_reduce): the sum rule, the same gradient the backward of a
//! differentiable all_reduce of the moments gives. `∂γ` and `∂β` are this rank's own sums (the
//! trainer averages parameter gradients over ranks). With fixed statistics (evaluation with
//! running statistics) the statistics are constants and `∂x = a·g'`.
//!
//! Sums are accumulated in f64 per channel in a fixed order, so results do not depend on
//! scheduling.
//!
//! On CUDA (feature `cuda`) the same op runs as CUDA kernels (`crate::cuda`): the forward is
//! one kernel, the backward one kernel for the per-channel sums (copied to the host, where the
//! coefficients are computed by the same code as on the CPU and summed over ranks), one for
//! `∂x` and, with a skip input, the ReLU's backward kernel for `∂skip`. It saves the same
//! tensors as on the CPU.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::channel::geometry;
use crate::cpu::{contiguous, float_kernel, fused_float, has_avx2, run_split_keeping_f32, zeros, Float, SplitKernel, GRAIN};
use crate::error::{fail, NnError};

/// Sums per-channel f64 partial sums over the ranks that share the batch statistics, in place
/// (an all_reduce with `Sum`); called once per backward of a synchronised [`batch_norm`], on
/// every rank in the same order.
pub type ChannelSum = Arc<dyn Fn(&mut [f64]) -> Result<()> + Send + Sync>;

/// The statistics a [`batch_norm`] normalises with, one value per channel.
#[derive(Clone)]
pub enum BnStats {
    /// The batch's own mean and biased variance over `count` values per channel (every rank's
    /// values with SyncBatchNorm). They are differentiated: `sum_over_ranks` sums the backward's
    /// per-channel sums over the ranks the statistics were summed over (`None`: this rank only).
    Batch {
        /// Mean per channel.
        mean: Vec<f64>,
        /// Biased variance per channel.
        var: Vec<f64>,
        /// Values per channel the statistics were taken over.
        count: f64,
        /// The cross-rank sum of the backward (see [`ChannelSum`]).
        sum_over_ranks: Option<ChannelSum>,
    },
    /// Constant statistics (the running ones, in evaluation).
    Fixed {
        /// Mean per channel.
        mean: Vec<f64>,
        /// Variance per channel.
        var: Vec<f64>,
    },
}

/// What follows the normalisation inside [`batch_norm`].
#[derive(Clone, Copy, Debug)]
pub enum BnTail<'a> {
    /// Nothing: `y = γ·x̂ + β`.
    Identity,
    /// `y = max(γ·x̂ + β, 0)`.
    Relu,
    /// `y = max(γ·x̂ + β + skip, 0)`: a residual connection and its activation.
    AddRelu(&'a Tensor),
    /// `y = max(γ·x̂ + β + γ'·x̂' + β', 0)`: a residual connection whose shortcut is itself batch
    /// normalised (`x̂'` from the [`BnBranch`]'s input and statistics), fused so that the
    /// shortcut's normalised values are never stored.
    AddBnRelu(&'a BnBranch<'a>),
}

/// The normalised shortcut of [`BnTail::AddBnRelu`]: its input (shaped like the main input),
/// its per-channel `weight` (γ') and `bias` (β'), its statistics and its eps, with the same
/// rules as [`batch_norm`]'s own.
#[derive(Clone, Copy)]
pub struct BnBranch<'a> {
    /// The shortcut's input, `[N, C, ...]` like the main input.
    pub x: &'a Tensor,
    /// γ', one per channel.
    pub weight: &'a Tensor,
    /// β', one per channel.
    pub bias: &'a Tensor,
    /// The shortcut's statistics (its backward sums go through their own `sum_over_ranks`).
    pub stats: &'a BnStats,
    /// Added to the shortcut's variance.
    pub eps: f64,
}

impl std::fmt::Debug for BnBranch<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BnBranch").field("x", &self.x.shape()).field("eps", &self.eps).finish_non_exhaustive()
    }
}

/// One normalisation's resolved constants.
struct Norm {
    mean: Vec<f64>,
    inv_std: Vec<f64>,
    /// `a = γ/σ` and `b = β − μ·a` per channel, in f64.
    scale: Vec<f64>,
    shift: Vec<f64>,
    /// Batch statistics: the count and the cross-rank sum.
    batch: Option<(f64, Option<ChannelSum>)>,
}

/// The resolved constants of one call, shared by its forward and backward ops.
struct Plan {
    c: usize,
    main: Norm,
    /// The normalised shortcut of [`BnTail::AddBnRelu`].
    branch: Option<Norm>,
    relu: bool,
    /// A plain skip input ([`BnTail::AddRelu`]).
    skip: bool,
    /// bf16 activations: each normalisation's output is rounded to bf16 before a residual sum,
    /// as an unfused bf16 batch norm stores it (then the sum is rounded, as a bf16 addition).
    round_bf16: bool,
}

#[cfg(feature = "cuda")]
impl Plan {
    /// The CUDA forward kernel's description of this plan.
    fn cuda_forward(&self) -> crate::cuda::BnForward<'_> {
        let mode = match (&self.branch, self.skip, self.relu) {
            (Some(_), _, _) => 3,
            (None, true, _) => 2,
            (None, false, true) => 1,
            (None, false, false) => 0,
        };
        crate::cuda::BnForward {
            ab: (&self.main.scale, &self.main.shift),
            branch: self.branch.as_ref().map(|b| (b.scale.as_slice(), b.shift.as_slice())),
            mode,
        }
    }
}

fn stats_error<T>(what: String) -> Result<T> {
    fail(NnError::BatchNormStats { what })
}

/// Batch normalisation of `x` (`[N, C, ...]`) with per-channel `weight` (γ) and `bias` (β),
/// normalised by `stats` with `eps` added to the variance, followed by `tail`; fused and
/// parallel on the CPU for f32/f64 (and CUDA kernels with feature `cuda`), with the closed-form backward of the module docs (for
/// `x`, `weight`, `bias` and the skip input, or the shortcut's input and parameters). A bf16
/// `x` (autocast) takes f32 `weight` and `bias`: computed in f32, the output and `∂x` rounded
/// to bf16, `∂γ` and `∂β` f32.
///
/// `y = tail(a·x + b)` with `a = γ/sqrt(var + eps)` and `b = β − mean·a` computed in f64 and
/// rounded to `x`'s dtype: the same arithmetic as `channel_affine(x, a, b)`. With
/// [`BnTail::AddBnRelu`] the shortcut's `a'·x' + b'` is rounded the same way and added, so the
/// result equals a separate batch norm of the shortcut followed by [`BnTail::AddRelu`].
///
/// # Errors
/// When `x` is not `[N, C, ...]`, `weight`, `bias` or the statistics are not one per channel,
/// the skip or shortcut input is not shaped like `x`, the dtypes differ, `eps` is negative, the
/// count is not positive, or `x` is not an f32/f64/bf16 tensor on a device with the fused
/// kernels ([`crate::has_fused_kernels`]; [`NnError::BatchNormOffCpu`]: compose
/// [`crate::channel_moments`] and [`crate::channel_affine`] there).
pub fn batch_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, stats: &BnStats, eps: f64, tail: BnTail) -> Result<Tensor> {
    let (_, c, _) = geometry(x.dims(), "batch_norm")?;
    if !fused_float(x) {
        return fail(NnError::BatchNormOffCpu { dtype: x.dtype(), device: format!("{:?}", x.device().location()) });
    }
    let main = resolve(x, c, weight, bias, stats, eps)?;
    let third = match tail {
        BnTail::AddRelu(s) => Some(check_like_x(x, s, "batch_norm (skip)")?),
        BnTail::AddBnRelu(b) => Some(check_like_x(x, b.x, "batch_norm (shortcut)")?),
        _ => None,
    };
    let branch = match tail {
        BnTail::AddBnRelu(b) => Some(resolve(x, c, b.weight, b.bias, b.stats, b.eps)?),
        _ => None,
    };
    let plan = Arc::new(Plan {
        c,
        main,
        branch,
        relu: !matches!(tail, BnTail::Identity),
        skip: matches!(tail, BnTail::AddRelu(_)),
        round_bf16: x.dtype() == DType::BF16,
    });
    // The parameters travel as one [2, C] input ([4, C] with a shortcut: γ, β, γ', β') so
    // that one op returns all their gradients.
    let gb = match tail {
        BnTail::AddBnRelu(b) => Tensor::stack(&[weight, bias, b.weight, b.bias], 0)?,
        _ => Tensor::stack(&[weight, bias], 0)?,
    };
    let x = x.contiguous()?;
    match third {
        None => x.apply_op2(&gb, Forward(plan)),
        Some(t) => x.apply_op3(&gb, &t.contiguous()?, ForwardSkip(plan)),
    }
}

/// `t` (a skip or shortcut input) checked against `x`: same shape, dtype and device.
fn check_like_x<'a>(x: &Tensor, t: &'a Tensor, op: &'static str) -> Result<&'a Tensor> {
    if t.dims() != x.dims() {
        return fail(NnError::ShapeMismatch { op, shapes: vec![x.shape().clone(), t.shape().clone()] });
    }
    if t.dtype() != x.dtype() {
        return fail(NnError::DTypeMismatch { op: "batch_norm", what: "x and skip", dtypes: vec![x.dtype(), t.dtype()] });
    }
    if !t.device().same_device(x.device()) {
        return fail(NnError::DeviceMismatch { op: "batch_norm" });
    }
    Ok(t)
}

/// One normalisation's parameters and statistics checked against `c` channels of `x`, and its
/// constants.
fn resolve(x: &Tensor, c: usize, weight: &Tensor, bias: &Tensor, stats: &BnStats, eps: f64) -> Result<Norm> {
    if weight.dims() != [c] || bias.dims() != [c] {
        return fail(NnError::ParamShape {
            op: "batch_norm",
            what: "weight and bias",
            shape: vec![weight.shape().clone(), bias.shape().clone()],
            expected: format!("x has {c} channels"),
        });
    }
    // bf16 activations (autocast) are normalised with the f32 parameters.
    let fits = |d: DType| d == x.dtype() || (x.dtype() == DType::BF16 && d == DType::F32);
    if !(fits(weight.dtype()) && bias.dtype() == weight.dtype()) {
        let dtypes = vec![x.dtype(), weight.dtype(), bias.dtype()];
        return fail(NnError::DTypeMismatch { op: "batch_norm", what: "x, weight and bias", dtypes });
    }
    if !(eps >= 0.0 && eps.is_finite()) {
        return stats_error(format!("eps must be finite and non-negative, got {eps}"));
    }
    let (mean, var, batch) = match stats {
        BnStats::Batch { mean, var, count, sum_over_ranks } => {
            if !(*count > 0.0 && count.is_finite()) {
                return stats_error(format!("the statistics' count must be positive, got {count}"));
            }
            (mean, var, Some((*count, sum_over_ranks.clone())))
        }
        BnStats::Fixed { mean, var } => (mean, var, None),
    };
    if mean.len() != c || var.len() != c {
        return stats_error(format!("{} means and {} variances given for {c} channels", mean.len(), var.len()));
    }
    let gamma = weight.to_dtype(DType::F64)?.to_vec1::<f64>()?;
    let beta = bias.to_dtype(DType::F64)?.to_vec1::<f64>()?;
    // As BatchNorm has always computed them: 1/sqrt(var + eps), a = γ·that, b = β − mean·a.
    let inv_std: Vec<f64> = var.iter().map(|v| (v + eps).sqrt().recip()).collect();
    let scale: Vec<f64> = gamma.iter().zip(&inv_std).map(|(g, s)| g * s).collect();
    let shift: Vec<f64> = beta.iter().zip(mean.iter().zip(&scale)).map(|(b, (m, a))| b - m * a).collect();
    Ok(Norm { mean: mean.clone(), inv_std, scale, shift, batch })
}

/// `out = tail(a[c]·x + b[c])` (`third`: the skip input, or the shortcut's input), parallel
/// over runs of whole rows.
fn forward_kernel<T: Float>(x: &[T], third: Option<&[T]>, p: &Plan, inner: usize) -> Vec<T> {
    let mut out = zeros(x.len());
    if out.is_empty() {
        return out;
    }
    let rounded = |v: &[f64]| -> Vec<T> { v.iter().map(|&v| T::from_f64(v)).collect() };
    let (a, b) = (rounded(&p.main.scale), rounded(&p.main.shift));
    let branch = p.branch.as_ref().map(|n| (rounded(&n.scale), rounded(&n.shift)));
    let rows = (GRAIN / inner).max(1);
    let split = out.len() > rows * inner;
    crate::trace::count(|t| if split { t.batch_norm_split += 1 } else { t.batch_norm_whole += 1 });
    let avx2 = has_avx2();
    out.par_chunks_mut(rows * inner).enumerate().for_each(|(t, o)| {
        let task = ForwardTask {
            x,
            skip: third,
            a: &a,
            b: &b,
            branch: branch.as_ref().map(|(a, b)| (a.as_slice(), b.as_slice())),
            relu: p.relu,
            round_bf16: p.round_bf16,
            inner,
            start: t * rows * inner,
        };
        if avx2 {
            // SAFETY: the CPU has the features `forward_rows_avx2` is compiled for.
            unsafe { forward_rows_avx2(&task, o) }
        } else {
            forward_rows(&task, o)
        }
    });
    out
}

/// What one task of [`forward_kernel`] reads: its output rows start at element `start`.
struct ForwardTask<'a, T> {
    x: &'a [T],
    /// The skip input, or with `branch` the shortcut's input.
    skip: Option<&'a [T]>,
    a: &'a [T],
    b: &'a [T],
    /// The shortcut's `(a', b')`.
    branch: Option<(&'a [T], &'a [T])>,
    relu: bool,
    /// Round each normalisation's output to bf16 before the residual sum (see [`Plan`]).
    round_bf16: bool,
    inner: usize,
    start: usize,
}

/// [`forward_rows`] compiled for AVX2 (see [`has_avx2`]).
#[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx2,fma"))]
unsafe fn forward_rows_avx2<T: Float>(task: &ForwardTask<'_, T>, out: &mut [T]) {
    forward_rows(task, out)
}

#[inline(always)]
fn forward_rows<T: Float>(task: &ForwardTask<'_, T>, out: &mut [T]) {
    let zero = T::from_f64(0.0);
    let (inner, c) = (task.inner, task.a.len());
    for (r, orow) in out.chunks_mut(inner).enumerate() {
        let at = task.start + r * inner;
        let ch = (at / inner) % c;
        let (s, t) = (task.a[ch], task.b[ch]);
        let xs = &task.x[at..at + inner];
        match (task.skip, task.relu) {
            (Some(sk), _) if task.round_bf16 => {
                let ss = &sk[at..at + inner];
                let round = |v: T| T::from_f64(half::bf16::from_f64(v.to_f64()).to_f64());
                for ((o, &v), &w) in orow.iter_mut().zip(xs).zip(ss) {
                    let z = match task.branch {
                        Some((a2, b2)) => round(v * s + t) + round(w * a2[ch] + b2[ch]),
                        None => round(v * s + t) + w,
                    };
                    *o = if z > zero { z } else { zero };
                }
            }
            (Some(sk), _) if task.branch.is_some() => {
                let (a2, b2) = task.branch.expect("checked");
                let (s2, t2) = (a2[ch], b2[ch]);
                let ss = &sk[at..at + inner];
                for ((o, &v), &w) in orow.iter_mut().zip(xs).zip(ss) {
                    // As `bn(x) + bn'(x')` with each batch norm's output rounded to T.
                    let z = v * s + t + (w * s2 + t2);
                    *o = if z > zero { z } else { zero };
                }
            }
            (Some(sk), _) => {
                let ss = &sk[at..at + inner];
                for ((o, &v), &w) in orow.iter_mut().zip(xs).zip(ss) {
                    let z = v * s + t + w;
                    *o = if z > zero { z } else { zero };
                }
            }
            (None, true) => {
                for (o, &v) in orow.iter_mut().zip(xs) {
                    let z = v * s + t;
                    *o = if z > zero { z } else { zero };
                }
            }
            (None, false) => orow.iter_mut().zip(xs).for_each(|(o, &v)| *o = v * s + t),
        }
    }
}

/// Independent f64 partial sums per channel (eight chains keep the adds pipelined).
const LANES: usize = 8;

/// Per channel, this rank's `(Σ g', Σ g'·(x − μ))` in f64, each channel summed by one task in a
/// fixed order.
fn channel_sums<T: Float>(
    g: &[T],
    x: &[T],
    y: &[T],
    mean: &[f64],
    relu: bool,
    (n, c, inner): (usize, usize, usize),
) -> Vec<(f64, f64)> {
    let avx2 = has_avx2();
    (0..c)
        .into_par_iter()
        .map(|ch| match (avx2, relu) {
            // SAFETY: `has_avx2` checked the CPU for the features these copies are compiled for.
            (true, true) => unsafe { channel_sum_avx2::<T, true>(g, x, y, mean[ch], (n, c, inner), ch) },
            (true, false) => unsafe { channel_sum_avx2::<T, false>(g, x, y, mean[ch], (n, c, inner), ch) },
            (false, true) => channel_sum::<T, true>(g, x, y, mean[ch], (n, c, inner), ch),
            (false, false) => channel_sum::<T, false>(g, x, y, mean[ch], (n, c, inner), ch),
        })
        .collect()
}

/// [`channel_sum`] compiled for AVX2 (see [`has_avx2`]).
#[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx2,fma"))]
unsafe fn channel_sum_avx2<T: Float, const RELU: bool>(
    g: &[T],
    x: &[T],
    y: &[T],
    mu: f64,
    dims: (usize, usize, usize),
    ch: usize,
) -> (f64, f64) {
    channel_sum::<T, RELU>(g, x, y, mu, dims, ch)
}

/// `(Σ g', Σ g'·(x − μ))` of channel `ch` of `(n, c, inner)` values, `g'` being `g` where `y > 0`
/// with `RELU`. Element `i` of a run goes to lane `i % LANES`: whole chunks of lanes, then the
/// rest, in fixed-width loops without branches, so that they vectorise.
#[inline(always)]
fn channel_sum<T: Float, const RELU: bool>(
    g: &[T],
    x: &[T],
    y: &[T],
    mu: f64,
    (n, c, inner): (usize, usize, usize),
    ch: usize,
) -> (f64, f64) {
    let zero = T::from_f64(0.0);
    let (mut s1, mut s2) = ([0f64; LANES], [0f64; LANES]);
    let full = inner / LANES * LANES;
    let mut add = |j: usize, gv: T, xv: T, yv: T| {
        let gv = gv.to_f64();
        let gp = if !RELU || yv > zero { gv } else { 0.0 };
        s1[j] += gp;
        s2[j] += gp * (xv.to_f64() - mu);
    };
    for img in 0..n {
        let off = (img * c + ch) * inner;
        let (gs, xs, ys) = (&g[off..off + inner], &x[off..off + inner], &y[off..off + inner]);
        let chunks = gs[..full].chunks_exact(LANES).zip(xs[..full].chunks_exact(LANES)).zip(ys[..full].chunks_exact(LANES));
        for ((gc, xc), yc) in chunks {
            for j in 0..LANES {
                add(j, gc[j], xc[j], yc[j]);
            }
        }
        for j in 0..inner - full {
            add(j, gs[full + j], xs[full + j], ys[full + j]);
        }
    }
    (s1.iter().sum(), s2.iter().sum())
}

/// The backward: `[∂x, ∂[γ; β], ∂skip (with a skip input)]`, or with a normalised shortcut
/// `[∂x, ∂[γ; β; γ'; β'], ∂x']`, in `x`'s dtype (`third`: the shortcut's input).
fn backward_kernel<T: Float>(
    g: &[T],
    x: &[T],
    y: &[T],
    third: Option<&[T]>,
    p: &Plan,
    n: usize,
    inner: usize,
) -> Result<Vec<Vec<T>>> {
    let dims = (n, p.c, inner);
    let (dx, dskip, mut dgb) = norm_backward(g, x, y, &p.main, p.relu, p.skip, dims)?;
    match (&p.branch, third) {
        (Some(branch), Some(xs)) => {
            // The same masked g' flows into the shortcut; its own x̂' and sums give ∂x'.
            let (dxs, _, dgbs) = norm_backward(g, xs, y, branch, p.relu, false, dims)?;
            dgb.extend(dgbs);
            Ok(vec![dx, dgb, dxs])
        }
        _ => Ok([vec![dx, dgb], dskip.into_iter().collect()].concat()),
    }
}

/// `(∂x, ∂skip when asked, ∂[γ; β])` of one normalisation.
type NormGrads<T> = (Vec<T>, Option<Vec<T>>, Vec<T>);

/// One normalisation's backward from `g` and the op's output `y` (the ReLU's mask with
/// `relu`): `(∂x, ∂skip when asked, ∂[γ; β])`.
fn norm_backward<T: Float>(
    g: &[T],
    x: &[T],
    y: &[T],
    norm: &Norm,
    relu: bool,
    want_skip: bool,
    (n, c, inner): (usize, usize, usize),
) -> Result<NormGrads<T>> {
    let len = x.len();
    let sums = channel_sums(g, x, y, &norm.mean, relu, (n, c, inner));
    let Coefficients { k, c1, c0, mu: mu_t, dgb: dgb_wide } = coefficients::<T>(norm, &sums)?;
    let (mut dx, mut dskip) = (zeros(len), zeros(if want_skip { len } else { 0 }));
    let dgb: Vec<T> = dgb_wide.iter().map(|&v| T::from_f64(v)).collect();
    if len > 0 {
        let rows = (GRAIN / inner).max(1);
        let chunk = rows * inner;
        let split = len > chunk;
        crate::trace::count(|t| if split { t.batch_norm_split += 1 } else { t.batch_norm_whole += 1 });
        let coef = RowCoefficients { g, x, y, k: &k, c1: &c1, c0: &c0, mu: &mu_t, relu, inner };
        let avx2 = has_avx2();
        let run = |start: usize, dxc: &mut [T], dsc: Option<&mut [T]>| {
            if avx2 {
                // SAFETY: the CPU has the features `backward_rows_avx2` is compiled for.
                unsafe { backward_rows_avx2(&coef, start, dxc, dsc) }
            } else {
                backward_rows(&coef, start, dxc, dsc)
            }
        };
        if want_skip {
            dx.par_chunks_mut(chunk)
                .zip(dskip.par_chunks_mut(chunk))
                .enumerate()
                .for_each(|(t, (dxc, dsc))| run(t * chunk, dxc, Some(dsc)));
        } else {
            dx.par_chunks_mut(chunk).enumerate().for_each(|(t, dxc)| run(t * chunk, dxc, None));
        }
    }
    Ok((dx, want_skip.then_some(dskip), dgb))
}

/// One normalisation's backward constants: the per-channel coefficients of
/// `∂x = k·g' + c1·(x − μ_T) + c0` rounded to `T` (`mu`: the mean rounded to `T`), and
/// `∂[γ; β]` in f64.
struct Coefficients<T> {
    k: Vec<T>,
    c1: Vec<T>,
    c0: Vec<T>,
    mu: Vec<T>,
    dgb: Vec<f64>,
}

/// The [`Coefficients`] of `norm` from this rank's per-channel `(Σ g', Σ g'·(x − μ))`, which
/// batch statistics sum over ranks first (`sum_over_ranks`); shared by the CPU and CUDA
/// backward.
fn coefficients<T: Float>(norm: &Norm, sums: &[(f64, f64)]) -> Result<Coefficients<T>> {
    let c = sums.len();
    let zero = T::from_f64(0.0);
    // ∂x = k·g' + c1·(x − μ_T) + c0 per channel, with μ_T the mean rounded to T (x − μ_T loses
    // nothing when x is near the mean; c0 carries the rounding of μ).
    let mut k = vec![zero; c];
    let mut c1 = vec![zero; c];
    let mut c0 = vec![zero; c];
    let mu_t: Vec<T> = norm.mean.iter().map(|&m| T::from_f64(m)).collect();
    match &norm.batch {
        Some((count, sum_over_ranks)) => {
            let mut global: Vec<f64> = sums.iter().map(|s| s.0).chain(sums.iter().map(|s| s.1)).collect();
            if let Some(reduce) = sum_over_ranks {
                reduce(&mut global)?;
            }
            for ch in 0..c {
                let (g1, g2) = (global[ch], global[c + ch]);
                let (a, is) = (norm.scale[ch], norm.inv_std[ch]);
                let lin = -a * is * is * g2 / count;
                k[ch] = T::from_f64(a);
                c1[ch] = T::from_f64(lin);
                c0[ch] = T::from_f64(-a * g1 / count + lin * (mu_t[ch].to_f64() - norm.mean[ch]));
            }
        }
        None => k.iter_mut().zip(&norm.scale).for_each(|(k, &a)| *k = T::from_f64(a)),
    }
    // ∂γ = Σ g'·(x − μ)/σ and ∂β = Σ g' over this rank's values.
    let mut dgb = vec![0f64; 2 * c];
    for (ch, s) in sums.iter().enumerate() {
        dgb[ch] = s.1 * norm.inv_std[ch];
        dgb[c + ch] = s.0;
    }
    Ok(Coefficients { k, c1, c0, mu: mu_t, dgb })
}

/// What [`backward_rows`] reads: the inputs and the per-channel coefficients of
/// `∂x = k·g' + c1·(x − μ_T) + c0`.
struct RowCoefficients<'a, T> {
    g: &'a [T],
    x: &'a [T],
    y: &'a [T],
    k: &'a [T],
    c1: &'a [T],
    c0: &'a [T],
    mu: &'a [T],
    relu: bool,
    inner: usize,
}

/// [`backward_rows`] compiled for AVX2 (see [`has_avx2`]).
#[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx2,fma"))]
unsafe fn backward_rows_avx2<T: Float>(coef: &RowCoefficients<'_, T>, start: usize, dx: &mut [T], dskip: Option<&mut [T]>) {
    backward_rows(coef, start, dx, dskip)
}

/// `∂x` (and `∂skip`, the gradient through the ReLU) of the rows starting at element `start`.
#[inline(always)]
fn backward_rows<T: Float>(coef: &RowCoefficients<'_, T>, start: usize, dx: &mut [T], mut dskip: Option<&mut [T]>) {
    let zero = T::from_f64(0.0);
    let (inner, c) = (coef.inner, coef.k.len());
    for (r, dxr) in dx.chunks_mut(inner).enumerate() {
        let at = start + r * inner;
        let ch = (at / inner) % c;
        let (kc, c1c, c0c, mu) = (coef.k[ch], coef.c1[ch], coef.c0[ch], coef.mu[ch]);
        let (gs, xs, ys) = (&coef.g[at..at + inner], &coef.x[at..at + inner], &coef.y[at..at + inner]);
        for (d, ((&gv, &xv), &yv)) in dxr.iter_mut().zip(gs.iter().zip(xs).zip(ys)) {
            let gp = if !coef.relu || yv > zero { gv } else { zero };
            *d = kc * gp + c1c * (xv - mu) + c0c;
        }
        if let Some(ds) = dskip.as_deref_mut() {
            for (d, (&gv, &yv)) in ds[r * inner..(r + 1) * inner].iter_mut().zip(gs.iter().zip(ys)) {
                *d = if yv > zero { gv } else { zero };
            }
        }
    }
}

/// The forward without a skip input: `(x, [γ; β])`.
struct Forward(Arc<Plan>);

/// The forward with a third input: `(x, [γ; β], skip)`, or with a normalised shortcut
/// `(x, [γ; β; γ'; β'], x')`.
struct ForwardSkip(Arc<Plan>);

/// The backward's kernel on `(∂y, x, y)`.
struct Backward(Arc<Plan>);

/// The backward's kernel with a normalised shortcut, on `(∂y, x, y, x')`.
struct BackwardBranch(Arc<Plan>);

impl CustomOp2 for Forward {
    fn name(&self) -> &'static str {
        "allgrad-batch-norm"
    }

    fn cpu_fwd(&self, sx: &CpuStorage, lx: &Layout, _sgb: &CpuStorage, _lgb: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, _, inner) = geometry(lx.dims(), "batch_norm")?;
        let out = float_kernel!("batch_norm", sx => x; forward_kernel(&contiguous(x, lx), None, &self.0, inner));
        Ok((out, lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sx: &candle_core::CudaStorage,
        lx: &Layout,
        _sgb: &candle_core::CudaStorage,
        _lgb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.0.cuda_forward().run(sx, lx, None)
    }

    fn bwd(&self, x: &Tensor, gb: &Tensor, y: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dgb, _) = backward(&self.0, x, gb, None, y, g)?;
        Ok((Some(dx), Some(dgb)))
    }
}

impl CustomOp3 for ForwardSkip {
    fn name(&self) -> &'static str {
        if self.0.branch.is_some() {
            "allgrad-batch-norm-add-batch-norm-relu"
        } else {
            "allgrad-batch-norm-add-relu"
        }
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        _sgb: &CpuStorage,
        _lgb: &Layout,
        ss: &CpuStorage,
        ls: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, _, inner) = geometry(lx.dims(), "batch_norm")?;
        let out = float_kernel!("batch_norm", sx => x, ss => s;
            forward_kernel(&contiguous(x, lx), Some(&contiguous(s, ls)), &self.0, inner));
        Ok((out, lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sx: &candle_core::CudaStorage,
        lx: &Layout,
        _sgb: &candle_core::CudaStorage,
        _lgb: &Layout,
        ss: &candle_core::CudaStorage,
        ls: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.0.cuda_forward().run(sx, lx, Some((ss, ls)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        gb: &Tensor,
        third: &Tensor,
        y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dgb, dthird) = backward(&self.0, x, gb, Some(third), y, g)?;
        Ok((Some(dx), Some(dgb), dthird))
    }
}

/// Runs the backward kernel: `(∂x, ∂gb, ∂third)` with `∂third` the skip's gradient (a plain
/// skip) or the shortcut input's (a normalised shortcut).
fn backward(
    plan: &Arc<Plan>,
    x: &Tensor,
    gb: &Tensor,
    third: Option<&Tensor>,
    y: &Tensor,
    g: &Tensor,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return backward_cuda(plan, x, gb, third, y, g);
    }
    let g = g.detach().to_dtype(x.dtype())?;
    let mut shapes = vec![x.shape().clone(), gb.shape().clone()];
    if plan.skip || plan.branch.is_some() {
        shapes.push(x.shape().clone());
    }
    // With bf16 activations and f32 parameters, the parameters' gradients stay f32.
    let keep_f32 = [false, gb.dtype() == DType::F32 && x.dtype() == DType::BF16, false];
    let grads = match (&plan.branch, third) {
        (Some(_), Some(t)) => run_split_keeping_f32(&BackwardBranch(plan.clone()), [&g, x, y, &t.detach()], &shapes, &keep_f32)?,
        _ => run_split_keeping_f32(&Backward(plan.clone()), [&g, x, y], &shapes, &keep_f32)?,
    };
    let mut grads = grads.into_iter();
    let (Some(dx), Some(dgb)) = (grads.next(), grads.next()) else { unreachable!("one gradient per shape") };
    Ok((dx, dgb, grads.next()))
}

/// [`backward`] on CUDA: per normalisation one kernel for the per-channel sums, copied to the
/// host (summed over ranks there, as on the CPU), the [`coefficients`], and one kernel for
/// `∂x`; a skip input's gradient is the ReLU's backward kernel.
#[cfg(feature = "cuda")]
fn backward_cuda(
    plan: &Arc<Plan>,
    x: &Tensor,
    gb: &Tensor,
    third: Option<&Tensor>,
    y: &Tensor,
    g: &Tensor,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    let g = g.detach().to_dtype(x.dtype())?.contiguous()?;
    let (x, y) = (x.detach(), y.detach());
    let (dx, mut dgb) = norm_backward_cuda(&g, &x, &y, &plan.main, plan.relu)?;
    let dthird = match (&plan.branch, third) {
        (Some(branch), Some(t)) => {
            let (dxs, dgbs) = norm_backward_cuda(&g, &t.detach(), &y, branch, plan.relu)?;
            dgb.extend(dgbs);
            Some(dxs)
        }
        _ if plan.skip => Some(crate::activation::masked(&y, &g)?),
        _ => None,
    };
    // Rounded as the CPU kernel rounds them: to its compute type (f32 for bf16), then to the
    // parameters' dtype.
    let wide = if x.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
    let dgb = Tensor::from_vec(dgb, gb.shape(), &candle_core::Device::Cpu)?.to_dtype(wide)?.to_dtype(gb.dtype())?;
    Ok((dx, dgb.to_device(x.device())?, dthird))
}

/// One normalisation's `(∂x, ∂[γ; β] in f64)` on CUDA.
#[cfg(feature = "cuda")]
fn norm_backward_cuda(g: &Tensor, x: &Tensor, y: &Tensor, norm: &Norm, relu: bool) -> Result<(Tensor, Vec<f64>)> {
    use crate::cuda::{BnBackwardDx, BnBackwardSums};
    let sums = g.apply_op3_no_bwd(x, y, &BnBackwardSums { mean: norm.mean.clone(), relu })?.to_vec2::<f64>()?;
    let sums: Vec<(f64, f64)> = sums[0].iter().copied().zip(sums[1].iter().copied()).collect();
    fn wide<T: Float>(c: Coefficients<T>) -> ([Vec<f64>; 4], Vec<f64>) {
        let w = |v: Vec<T>| v.into_iter().map(|v| v.to_f64()).collect::<Vec<f64>>();
        ([w(c.k), w(c.c1), w(c.c0), w(c.mu)], c.dgb)
    }
    // The coefficients in the kernel's compute type: f64 for f64, f32 for f32 and bf16.
    let (coef, dgb) =
        if x.dtype() == DType::F64 { wide(coefficients::<f64>(norm, &sums)?) } else { wide(coefficients::<f32>(norm, &sums)?) };
    let dx = g.apply_op3_no_bwd(x, y, &BnBackwardDx { coef, relu })?;
    Ok((dx, dgb))
}

impl SplitKernel<3> for Backward {
    const OP: &'static str = "batch_norm backward";

    fn run<T: Float>(&self, [(g, lg), (x, lx), (y, ly)]: [(&[T], &Layout); 3]) -> Result<Vec<Vec<T>>> {
        let (n, _, inner) = geometry(lx.dims(), "batch_norm")?;
        backward_kernel(&contiguous(g, lg), &contiguous(x, lx), &contiguous(y, ly), None, &self.0, n, inner)
    }
}

impl SplitKernel<4> for BackwardBranch {
    const OP: &'static str = "batch_norm backward";

    fn run<T: Float>(&self, [(g, lg), (x, lx), (y, ly), (xs, ls)]: [(&[T], &Layout); 4]) -> Result<Vec<Vec<T>>> {
        let (n, _, inner) = geometry(lx.dims(), "batch_norm")?;
        let xs = contiguous(xs, ls);
        backward_kernel(&contiguous(g, lg), &contiguous(x, lx), &contiguous(y, ly), Some(&xs), &self.0, n, inner)
    }
}
