//! The softmax temperature of a contrastive loss, fixed or learned: what the untiled losses
//! ([`crate::losses`]) and the tiled ones ([`crate::tiled`]) divide their logits by.

use candle_core::{DType, Device, Result, Tensor};

use crate::error::fail;
use crate::ModelError;

/// The softmax temperature of a contrastive loss: a fixed number, or a scalar tensor (shape
/// `[]` or `[1]`, usually a parameter) through which the loss is differentiable.
#[derive(Clone, Debug)]
pub enum Temperature {
    /// A fixed value (a config value).
    Fixed(f64),
    /// A learned value: the loss's gradient reaches it.
    Learned(Tensor),
}

impl From<f64> for Temperature {
    fn from(t: f64) -> Self {
        Temperature::Fixed(t)
    }
}

impl From<Tensor> for Temperature {
    fn from(t: Tensor) -> Self {
        Temperature::Learned(t)
    }
}

impl From<&Tensor> for Temperature {
    fn from(t: &Tensor) -> Self {
        Temperature::Learned(t.clone())
    }
}

impl Temperature {
    /// Fails unless the temperature is one positive, finite number. A learned one is read for
    /// that on the host path only: on a device (and the CPU's device path) reading it would stop
    /// the host in every step, so only its shape is checked there (a learned temperature is
    /// usually positive by construction, as CLIP's `1 / exp(logit_scale)`).
    pub fn check(&self) -> Result<()> {
        let value = match self {
            Temperature::Fixed(t) => *t,
            Temperature::Learned(t) => {
                if t.elem_count() != 1 {
                    return fail(ModelError::TiledInput(format!("a temperature must be one number, got shape {:?}", t.dims())));
                }
                if allgrad_nn::transfer::takes_device_path(t.device()) {
                    return Ok(());
                }
                t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?[0]
            }
        };
        if !(value > 0.0 && value.is_finite()) {
            return fail(ModelError::LossValue { key: "temperature", expected: "positive", value });
        }
        Ok(())
    }

    /// `logits / τ` (differentiable in a learned τ).
    pub fn divide(&self, logits: &Tensor) -> Result<Tensor> {
        match self {
            Temperature::Fixed(t) => logits / *t,
            Temperature::Learned(t) => logits.broadcast_div(&t.flatten_all()?.to_dtype(logits.dtype())?),
        }
    }

    /// The temperature as a tensor of `dtype` on `device`: a constant `[]` for a fixed one,
    /// the learned tensor itself (converted if needed) otherwise.
    pub fn tensor(&self, dtype: DType, device: &Device) -> Result<Tensor> {
        match self {
            // Made on the device (1 · τ), not uploaded.
            Temperature::Fixed(t) => Tensor::ones((), dtype, device)?.affine(*t, 0.0),
            Temperature::Learned(t) => t.to_dtype(dtype)?.to_device(device),
        }
    }
}
