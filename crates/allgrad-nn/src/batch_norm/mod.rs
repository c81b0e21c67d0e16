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
//! **Host path and device path.** With statistics given as host values ([`BnStats::Batch`],
//! [`BnStats::Fixed`]) on the CPU, the per-channel constants are computed on the host and the
//! backward is one split kernel. With statistics in tensors ([`BnStats::BatchOnDevice`],
//! [`BnStats::FixedOnDevice`]), on CUDA (feature `cuda`), or on the CPU with
//! [`crate::transfer::set_device_path`], everything between the reductions stays in tensors on
//! the device, computed by the finalize ops ([`crate::finalize`]): the forward is the
//! coefficients op and one kernel; the backward one kernel for the per-channel sums, their
//! cross-rank sum as a tensor ([`TensorSum`]), the backward-coefficients op, one kernel for `∂x`
//! and, with a skip input, the ReLU's backward kernel for `∂skip`. No value is read to the host.
//! Both paths evaluate the same expressions (shared per-channel functions, CUDA kernels without
//! contraction), and save the same tensors.
//!
//! The folder: this file is the layer (its checks, its constants on either path, its ops and
//! their backward); `cpu.rs` holds the passes over the activations that both paths' CPU
//! kernels run, [`finalize`] the device path's per-channel ops.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

use self::cpu::{backward_pass, channel_sums, forward_kernel, Affine, RowCoefficients};
use self::finalize::{
    channel_backward, channel_constants, table_channels, with_cpu_f64, BackwardCoefficients, Coefficients, Dx, Sums, TensorSum,
};
use crate::backend::fused_float;
use crate::cpu::{contiguous, float_kernel, run_split_keeping_f32, Float, SplitKernel};
use crate::error::{fail, NnError};
use crate::shape::geometry;

mod cpu;
pub mod finalize;

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
    /// Batch statistics in a tensor on `x`'s device, never read to the host: the
    /// `[mean; var; unbiased var; n]` table of [`crate::batch_statistics`] (over every rank's
    /// batch with SyncBatchNorm). Differentiated like [`BnStats::Batch`]; `sum_over_ranks` sums
    /// the backward's per-channel sums over the same ranks, as a tensor on the device.
    BatchOnDevice {
        /// The statistics table (flat f64, `3C + 1` values).
        table: Tensor,
        /// The cross-rank sum of the backward (see [`TensorSum`]).
        sum_over_ranks: Option<TensorSum>,
    },
    /// Constant statistics in tensors on `x`'s device (the running ones, in evaluation), one
    /// value per channel each, of any float dtype.
    FixedOnDevice {
        /// Mean per channel.
        mean: Tensor,
        /// Variance per channel.
        var: Tensor,
    },
}

impl BnStats {
    /// Whether the statistics are tensors on the device (the device path).
    fn on_device(&self) -> bool {
        matches!(self, BnStats::BatchOnDevice { .. } | BnStats::FixedOnDevice { .. })
    }
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

/// One normalisation's constants on the device path: the coefficients table
/// `[mean; 1/σ; a; b; n]` (flat f64, `4C + 1`) on the tensors' device.
struct DeviceNorm {
    coef: Tensor,
    /// Batch statistics (differentiated), with the cross-rank sum of the backward.
    batch: Option<Option<TensorSum>>,
}

/// Where one call's constants live: host vectors (host path) or device tables (device path);
/// `branch` is the normalised shortcut of [`BnTail::AddBnRelu`].
enum Consts {
    Host { main: Norm, branch: Option<Norm> },
    Device { main: DeviceNorm, branch: Option<DeviceNorm> },
}

/// The resolved constants of one call, shared by its forward and backward ops.
struct Plan {
    c: usize,
    consts: Consts,
    relu: bool,
    /// A plain skip input ([`BnTail::AddRelu`]).
    skip: bool,
    /// bf16 activations: each normalisation's output is rounded to bf16 before a residual sum,
    /// as an unfused bf16 batch norm stores it (then the sum is rounded, as a bf16 addition).
    round_bf16: bool,
}

impl Plan {
    fn has_branch(&self) -> bool {
        match &self.consts {
            Consts::Host { branch, .. } => branch.is_some(),
            Consts::Device { branch, .. } => branch.is_some(),
        }
    }

