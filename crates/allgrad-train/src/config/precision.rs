//! The `precision` key: full precision, TF32 on a GPU, or bf16 autocast of the training step.
//!
//! With `precision: tf32` the step is f32 throughout, but f32 matrix products and convolutions
//! on CUDA may use the tensor cores' TF32 format (inputs rounded to a 10-bit mantissa, sums in
//! f32), as PyTorch's `allow_tf32` flags allow ([`allgrad_nn::set_tf32`]); on the CPU it is
//! `full` (there is no TF32 there). Needs `dtype: f32`.
//!
//! With `precision: bf16` the trainer runs each step's forward under
//! [`allgrad_nn::autocast::Autocast::bf16`]: convolutions and dense layers compute in bf16, and
//! the activations between them (batch norm, ReLU, residual sums, pooling, GELU, attention,
//! dropout) are bf16, so the activations kept for the backward take half the memory. In f32
//! stay: the parameters (master weights) and the optimizer's state, the batch-norm statistics
//! (moments in f64) and running statistics, the losses with their logits (the losses cast
//! their embeddings to f32), everything the losses communicate, the gradients of the
//! parameters and therefore their all-reduce across ranks (f32 communication). BERT's residual
//! stream stays f32, as PyTorch's type promotion keeps it. Evaluation runs in full precision.
//!
//! bf16 needs f32 parameters (`dtype: f32`). On the CPU every build supports it (the kernels
//! widen bf16 to f32 to compute, as PyTorch's do); a CUDA device needs compute capability 8.0
//! or newer (Ampere), where bf16 arithmetic exists.

use candle_core::{DType, Device};
use serde::{Deserialize, Serialize};

/// The compute precision of the training step (the `precision` key).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ComputePrecision {
    /// Everything in the parameters' dtype (`dtype`).
    #[default]
    Full,
    /// f32, with TF32 tensor-core matrix products and convolutions on CUDA (see the module
    /// docs). Needs `dtype: f32`.
    Tf32,
    /// bf16 autocast of the forward, f32 parameters, optimizer state, statistics, losses and
    /// gradients (see the module docs). Needs `dtype: f32`.
    Bf16,
}

impl ComputePrecision {
    /// Checks the precision against the parameters' dtype; the message names both keys.
    pub fn check_dtype(self, dtype: DType) -> Result<(), String> {
        let name = format!("{dtype:?}").to_lowercase();
        match self {
            ComputePrecision::Bf16 if dtype != DType::F32 => Err(format!(
                "precision: bf16 computes in bf16 beside f32 master weights: it needs dtype: f32, not dtype: {name} \
                 (use precision: full for {name} runs)"
            )),
            ComputePrecision::Tf32 if dtype != DType::F32 => Err(format!(
                "precision: tf32 is a mode of f32 arithmetic: it needs dtype: f32, not dtype: {name} \
                 (use precision: full for {name} runs)"
            )),
            _ => Ok(()),
        }
    }

    /// Checks that `device` can compute in this precision: every CPU can (tf32 is f32 there); a
    /// CUDA device needs compute capability 8.0 or newer for bf16 and tf32. `Err` holds the
    /// message, naming the key and what to do.
    pub fn check_device(self, device: &Device) -> Result<(), String> {
        if self == ComputePrecision::Full {
            return Ok(());
        }
        #[cfg(feature = "cuda")]
        let key = if self == ComputePrecision::Tf32 { "tf32" } else { "bf16" };
        #[cfg(feature = "cuda")]
        if let Device::Cuda(d) = device {
            let (major, minor) = d
                .cuda_stream()
                .context()
                .compute_capability()
                .map_err(|e| format!("precision: {key}: cannot read the GPU's compute capability: {e}"))?;
            if major < 8 {
                return Err(format!(
                    "precision: {key} needs a GPU of compute capability 8.0 or newer (Ampere); this one is {major}.{minor}: \
                     use precision: full"
                ));
            }
        }
        let _ = device;
        Ok(())
    }

    /// The autocast guard of this precision for the current thread (`None`: no autocast).
    pub fn autocast(self) -> Option<allgrad_nn::autocast::Autocast> {
        match self {
            ComputePrecision::Full | ComputePrecision::Tf32 => None,
            ComputePrecision::Bf16 => Some(allgrad_nn::autocast::Autocast::bf16()),
        }
    }

    /// Sets the process-wide TF32 switch ([`allgrad_nn::set_tf32`]) to this precision: on for
    /// `tf32`, off otherwise. The trainer calls it at start.
    pub fn apply_tf32(self) {
        allgrad_nn::set_tf32(self == ComputePrecision::Tf32);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_needs_f32_parameters_and_the_message_names_both_keys() {
        assert!(ComputePrecision::Bf16.check_dtype(DType::F32).is_ok());
        assert!(ComputePrecision::Full.check_dtype(DType::F64).is_ok());
        let e = ComputePrecision::Bf16.check_dtype(DType::F64).unwrap_err();
        assert!(e.contains("precision: bf16") && e.contains("dtype: f32") && e.contains("dtype: f64"), "{e}");
    }

    #[test]
    fn tf32_needs_f32_parameters_and_the_message_names_both_keys() {
        assert!(ComputePrecision::Tf32.check_dtype(DType::F32).is_ok());
        let e = ComputePrecision::Tf32.check_dtype(DType::F64).unwrap_err();
        assert!(e.contains("precision: tf32") && e.contains("dtype: f32") && e.contains("dtype: f64"), "{e}");
    }

    #[test]
    fn every_cpu_computes_in_bf16_and_tf32() {
        ComputePrecision::Bf16.check_device(&Device::Cpu).unwrap();
        ComputePrecision::Tf32.check_device(&Device::Cpu).unwrap();
    }

    #[test]
    fn tf32_has_no_autocast_guard() {
        assert!(ComputePrecision::Tf32.autocast().is_none());
        assert_eq!(allgrad_nn::autocast::compute_dtype(), None);
    }

    #[test]
    fn the_guard_is_on_only_for_bf16() {
        assert!(ComputePrecision::Full.autocast().is_none());
        let guard = ComputePrecision::Bf16.autocast();
        assert_eq!(allgrad_nn::autocast::compute_dtype(), Some(DType::BF16));
        drop(guard);
        assert_eq!(allgrad_nn::autocast::compute_dtype(), None);
    }
}
