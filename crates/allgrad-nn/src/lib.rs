//! Layers and losses that Candle lacks or gets wrong for training, with fast CPU kernels.
//!
//! On the CPU every op here is a Candle custom op with a fused kernel and a backward that is
//! implemented (never `None` for a tracked input), so gradients flow through it:
//!
//! - [`conv2d`]: im2col + GEMM convolution (stride, padding, dilation, groups) whose backward
//!   computes the input and weight gradients as GEMMs too; Candle's CPU backward is several
//!   times slower than its forward. 3x3 layers with stride 1 and padding 1 take Winograd's
//!   F(2x2, 3x3) for the forward and the input gradient (2.25x fewer multiply-adds;
//!   `ALLGRAD_WINOGRAD=0` turns it off).
//! - [`max_pool2d`], [`avg_pool2d`], [`adaptive_avg_pool2d`]: pooling with padding and a
//!   backward for any kernel and stride (Candle's fails when kernel != stride, misplaces
//!   gradients when the kernel does not divide the input, and divides max-pool gradients by
//!   the kernel area).
//! - [`layer_norm`] / [`LayerNorm`]: differentiable in x, gamma and beta (Candle's
//!   `LayerNorm` on a contiguous input is not).
//! - [`softmax_last_dim`], [`log_softmax_last_dim`]: fused, with backward (Candle's
//!   `softmax_last_dim` has none).
//! - [`cross_entropy`]: fused, stable log-sum-exp cross-entropy from logits.
//! - [`relu`], [`add_relu`]: ReLU and the residual `relu(a + b)` in one parallel pass, with a
//!   one-pass backward (Candle's takes five single-threaded passes).
//! - [`gelu_erf`]: exact GELU in one parallel pass each way (composed from Candle's ops it
//!   takes five forward and about ten backward).
//! - [`dropout_mask`]: `x·mask (+ residual)` with a constant mask, one pass each way (Candle's
//!   `x * mask` also differentiates the mask).
//! - [`linear`]: `x·Wᵀ + b` as one GEMM with the bias folded in, and a backward that gives
//!   `∂x`, `∂W` and `∂b` from one op (Candle's walks matmul, transpose and broadcast nodes).
//! - [`attention`]: multi-head self-attention (scores, key mask, softmax, dropout, context,
//!   heads merged) over packed query/key/value projections as one op, with a backward that
//!   recomputes the probabilities (composed from Candle's ops it is about fifteen graph nodes,
//!   each a pass forward and an accumulation backward).
//!   [`causal_attention`]: the same with a causal mask (each query sees its position and the
//!   earlier ones), as a text transformer such as CLIP's runs it.
//! - [`channel_moments`], [`channel_affine`]: the two passes of batch normalisation over
//!   `[N, C, ...]` tensors, fused, with backward (sums in f64).
//! - [`batch_norm`]: the whole batch-norm layer (and a following ReLU or residual
//!   `relu(· + skip)`, or a residual whose shortcut is batch normalised too) as one op on the
//!   CPU, with the statistics given by the caller (summed over ranks for SyncBatchNorm) and a
//!   closed-form two-pass backward.
//!
//! With feature `cuda`, [`relu`], [`add_relu`], [`gelu_erf`], [`layer_norm`] (f32, f64),
//! [`channel_moments`] and [`batch_norm`] (with its tails) have CUDA kernels too, as has the optimizer's in-place update
//! (`optim_cuda`), compiled to PTX at build time, each one kernel per pass and
//! saving what its CPU twin saves (`ALLGRAD_CUDA_FUSED=0` turns them off; see
//! [`has_fused_kernels`]). On other devices, and for dtypes other than f32/f64/bf16, each op
//! falls back to the equivalent Candle op or a composition of differentiable Candle ops, so
//! models run anywhere. bf16 CPU tensors compute in f32 and store bf16; [`autocast`] runs convolutions and
//! dense layers in bf16 beside f32 parameters (PyTorch's `torch.autocast`).
//!
//! Misuse (shapes, parameters, dtypes) fails with an [`NnError`] naming the numbers, wrapped in
//! `candle_core::Error` as the ops return `candle_core::Result`.
//!
//! All ops are local to a rank: their backward returns the gradient of whatever scalar the
//! caller differentiates, with no cross-rank scaling (the trainer applies the 1/W rule). The
//! backward results are not themselves tracked (no second-order gradients), as in Candle.
//! CPU kernels are parallel over rayon's global pool, and every reduction across parallel
//! tasks is summed in a fixed order, so results do not depend on scheduling (they may change
//! in the last bits with the number of threads).
//!
//! ```
//! use allgrad_nn::{conv2d, ConvParams};
//! use candle_core::{DType, Device, Tensor, Var};
//! # fn main() -> candle_core::Result<()> {
//! let x = Var::from_tensor(&Tensor::ones((2, 4, 8, 8), DType::F32, &Device::Cpu)?)?;
//! let w = Var::from_tensor(&Tensor::ones((6, 2, 3, 3), DType::F32, &Device::Cpu)?)?;
//! let params = ConvParams { padding: 1, groups: 2, ..Default::default() };
//! let y = conv2d(&x, &w, params)?;
//! assert_eq!(y.dims(), [2, 6, 8, 8]);
//! let grads = y.sum_all()?.backward()?;
//! assert_eq!(grads.get(&w).unwrap().dims(), [6, 2, 3, 3]);
//! # Ok(())
//! # }
//! ```
#![warn(missing_docs)]

