//! The `precision` key: full precision, or bf16 autocast of the training step.
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

use crate::error::TrainResult;

/// The compute precision of the training step (the `precision` key).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ComputePrecision {
    /// Everything in the parameters' dtype (`dtype`).
    #[default]
    Full,
    /// bf16 autocast of the forward, f32 parameters, optimizer state, statistics, losses and
    /// gradients (see the module docs). Needs `dtype: f32`.
    Bf16,
}

impl ComputePrecision {
    /// Checks the precision against the parameters' dtype; the message names both keys.
    pub fn check_dtype(self, dtype: DType) -> Result<(), String> {
        if self == ComputePrecision::Bf16 && dtype != DType::F32 {
            let name = format!("{dtype:?}").to_lowercase();
            return Err(format!(
                "precision: bf16 computes in bf16 beside f32 master weights: it needs dtype: f32, not dtype: {name} \
                 (use precision: full for {name} runs)"
            ));
        }
        Ok(())
    }

    /// Checks that `device` can compute in this precision: every CPU can; a CUDA device needs
    /// compute capability 8.0 or newer for bf16.
    pub fn check_device(self, device: &Device) -> TrainResult<()> {
        if self == ComputePrecision::Full {
            return Ok(());
        }
        #[cfg(feature = "cuda")]
        if let Device::Cuda(d) = device {
            let (major, minor) = d.cuda_stream().context().compute_capability().map_err(|e| {
                crate::error::TrainError::Setup(format!("precision: bf16: cannot read the GPU's compute capability: {e}"))
            })?;
            if major < 8 {
                return Err(crate::error::TrainError::Setup(format!(
                    "precision: bf16 needs a GPU of compute capability 8.0 or newer (Ampere); this one is {major}.{minor}: \
                     use precision: full"
                )));
            }
        }
        let _ = device;
        Ok(())
    }

    /// The autocast guard of this precision for the current thread (`None`: full precision).
    pub fn autocast(self) -> Option<allgrad_nn::autocast::Autocast> {
        match self {
            ComputePrecision::Full => None,
            ComputePrecision::Bf16 => Some(allgrad_nn::autocast::Autocast::bf16()),
        }
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
    fn every_cpu_computes_in_bf16() {
        ComputePrecision::Bf16.check_device(&Device::Cpu).unwrap();
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