    /// The forward's scale and shift `(a, b)` per channel (and the shortcut's), as f64 slices
    /// given to `f`: the host vectors, or the device tables of CPU tensors read in place.
    fn with_affine<R>(&self, f: impl FnOnce(Affine<'_>, Option<Affine<'_>>) -> R) -> Result<R> {
        let c = self.c;
        match &self.consts {
            Consts::Host { main, branch } => {
                Ok(f((&main.scale, &main.shift), branch.as_ref().map(|b| (b.scale.as_slice(), b.shift.as_slice()))))
            }
            Consts::Device { main, branch: None } => with_cpu_f64(&main.coef, |m| f((&m[2 * c..3 * c], &m[3 * c..4 * c]), None)),
            Consts::Device { main, branch: Some(b) } => with_cpu_f64(&main.coef, |m| {
                with_cpu_f64(&b.coef, |s| f((&m[2 * c..3 * c], &m[3 * c..4 * c]), Some((&s[2 * c..3 * c], &s[3 * c..4 * c]))))
            })?,
        }
    }

    /// The host constants (the host path's backward).
    fn host(&self) -> Result<(&Norm, Option<&Norm>)> {
        match &self.consts {
            Consts::Host { main, branch } => Ok((main, branch.as_ref())),
            Consts::Device { .. } => {
                candle_core::bail!("allgrad-nn internal error: batch_norm's host backward on the device path")
            }
        }
    }

    /// The CUDA forward kernel's mode: 0 (no tail), 1 (ReLU), 2 (skip), 3 (normalised shortcut).
    #[cfg(feature = "cuda")]
    fn cuda_mode(&self) -> i32 {
        match (self.has_branch(), self.skip, self.relu) {
            (true, _, _) => 3,
            (false, true, _) => 2,
            (false, false, true) => 1,
            (false, false, false) => 0,
        }
    }

