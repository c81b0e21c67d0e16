//! Batch norm's finalize ops: the per-channel arithmetic between its reductions (moments →
//! statistics → coefficients forward, sums → coefficients backward) as ops on tensors, so that
//! on a device it stays there and the host never waits for the GPU inside a step.
//!
//! Each op has a CPU twin and a CUDA kernel (`src/cuda/finalize.cu`, feature `cuda`) that
//! evaluate the same f64 expressions in the same order (no contraction into fused
//! multiply-adds), and the host path of [`crate::batch_norm`] computes with the same functions
//! (`channel_statistics`, `channel_constants`, `channel_backward`; the passes over the
//! activations come from `batch_norm/cpu.rs` on both paths): the device path (CUDA, or the CPU
//! with [`crate::transfer::set_device_path`]) gives the host path's values.
//!
//! The tables, all f64 and flat, `C` values per row:
//!
//! | table | layout | made by |
//! |---|---|---|
//! | moments | `[Σx; Σx²; n]` (2C + 1) | [`batch_moments`], then summed over ranks |
//! | statistics | `[mean; var; unbiased var; n]` (3C + 1) | [`batch_statistics`] |
//! | coefficients | `[mean; 1/σ; a = γ/σ; b = β − mean·a; n]` (4C + 1) | `Coefficients` (in [`crate::batch_norm`]) |
//! | backward | `[k; c1; c0; μ_T; ∂γ; ∂β]` (6C) | `BackwardCoefficients`, from the summed backward sums |

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor};

use crate::cpu::{contiguous, float_kernel, Float};
use crate::error::{fail, NnError};
use crate::shape::geometry;
use crate::simd::SimdPlan;

/// Sums a tensor of per-channel f64 partial sums over the ranks that share the batch
/// statistics (an all_reduce with `Sum` of a tensor on its device); called once per backward of
/// a synchronised [`crate::batch_norm`] with [`crate::BnStats::BatchOnDevice`], on every rank in
/// the same order.
pub type TensorSum = Arc<dyn Fn(&Tensor) -> Result<Tensor> + Send + Sync>;

/// `(mean, biased variance clamped at 0, unbiased variance)` of one channel from its `Σx`,
/// `Σx²` over `n` values (NaN passes through the clamp). The unbiased variance is
/// `var·(n / max(n − 1, 1))`, PyTorch's for the running statistics.
pub(crate) fn channel_statistics(s1: f64, s2: f64, n: f64) -> [f64; 3] {
    let mean = s1 / n;
    let v = s2 / n - mean * mean;
    let var = if v < 0.0 { 0.0 } else { v };
    // As Candle's `var * factor` (v·mul + 0) computes it.
    [mean, var, var * (n / (n - 1.0).max(1.0)) + 0.0]
}

/// `(1/σ, a = γ/σ, b = β − mean·a)` of one channel, σ = sqrt(var + eps).
pub(crate) fn channel_constants(mean: f64, var: f64, gamma: f64, beta: f64, eps: f64) -> [f64; 3] {
    let inv_std = (var + eps).sqrt().recip();
    let a = gamma * inv_std;
    [inv_std, a, beta - mean * a]
}

/// One channel's backward constants `[k, c1, c0, μ_T, ∂γ, ∂β]` of
/// `∂x = k·g' + c1·(x − μ_T) + c0`, with `round` the rounding to the kernel's compute type
/// (k, c1, c0 and μ_T are rounded; ∂γ, ∂β stay f64). `count`: the batch statistics' count (None
/// for fixed statistics: `∂x = a·g'`); `global`: `(Σg', Σg'·(x − μ))` summed over the ranks of the
/// statistics; `local`: this rank's, which give `∂γ = Σg'·(x − μ)/σ` and `∂β = Σg'`.
pub(crate) fn channel_backward(
    round: impl Fn(f64) -> f64,
    (mean, inv_std, a): (f64, f64, f64),
    count: Option<f64>,
    (g1, g2): (f64, f64),
    (l1, l2): (f64, f64),
) -> [f64; 6] {
    // x − μ_T loses nothing when x is near the mean; c0 carries the rounding of μ.
    let mu_t = round(mean);
    let (k, c1, c0) = match count {
        Some(count) => {
            let lin = -a * inv_std * inv_std * g2 / count;
            (round(a), round(lin), round(-a * g1 / count + lin * (mu_t - mean)))
        }
        None => (round(a), 0.0, 0.0),
    };
    [k, c1, c0, mu_t, l2 * inv_std, l1]
}