mod activation;
mod attention;
pub mod autocast;
mod backend;
mod batch_norm;
mod channel;
mod conv;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
/// Keeps the CUDA memory pool's memory between steps (feature `cuda`; the trainer calls it for
/// its device).
#[cfg(feature = "cuda")]
pub use cuda::keep_pool_memory;
/// The optimizer's in-place updates of CUDA parameters, one kernel per pass (feature `cuda`):
/// allgrad-train's fused SGD and AdamW run them on GPU parameters.
#[cfg(feature = "cuda")]
pub use cuda::optim as optim_cuda;
mod dropout;
mod error;
mod linear;
mod loss;
mod norm;
mod pool;
mod settings;
mod shape;
mod simd;
mod softmax;
#[cfg(test)]
mod test_data;
mod tf32;
mod trace;
pub mod transfer;
mod vmath;

pub use activation::{add_relu, gelu_erf, gelu_erf_composed, prelu, relu};
pub use attention::{attention, attention_composed, causal_attention, causal_attention_composed};
pub use backend::has_fused_kernels;
pub use batch_norm::finalize;
pub use batch_norm::{batch_norm, BnBranch, BnStats, BnTail, ChannelSum};
pub use channel::{channel_affine, channel_moments};
pub use conv::{conv2d, conv2d_backward, Conv2d, ConvGrads, ConvParams};
#[doc(hidden)]
pub use cpu::{kernel_output, strided_copies};
pub use dropout::dropout_mask;
pub use error::NnError;
pub use finalize::{batch_moments, batch_statistics, TensorSum};
#[doc(hidden)]
pub use linear::dense_product;
pub use linear::{linear, linear_module};
pub use loss::{cross_entropy, per_row_cross_entropy};
pub use norm::{layer_norm, layer_norm_composed, LayerNorm, LayerNormConfig};
pub use pool::{adaptive_avg_pool2d, avg_pool2d, avg_pool2d_composed, max_pool2d, max_pool2d_composed};
pub use settings::{check_settings, parse_switch, CUDA_FUSED_VAR, WINOGRAD_VAR};
#[doc(hidden)]
pub use simd::{force_simd, simd_paths, simd_plan, ForcedSimd, SimdPaths, SimdPlan};
pub use simd::{simd_level, SimdLevel, SIMD_VAR};
pub use softmax::{log_softmax_last_dim, softmax_last_dim};
pub use tf32::{set_tf32, tf32};
pub use trace::{host_traffic, process_host_traffic, set_op_timing, take_op_times, HostTraffic, OpTime, Pass};
#[doc(hidden)]
pub use trace::{kernel_paths, KernelPaths};
#[doc(hidden)]
pub use vmath::exp_at as exp_in_place_at;
/// `v ← e^v` over an f32 slice, vectorised (AVX2 where the CPU has it); relative error a few
/// units in the last place, inputs below -87 give 0, above 88 are clamped (see `vmath`'s tests).
pub use vmath::exp_in_place;
