//! The cross-backend dispatch: which kernels a tensor takes. The CPU kernels (`crate::cpu` and
//! each op's `cpu_fwd`) for f32, f64 and bf16 CPU tensors; the fused CUDA kernels
//! (`crate::cuda`, feature `cuda`) for CUDA tensors of those dtypes unless
//! `ALLGRAD_CUDA_FUSED=0`; elsewhere each op composes Candle's ops. The ops ask here, so
//! neither kernel module knows of the other.

use candle_core::{DType, Result, Tensor};

/// Whether `t` takes the CPU kernels: a CPU tensor of f32, f64 or bf16 (bf16 computed in f32,
/// see `crate::cpu::float_kernel`).
pub(crate) fn cpu_float(t: &Tensor) -> bool {
    t.device().is_cpu() && matches!(t.dtype(), DType::F32 | DType::F64 | DType::BF16)
}

/// Whether `t` takes the fused CUDA kernels (`crate::cuda`): a CUDA tensor of f32, f64 or bf16
/// in a build with feature `cuda`, unless `ALLGRAD_CUDA_FUSED=0`.
pub(crate) fn cuda_float(t: &Tensor) -> bool {
    #[cfg(feature = "cuda")]
    {
        crate::cuda::takes(t)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = t;
        false
    }
}

/// Whether `t` takes a fused kernel of the ops that have both a CPU and a CUDA one (ReLU,
/// add+ReLU, channel moments, batch norm): [`cpu_float`] or [`cuda_float`].
pub(crate) fn fused_float(t: &Tensor) -> bool {
    cpu_float(t) || cuda_float(t)
}

/// Whether `t`'s device and dtype have the fused kernels of [`crate::relu`],
/// [`crate::add_relu`], [`crate::channel_moments`] and [`crate::batch_norm`]: an f32, f64 or
/// bf16 tensor on the CPU, or on CUDA in a build with feature `cuda` unless
/// `ALLGRAD_CUDA_FUSED=0`. Elsewhere [`crate::batch_norm`] fails and the others compose
/// Candle's ops.
pub fn has_fused_kernels(t: &Tensor) -> bool {
    fused_float(t)
}

/// `t` as the fused kernels read it: on CUDA contiguous (the CUDA kernels read dense storage),
/// elsewhere as it is (the CPU kernels gather strided views themselves).
pub(crate) fn dense(t: &Tensor) -> Result<Tensor> {
    if t.device().is_cuda() {
        t.contiguous()
    } else {
        Ok(t.clone())
    }
}
