//! bf16 autocast: convolutions and dense layers compute in bf16 while the parameters stay f32,
//! as in PyTorch's `torch.autocast(device_type, dtype=torch.bfloat16)`.
//!
//! While an [`Autocast`] guard is alive on a thread, [`crate::conv2d`], [`crate::linear`] and
//! [`crate::linear_module`] cast their f32 input to bf16 (a differentiable cast) and return bf16. Their
//! f32 parameters enter the CPU kernels rounded to bf16, so the forward is PyTorch's; the
//! gradient of such a parameter comes back f32, computed in f32 from the same bf16 values and
//! not rounded (PyTorch rounds it to bf16 before casting it back: unrounded, a W-rank run and
//! gradient caching stay equal to the one-rank plain step to f32 accuracy instead of bf16's).
//! Off the CPU the parameters are cast to bf16 as in PyTorch. The ops that follow take their
//! input's dtype:
//! batch norm (with its f32 parameters and statistics), ReLU and the residual `relu(a + b)`,
//! pooling, GELU, attention, dropout and layer norm run on bf16 activations, so those
//! activations are stored, and kept for the backward, in half the memory. What must stay
//! f32 is cast back with [`full`]: the losses take their embeddings through it, so the
//! logits, the loss and everything the loss communicates are f32.
//!
//! On the CPU every bf16 kernel widens its inputs to f32 (exactly), computes in f32 and rounds
//! what it stores to bf16 (to nearest, ties to even): the arithmetic of PyTorch's CPU kernels
//! for bf16 tensors, whose matrix products also accumulate in f32. Sums and statistics are
//! f32 or f64 throughout.
//!
//! The state is per thread, like PyTorch's: take the guard on the thread that runs the
//! forward. Backward passes do not consult it (each op's backward follows the dtypes its
//! forward recorded).
//!
//! ```
//! use allgrad_nn::autocast::Autocast;
//! use candle_core::{DType, Device, Tensor, Var};
//! # fn main() -> candle_core::Result<()> {
//! let x = Tensor::ones((2, 3), DType::F32, &Device::Cpu)?;
//! let w = Var::from_tensor(&Tensor::ones((4, 3), DType::F32, &Device::Cpu)?)?;
//! let y = {
//!     let _bf16 = Autocast::bf16();
//!     allgrad_nn::linear(&x, w.as_tensor(), None)?
//! };
//! assert_eq!(y.dtype(), DType::BF16);
//! let grads = allgrad_nn::autocast::full(&y)?.sum_all()?.backward()?;
//! assert_eq!(grads.get(w.as_tensor()).unwrap().dtype(), DType::F32);
//! # Ok(())
//! # }
//! ```

use std::cell::Cell;

use candle_core::{DType, Result, Tensor};

thread_local! {
    /// The dtype autocast ops compute in on this thread (`None`: their inputs' own).
    static COMPUTE: Cell<Option<DType>> = const { Cell::new(None) };
}

/// While alive, autocast is in the state it set on this thread; dropping it restores the
/// previous state (guards nest).
#[must_use = "autocast lasts as long as the guard"]
pub struct Autocast {
    previous: Option<DType>,
}

impl Autocast {
    /// bf16 autocast on this thread until the guard is dropped.
    pub fn bf16() -> Autocast {
        Autocast { previous: COMPUTE.with(|c| c.replace(Some(DType::BF16))) }
    }

    /// No autocast on this thread until the guard is dropped (a region that must run in the
    /// parameters' precision inside an autocast one).
    pub fn off() -> Autocast {
        Autocast { previous: COMPUTE.with(|c| c.replace(None)) }
    }
}

impl Drop for Autocast {
    fn drop(&mut self) {
        COMPUTE.with(|c| c.set(self.previous));
    }
}

/// The dtype the autocast ops compute in on this thread: `Some(DType::BF16)` inside
/// [`Autocast::bf16`], else `None`.
pub fn compute_dtype() -> Option<DType> {
    COMPUTE.with(Cell::get)
}

/// `t` as an operand of an autocast op: cast to bf16 (differentiably) when autocast is on and
/// `t` is f32; otherwise `t` itself.
pub fn operand(t: &Tensor) -> Result<Tensor> {
    match compute_dtype() {
        Some(dt) if t.dtype() == DType::F32 => t.to_dtype(dt),
        _ => Ok(t.clone()),
    }
}

/// `t` in f32 when it is bf16 (differentiably), otherwise `t` itself: for what stays in full
/// precision under autocast (losses and their logits, statistics, residual sums with f32).
pub fn full(t: &Tensor) -> Result<Tensor> {
    if t.dtype() == DType::BF16 {
        t.to_dtype(DType::F32)
    } else {
        Ok(t.clone())
    }
}