/// Per-channel `[Σx; Σx²; n]` of `x` (`[N, C, ...]`, f32, f64 or bf16) as a flat f64 tensor of
/// `2C + 1` values on `x`'s device (`n = N·(H·W...)`, the values per channel): what
/// SyncBatchNorm sums over ranks before [`batch_statistics`]. Untracked.
///
/// # Errors
/// When `x` is not `[N, C, ...]`.
pub fn batch_moments(x: &Tensor) -> Result<Tensor> {
    let (n, _, inner) = geometry(x.dims(), "batch_moments")?;
    #[cfg(feature = "cuda")]
    if crate::backend::cuda_float(x) {
        // One two-stage reduction that also writes the count.
        return x.detach().contiguous()?.apply_op1_no_bwd(&CudaMoments);
    }
    let sums = crate::channel_moments(&x.detach())?.flatten_all()?;
    let count = Tensor::full((n * inner) as f64, 1, x.device())?;
    Tensor::cat(&[&sums, &count], 0)
}

/// The batch statistics `[mean; var; unbiased var; n]` (flat f64, `3C + 1` values) from moments
/// `[Σx; Σx²; n]` (`2C + 1`, [`batch_moments`], summed over ranks for SyncBatchNorm), on their
/// device: the variance is `Σx²/n − mean²` clamped at 0, the unbiased one `var·n/(n − 1)`.
/// Untracked.
///
/// # Errors
/// When `moments` is not a flat f64 tensor of an odd length.
pub fn batch_statistics(moments: &Tensor) -> Result<Tensor> {
    table_channels(moments, 2, 1, "batch_statistics (moments)")?;
    moments.contiguous()?.apply_op1_no_bwd(&Statistics)
}

/// The channel count `C` of a flat f64 table of `rows·C + extra` values.
pub(crate) fn table_channels(t: &Tensor, rows: usize, extra: usize, what: &str) -> Result<usize> {
    let len = t.elem_count();
    if t.dtype() != DType::F64 || t.rank() != 1 || len < extra || !(len - extra).is_multiple_of(rows) {
        return fail(NnError::BatchNormStats {
            what: format!(
                "{what}: expected a flat f64 tensor of {rows}·C{} values, got {:?} {:?}",
                if extra > 0 { format!(" + {extra}") } else { String::new() },
                t.dtype(),
                t.dims()
            ),
        });
    }
    Ok((len - extra) / rows)
}

/// Runs `f` on the f64 elements of `t` (a contiguous f64 CPU tensor held by an op, read in its
/// storage: no copy).
pub(crate) fn with_cpu_f64<R>(t: &Tensor, f: impl FnOnce(&[f64]) -> R) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(s) = &*storage else {
        return fail(NnError::DeviceMismatch { op: "batch_norm (a table on another device)" });
    };
    let all = s.as_slice::<f64>()?;
    match layout.contiguous_offsets() {
        Some((a, b)) => Ok(f(&all[a..b])),
        None => candle_core::bail!("allgrad-nn internal error: a batch-norm table is not contiguous"),
    }
}

/// `[Σx; Σx²; n]` of a CUDA tensor in one reduction (the CPU composes [`crate::channel_moments`]).
#[cfg(feature = "cuda")]
struct CudaMoments;

#[cfg(feature = "cuda")]
impl CustomOp1 for CudaMoments {
    fn name(&self) -> &'static str {
        "allgrad-batch-moments"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        fail(NnError::DeviceMismatch { op: "batch_moments (the CUDA reduction on a CPU tensor)" })
    }

    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::batch_moments(s, l)
    }
}

/// `[2C + 1]` moments → `[3C + 1]` statistics.
struct Statistics;

