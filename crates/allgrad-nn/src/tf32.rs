//! TF32: whether f32 matrix products and convolutions on CUDA may use the tensor cores'
//! TF32 format (10-bit mantissa inputs, f32 accumulation), as PyTorch's
//! `torch.backends.cuda.matmul.allow_tf32` and `torch.backends.cudnn.allow_tf32` allow.
//!
//! Off by default: f32 on CUDA is plain f32 arithmetic, comparable with the CPU kernels at f32
//! tolerance. [`set_tf32`] turns it on for the whole process: Candle's cuBLAS GEMMs (matmul,
//! [`crate::linear`]) take `CUBLAS_COMPUTE_32F_FAST_TF32` and [`crate::conv2d`]'s cuDNN calls
//! take `CUDNN_DEFAULT_MATH`. CPU tensors, f64 and bf16 are not affected. The trainer sets it
//! from `precision: tf32`.

use std::sync::atomic::{AtomicBool, Ordering};

static TF32: AtomicBool = AtomicBool::new(false);

/// Lets (`true`) or forbids (`false`, the default) TF32 in f32 GEMMs and convolutions on CUDA,
/// for every thread of the process. Has no effect on a build without the `cuda` feature.
pub fn set_tf32(on: bool) {
    TF32.store(on, Ordering::Relaxed);
    #[cfg(feature = "cuda")]
    candle_core::cuda::set_gemm_reduced_precision_f32(on);
}

/// Whether TF32 is allowed ([`set_tf32`]).
pub fn tf32() -> bool {
    TF32.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_switch_is_off_by_default_and_round_trips() {
        assert!(!tf32(), "TF32 must be off unless asked for");
        set_tf32(true);
        assert!(tf32());
        #[cfg(feature = "cuda")]
        assert!(candle_core::cuda::gemm_reduced_precision_f32(), "Candle's GEMM flag follows the switch");
        set_tf32(false);
        assert!(!tf32());
        #[cfg(feature = "cuda")]
        assert!(!candle_core::cuda::gemm_reduced_precision_f32());
    }
}