    /// The CUDA forward on the device path.
    #[cfg(feature = "cuda")]
    fn cuda_forward(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        third: Option<(&candle_core::CudaStorage, &Layout)>,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        match &self.consts {
            Consts::Device { main, branch } => {
                crate::cuda::bn_forward(x, lx, third, &main.coef, branch.as_ref().map(|b| &b.coef), self.cuda_mode())
            }
            Consts::Host { .. } => candle_core::bail!("allgrad-nn internal error: batch_norm on CUDA with host constants"),
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
    let _timer = crate::trace::OpTimer::start("batch_norm", crate::trace::Pass::Forward, x.device());
    let (_, c, _) = geometry(x.dims(), "batch_norm")?;
    if !fused_float(x) {
        return fail(NnError::BatchNormOffCpu { dtype: x.dtype(), device: format!("{:?}", x.device().location()) });
    }
    check_params(x, c, weight, bias, eps)?;
    let third = match tail {
        BnTail::AddRelu(s) => Some(check_like_x(x, s, "batch_norm (skip)")?),
        BnTail::AddBnRelu(b) => {
            check_params(x, c, b.weight, b.bias, b.eps)?;
            Some(check_like_x(x, b.x, "batch_norm (shortcut)")?)
        }
        _ => None,
    };
    // The parameters travel as one [2, C] input ([4, C] with a shortcut: γ, β, γ', β') so
    // that one op returns all their gradients.
    let gb = match tail {
        BnTail::AddBnRelu(b) => Tensor::stack(&[weight, bias, b.weight, b.bias], 0)?,
        _ => Tensor::stack(&[weight, bias], 0)?,
    };
    let branch = match tail {
        BnTail::AddBnRelu(b) => Some(b),
        _ => None,
    };
    let device =
        crate::transfer::takes_device_path(x.device()) || stats.on_device() || branch.is_some_and(|b| b.stats.on_device());
    let consts = if device {
        let gb = gb.detach();
        Consts::Device {
            main: resolve_device(x, c, &gb.narrow(0, 0, 2)?, stats, eps)?,
            branch: branch.map(|b| resolve_device(x, c, &gb.narrow(0, 2, 2)?, b.stats, b.eps)).transpose()?,
        }
    } else {
        Consts::Host {
            main: resolve(c, weight, bias, stats, eps)?,
            branch: branch.map(|b| resolve(c, b.weight, b.bias, b.stats, b.eps)).transpose()?,
        }
    };
    let plan = Arc::new(Plan {
        c,
        consts,
        relu: !matches!(tail, BnTail::Identity),
        skip: matches!(tail, BnTail::AddRelu(_)),
        round_bf16: x.dtype() == DType::BF16,
    });
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

/// One normalisation's parameters checked against `c` channels of `x`, and its eps.
fn check_params(x: &Tensor, c: usize, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<()> {
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
    Ok(())
}

/// A batch count checked: positive and finite.
fn check_count(count: f64) -> Result<()> {
    if !(count > 0.0 && count.is_finite()) {
        return stats_error(format!("the statistics' count must be positive, got {count}"));
    }
    Ok(())
}

/// One normalisation's host constants from host statistics (checked against `c` channels).
fn resolve(c: usize, weight: &Tensor, bias: &Tensor, stats: &BnStats, eps: f64) -> Result<Norm> {
    let (mean, var, batch) = match stats {
        BnStats::Batch { mean, var, count, sum_over_ranks } => {
            check_count(*count)?;
            (mean, var, Some((*count, sum_over_ranks.clone())))
        }
        BnStats::Fixed { mean, var } => (mean, var, None),
        BnStats::BatchOnDevice { .. } | BnStats::FixedOnDevice { .. } => {
            candle_core::bail!("allgrad-nn internal error: device statistics on batch_norm's host path")
        }
    };
    if mean.len() != c || var.len() != c {
        return stats_error(format!("{} means and {} variances given for {c} channels", mean.len(), var.len()));
    }
    // The parameters of a CPU tensor on the host path: reading them copies nothing off a device.
    let gamma = crate::transfer::read_f64(weight)?;
    let beta = crate::transfer::read_f64(bias)?;
    // As BatchNorm has always computed them: 1/sqrt(var + eps), a = γ·that, b = β − mean·a.
    let (mut inv_std, mut scale, mut shift) = (vec![0.0; c], vec![0.0; c], vec![0.0; c]);
    for ch in 0..c {
        [inv_std[ch], scale[ch], shift[ch]] = channel_constants(mean[ch], var[ch], gamma[ch], beta[ch], eps);
    }
    Ok(Norm { mean: mean.clone(), inv_std, scale, shift, batch })
}

/// One normalisation's device constants: its statistics as a table on `x`'s device (host
/// statistics are uploaded, a host cross-rank sum wrapped), then the coefficients op with
/// `gb` (`[2, C]`: γ; β, untracked).
fn resolve_device(x: &Tensor, c: usize, gb: &Tensor, stats: &BnStats, eps: f64) -> Result<DeviceNorm> {
    use crate::transfer::upload;
    let dev = x.device();
    let host_table = |mean: &[f64], var: &[f64], count: f64| -> Result<Tensor> {
        if mean.len() != c || var.len() != c {
            return stats_error(format!("{} means and {} variances given for {c} channels", mean.len(), var.len()));
        }
        upload([mean, var, var, &[count]].concat(), 3 * c + 1, dev)
    };
    let (table, batch) = match stats {
        BnStats::BatchOnDevice { table, sum_over_ranks } => {
            let have = table_channels(table, 3, 1, "batch_norm's statistics table")?;
            if have != c {
                return stats_error(format!("a statistics table for {have} channels given for {c}"));
            }
            if !table.device().same_device(dev) {
                return fail(NnError::DeviceMismatch { op: "batch_norm (statistics table)" });
            }
            (table.contiguous()?, Some(sum_over_ranks.clone()))
        }
        BnStats::FixedOnDevice { mean, var } => {
            if mean.dims() != [c] || var.dims() != [c] {
                return stats_error(format!(
                    "statistics of shapes {:?} and {:?} given for {c} channels",
                    mean.dims(),
                    var.dims()
                ));
            }
            let (m, v) = (mean.to_dtype(DType::F64)?, var.to_dtype(DType::F64)?);
            (Tensor::cat(&[&m, &v, &v, &Tensor::zeros(1, DType::F64, dev)?], 0)?, None)
        }
        BnStats::Batch { mean, var, count, sum_over_ranks } => {
            check_count(*count)?;
            let sum = sum_over_ranks.clone().map(|f| {
                // The host sum of a host caller: its sums cross to the host and back.
                Arc::new(move |t: &Tensor| {
                    let mut v = crate::transfer::read_vec::<f64>(t)?;
                    f(&mut v)?;
                    upload(v, t.shape(), t.device())
                }) as TensorSum
            });
            (host_table(mean, var, *count)?, Some(sum))
        }
        BnStats::Fixed { mean, var } => (host_table(mean, var, 0.0)?, None),
    };
    let coef = table.apply_op2_no_bwd(&gb.contiguous()?, &Coefficients { eps })?;
    Ok(DeviceNorm { coef, batch })
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
    let (main, branch) = p.host()?;
    let (dx, dskip, mut dgb) = norm_backward(g, x, y, main, p.relu, p.skip, dims)?;
    match (branch, third) {
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
    let plan = crate::simd::for_kernel()?;
    let sums = channel_sums(plan, g, x, y, &norm.mean, relu, (n, c, inner));
    let HostCoefficients { k, c1, c0, mu: mu_t, dgb: dgb_wide } = coefficients::<T>(norm, &sums)?;
    let dgb: Vec<T> = dgb_wide.iter().map(|&v| T::from_f64(v)).collect();
    let coef = RowCoefficients { g, x, y, k: &k, c1: &c1, c0: &c0, mu: &mu_t, relu, inner };
    let (dx, dskip) = backward_pass(plan, &coef, want_skip);
    Ok((dx, dskip, dgb))
}

/// One normalisation's backward constants: the per-channel coefficients of
/// `∂x = k·g' + c1·(x − μ_T) + c0` rounded to `T` (`mu`: the mean rounded to `T`), and
/// `∂[γ; β]` in f64.
struct HostCoefficients<T> {
    k: Vec<T>,
    c1: Vec<T>,
    c0: Vec<T>,
    mu: Vec<T>,
    dgb: Vec<f64>,
}

/// The [`HostCoefficients`] of `norm` from this rank's per-channel `(Σ g', Σ g'·(x − μ))`, which
/// batch statistics sum over ranks first (`sum_over_ranks`); shared by the CPU and CUDA
/// backward.
fn coefficients<T: Float>(norm: &Norm, sums: &[(f64, f64)]) -> Result<HostCoefficients<T>> {
    let c = sums.len();
    let zero = T::from_f64(0.0);
    // ∂x = k·g' + c1·(x − μ_T) + c0 per channel, with μ_T the mean rounded to T
    // ([`channel_backward`], shared with the device path's finalize op).
    let (mut k, mut c1, mut c0, mut mu) = (vec![zero; c], vec![zero; c], vec![zero; c], vec![zero; c]);
    let mut dgb = vec![0f64; 2 * c];
    let mut global: Vec<f64> = sums.iter().map(|s| s.0).chain(sums.iter().map(|s| s.1)).collect();
    let count = match &norm.batch {
        Some((count, sum_over_ranks)) => {
            if let Some(reduce) = sum_over_ranks {
                reduce(&mut global)?;
            }
            Some(*count)
        }
        None => None,
    };
    let round = |v: f64| T::from_f64(v).to_f64();
    for (ch, s) in sums.iter().enumerate() {
        let consts = (norm.mean[ch], norm.inv_std[ch], norm.scale[ch]);
        let [kc, c1c, c0c, muc, dg, db] = channel_backward(round, consts, count, (global[ch], global[c + ch]), *s);
        (k[ch], c1[ch], c0[ch], mu[ch]) = (T::from_f64(kc), T::from_f64(c1c), T::from_f64(c0c), T::from_f64(muc));
        (dgb[ch], dgb[c + ch]) = (dg, db);
    }
    Ok(HostCoefficients { k, c1, c0, mu, dgb })
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
        let p = &self.0;
        let plan = crate::simd::for_kernel()?;
        let out = p.with_affine(|ab, ab2| -> Result<CpuStorage> {
            Ok(float_kernel!("batch_norm", sx => x; forward_kernel(plan, &contiguous(x, lx), None, (p.relu, p.round_bf16), (ab, ab2), inner)))
        })??;
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
        self.0.cuda_forward(sx, lx, None)
    }

    fn bwd(&self, x: &Tensor, gb: &Tensor, y: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let _timer = crate::trace::OpTimer::start("batch_norm", crate::trace::Pass::Backward, x.device());
        let (dx, dgb, _) = backward(&self.0, x, gb, None, y, g)?;
        Ok((Some(dx), Some(dgb)))
    }
}

impl CustomOp3 for ForwardSkip {
    fn name(&self) -> &'static str {
        if self.0.has_branch() {
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
        let p = &self.0;
        let plan = crate::simd::for_kernel()?;
        let out = p.with_affine(|ab, ab2| -> Result<CpuStorage> {
            Ok(float_kernel!("batch_norm", sx => x, ss => s;
                forward_kernel(plan, &contiguous(x, lx), Some(&contiguous(s, ls)), (p.relu, p.round_bf16), (ab, ab2), inner)))
        })??;
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
        self.0.cuda_forward(sx, lx, Some((ss, ls)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        gb: &Tensor,
        third: &Tensor,
        y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let _timer = crate::trace::OpTimer::start("batch_norm", crate::trace::Pass::Backward, x.device());
        let (dx, dgb, dthird) = backward(&self.0, x, gb, Some(third), y, g)?;
        Ok((Some(dx), Some(dgb), dthird))
    }
}

/// Runs the backward: `(∂x, ∂gb, ∂third)` with `∂third` the skip's gradient (a plain skip) or
/// the shortcut input's (a normalised shortcut).
fn backward(
    plan: &Arc<Plan>,
    x: &Tensor,
    gb: &Tensor,
    third: Option<&Tensor>,
    y: &Tensor,
    g: &Tensor,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    if let Consts::Device { main, branch } = &plan.consts {
        return backward_device(plan, (main, branch.as_ref()), x, gb, third, y, g);
    }
    let g = g.detach().to_dtype(x.dtype())?;
    let mut shapes = vec![x.shape().clone(), gb.shape().clone()];
    if plan.skip || plan.has_branch() {
        shapes.push(x.shape().clone());
    }
    // With bf16 activations and f32 parameters, the parameters' gradients stay f32.
    let keep_f32 = [false, gb.dtype() == DType::F32 && x.dtype() == DType::BF16, false];
    let grads = match (plan.has_branch(), third) {
        (true, Some(t)) => run_split_keeping_f32(&BackwardBranch(plan.clone()), [&g, x, y, &t.detach()], &shapes, &keep_f32)?,
        _ => run_split_keeping_f32(&Backward(plan.clone()), [&g, x, y], &shapes, &keep_f32)?,
    };
    let mut grads = grads.into_iter();
    let (Some(dx), Some(dgb)) = (grads.next(), grads.next()) else { unreachable!("one gradient per shape") };
    Ok((dx, dgb, grads.next()))
}

/// [`backward`] on the device path (CUDA, or CPU tensors with the device path on): per
/// normalisation the per-channel sums op, their cross-rank sum as a tensor, the
/// backward-coefficients op and the `∂x` op; a skip input's gradient is the ReLU's backward.
/// Nothing is read to the host.
fn backward_device(
    plan: &Arc<Plan>,
    (main, branch): (&DeviceNorm, Option<&DeviceNorm>),
    x: &Tensor,
    gb: &Tensor,
    third: Option<&Tensor>,
    y: &Tensor,
    g: &Tensor,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    use crate::backend::dense;
    let g = dense(&g.detach().to_dtype(x.dtype())?)?;
    let (x, y) = (dense(&x.detach())?, dense(&y.detach())?);
    let (dx, mut dgb) = norm_backward_device(&g, &x, &y, main, plan.relu)?;
    let dthird = match (branch, third) {
        (Some(branch), Some(t)) => {
            let (dxs, dgbs) = norm_backward_device(&g, &dense(&t.detach())?, &y, branch, plan.relu)?;
            dgb = Tensor::cat(&[&dgb, &dgbs], 0)?;
            Some(dxs)
        }
        _ if plan.skip => Some(crate::activation::masked(&y, &g)?),
        _ => None,
    };
    // Rounded as the host kernel rounds them: to its compute type (f32 for bf16), then to the
    // parameters' dtype.
    let wide = if x.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
    let dgb = dgb.reshape(gb.shape())?.to_dtype(wide)?.to_dtype(gb.dtype())?;
    Ok((dx, dgb, dthird))
}

/// One normalisation's `(∂x, ∂[γ; β] as flat f64)` on the device path.
fn norm_backward_device(g: &Tensor, x: &Tensor, y: &Tensor, norm: &DeviceNorm, relu: bool) -> Result<(Tensor, Tensor)> {
    let c = x.dim(1)?;
    let local = g.apply_op3_no_bwd(x, y, &Sums { coef: norm.coef.clone(), relu })?;
    let global = match &norm.batch {
        Some(Some(sum)) => sum(&local)?,
        _ => local.clone(),
    };
    let f32 = x.dtype() != DType::F64;
    let table = global.apply_op3_no_bwd(&local, &norm.coef, &BackwardCoefficients { batch: norm.batch.is_some(), f32 })?;
    let dx = g.apply_op3_no_bwd(x, y, &Dx { table: table.clone(), relu })?;
    Ok((dx, table.narrow(0, 4 * c, 2 * c)?))
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