impl CustomOp1 for Statistics {
    fn name(&self) -> &'static str {
        "allgrad-batch-norm-statistics"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let m = contiguous(s.as_slice::<f64>()?, l);
        let c = (m.len() - 1) / 2;
        let n = m[2 * c];
        let mut out = vec![0f64; 3 * c + 1];
        for ch in 0..c {
            let [mean, var, unbiased] = channel_statistics(m[ch], m[c + ch], n);
            (out[ch], out[c + ch], out[2 * c + ch]) = (mean, var, unbiased);
        }
        out[3 * c] = n;
        Ok((CpuStorage::F64(out), Shape::from(3 * c + 1)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::finalize::statistics(s, l)
    }
}

/// `[3C + 1]` statistics and `[2, C]` parameters `(γ; β)` → `[4C + 1]` coefficients, with `eps`.
pub(crate) struct Coefficients {
    pub eps: f64,
}

impl CustomOp2 for Coefficients {
    fn name(&self) -> &'static str {
        "allgrad-batch-norm-coefficients"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout, sgb: &CpuStorage, lgb: &Layout) -> Result<(CpuStorage, Shape)> {
        let t = contiguous(s.as_slice::<f64>()?, l);
        let c = (t.len() - 1) / 3;
        let gb: Vec<f64> = match sgb {
            CpuStorage::F32(v) => contiguous(v, lgb).iter().map(|&v| v as f64).collect(),
            CpuStorage::F64(v) => contiguous(v, lgb).to_vec(),
            other => return fail(NnError::UnsupportedDType { op: "batch_norm coefficients", dtype: other.dtype() }),
        };
        let mut out = vec![0f64; 4 * c + 1];
        for ch in 0..c {
            let [inv_std, a, b] = channel_constants(t[ch], t[c + ch], gb[ch], gb[c + ch], self.eps);
            (out[ch], out[c + ch], out[2 * c + ch], out[3 * c + ch]) = (t[ch], inv_std, a, b);
        }
        out[4 * c] = t[3 * c];
        Ok((CpuStorage::F64(out), Shape::from(4 * c + 1)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
        sgb: &candle_core::CudaStorage,
        lgb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::finalize::coefficients(s, l, sgb, lgb, self.eps)
    }
}

/// This rank's backward sums `[Σg'; Σg'·(x − mean)]` (flat f64, 2C) from `(g, x, y)`, the mean
/// read from the held coefficients table; `g'` is `g` masked by `y > 0` with `relu`.
pub(crate) struct Sums {
    pub coef: Tensor,
    pub relu: bool,
}

impl CustomOp3 for Sums {
    fn name(&self) -> &'static str {
        "allgrad-batch-norm-backward-sums"
    }

    fn cpu_fwd(
        &self,
        sg: &CpuStorage,
        lg: &Layout,
        sx: &CpuStorage,
        lx: &Layout,
        sy: &CpuStorage,
        ly: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dims = geometry(lx.dims(), "batch_norm backward")?;
        let c = dims.1;
        let sums = with_cpu_f64(&self.coef, |coef| sums_pairs(sg, lg, sx, lx, sy, ly, &coef[..c], self.relu, dims))??;
        let out: Vec<f64> = sums.iter().map(|s| s.0).chain(sums.iter().map(|s| s.1)).collect();
        Ok((CpuStorage::F64(out), Shape::from(2 * c)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sg: &candle_core::CudaStorage,
        lg: &Layout,
        sx: &candle_core::CudaStorage,
        lx: &Layout,
        sy: &candle_core::CudaStorage,
        ly: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::finalize::backward_sums(&self.coef, self.relu, (sg, lg), (sx, lx), (sy, ly))
    }
}

/// The per-channel `(Σg', Σg'·(x − μ))` of CPU storages of one float type (bf16 widened).
#[allow(clippy::too_many_arguments)]
fn sums_pairs(
    sg: &CpuStorage,
    lg: &Layout,
    sx: &CpuStorage,
    lx: &Layout,
    sy: &CpuStorage,
    ly: &Layout,
    mean: &[f64],
    relu: bool,
    dims: (usize, usize, usize),
) -> Result<Vec<(f64, f64)>> {
    use super::cpu::channel_sums;
    let plan = crate::simd::for_kernel()?;
    Ok(match (sg, sx, sy) {
        (CpuStorage::F32(g), CpuStorage::F32(x), CpuStorage::F32(y)) => {
            channel_sums(plan, &contiguous(g, lg), &contiguous(x, lx), &contiguous(y, ly), mean, relu, dims)
        }
        (CpuStorage::F64(g), CpuStorage::F64(x), CpuStorage::F64(y)) => {
            channel_sums(plan, &contiguous(g, lg), &contiguous(x, lx), &contiguous(y, ly), mean, relu, dims)
        }
        (CpuStorage::BF16(g), CpuStorage::BF16(x), CpuStorage::BF16(y)) => {
            let w = |v: &[half::bf16], l: &Layout| crate::cpu::widen(&contiguous(v, l));
            channel_sums(plan, &w(g, lg), &w(x, lx), &w(y, ly), mean, relu, dims)
        }
        _ => return fail(NnError::UnsupportedDType { op: "batch_norm backward", dtype: sx.dtype() }),
    })
}

/// `(global sums [2C], local sums [2C], coefficients [4C + 1])` → the backward table `[6C]`.
/// `batch`: batch statistics (else fixed: `∂x = a·g'`); `f32`: k, c1, c0, μ rounded to f32 (the
/// compute type of f32 and bf16 tensors), else kept f64.
pub(crate) struct BackwardCoefficients {
    pub batch: bool,
    pub f32: bool,
}

impl CustomOp3 for BackwardCoefficients {
    fn name(&self) -> &'static str {
        "allgrad-batch-norm-backward-coefficients"
    }

    fn cpu_fwd(
        &self,
        sg: &CpuStorage,
        lg: &Layout,
        sl: &CpuStorage,
        ll: &Layout,
        sc: &CpuStorage,
        lc: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (global, local) = (contiguous(sg.as_slice::<f64>()?, lg), contiguous(sl.as_slice::<f64>()?, ll));
        let coef = contiguous(sc.as_slice::<f64>()?, lc);
        let c = local.len() / 2;
        let count = self.batch.then(|| coef[4 * c]);
        let round = |v: f64| if self.f32 { v as f32 as f64 } else { v };
        let mut out = vec![0f64; 6 * c];
        for ch in 0..c {
            let consts = (coef[ch], coef[c + ch], coef[2 * c + ch]);
            let row = channel_backward(round, consts, count, (global[ch], global[c + ch]), (local[ch], local[c + ch]));
            for (r, v) in row.into_iter().enumerate() {
                out[r * c + ch] = v;
            }
        }
        Ok((CpuStorage::F64(out), Shape::from(6 * c)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sg: &candle_core::CudaStorage,
        lg: &Layout,
        sl: &candle_core::CudaStorage,
        ll: &Layout,
        sc: &candle_core::CudaStorage,
        lc: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::finalize::backward_coefficients((sg, lg), (sl, ll), (sc, lc), self.batch, self.f32)
    }
}

/// `∂x = k·g' + c1·(x − μ) + c0` from `(g, x, y)` and the held backward table.
pub(crate) struct Dx {
    pub table: Tensor,
    pub relu: bool,
}

impl CustomOp3 for Dx {
    fn name(&self) -> &'static str {
        "allgrad-batch-norm-backward-dx"
    }

    fn cpu_fwd(
        &self,
        sg: &CpuStorage,
        lg: &Layout,
        sx: &CpuStorage,
        lx: &Layout,
        sy: &CpuStorage,
        ly: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, c, inner) = geometry(lx.dims(), "batch_norm backward")?;
        let relu = self.relu;
        let plan = crate::simd::for_kernel()?;
        let out = with_cpu_f64(&self.table, |t| -> Result<CpuStorage> {
            #[allow(clippy::too_many_arguments)]
            fn run<T: Float>(plan: SimdPlan, g: &[T], x: &[T], y: &[T], t: &[f64], c: usize, relu: bool, inner: usize) -> Vec<T> {
                let row = |r: usize| -> Vec<T> { t[r * c..(r + 1) * c].iter().map(|&v| T::from_f64(v)).collect() };
                super::cpu::dx_kernel(plan, g, x, y, [&row(0), &row(1), &row(2), &row(3)], relu, inner)
            }
            Ok(float_kernel!("batch_norm backward", sg => g, sx => x, sy => y;
                run(plan, &contiguous(g, lg), &contiguous(x, lx), &contiguous(y, ly), t, c, relu, inner)))
        })??;
        Ok((out, lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sg: &candle_core::CudaStorage,
        lg: &Layout,
        sx: &candle_core::CudaStorage,
        lx: &Layout,
        sy: &candle_core::CudaStorage,
        ly: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::finalize::backward_dx(&self.table, self.relu, (sg, lg), (sx, lx), (sy, ly))
    }
}
