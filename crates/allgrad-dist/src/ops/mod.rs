//! Differentiable collectives: Candle custom ops whose backward is mathematically right.
//!
//! # The gradient convention (the sum rule)
//!
//! A distributed step optimises the MEAN over ranks of the per-rank losses,
//! `J = (1/W) Σ_r L_r`. The backward of every op here returns, on rank r,
//! `∂(Σ_k L_k) / ∂x_r`: the gradient of the SUM of all ranks' losses with respect to this
//! rank's input. Hence:
//!
//! | forward                | backward (what rank r receives)                                   |
//! |------------------------|-------------------------------------------------------------------|
//! | `all_gather`           | reduce_scatter(Sum) of the output gradients (uneven sizes too)    |
//! | `all_reduce(Sum)`      | all_reduce(Sum) of the output gradients                           |
//! | `all_reduce(Avg)`      | all_reduce(Sum) / W                                               |
//! | `all_reduce(Prod)`     | `Σ_k g_k · Π_{j≠r} x_j`, computed without dividing by `x_r`: right with zeros |
//! | `all_reduce(Max/Min)`  | `Σ_k g_k` to the rank(s) holding the extremum; a tie splits it equally among the holders; a NaN extremum passes no gradient |
//! | `reduce_scatter(op)`   | as `all_reduce(op)` restricted to this rank's block: all_gather for Sum |
//! | `broadcast(src)`       | reduce(Sum) of the gradients to `src`; zero on the other ranks    |
//! | `all_to_all`           | the inverse all_to_all of the gradients                           |
//! | `ppermute(dst_of)`     | the inverse permutation of the gradients (`ring_shift(k)`: a shift by `-k`) |
//!
//! The trainer scales every gradient by 1/W and sums replicated parameters across ranks
//! (DDP's average); with that single rule a W-rank run equals a 1-rank run on the global
//! batch. **Outside the trainer**, a loss computed on every rank yields W times the
//! single-process gradient; divide the loss by W (`loss / W`) to get it back.
//!
//! # The seed example
//!
//! Two ranks, `x = 1` on rank 0 and `0` on rank 1; `y = x + 2`, `z = y * y`, all_gather,
//! `r = z_0 * z_1`, `out = r.mean()`: the sum rule gives `y.grad` = 12 on rank 0 and 18 on
//! rank 1; with `out / W` it gives 6 and 9 — the single-process answer. (See
//! `examples/seed_gather.rs`.)
//!
//! ```
//! use allgrad_dist::{all_gather, run_threads};
//! use candle_core::{Device, Tensor, Var};
//! let grads = run_threads(2, |pg| {
//!     let x = Var::from_tensor(&Tensor::full(1.0f64 - pg.rank() as f64, (2, 2), &Device::Cpu)?)?;
//!     let y = (x.as_tensor() + 2.0)?;
//!     let z = (&y * &y)?;
//!     let g = all_gather(&z, &pg)?;
//!     let out = (g.narrow(0, 0, 2)? * g.narrow(0, 2, 2)?)?.mean_all()?;
//!     let grads = out.backward()?;
//!     // y = x + 2, so y's gradient is x's.
//!     Ok(grads.get(&x).unwrap().flatten_all()?.to_vec1::<f64>()?[0])
//! })
//! .unwrap();
//! assert_eq!(grads, vec![12.0, 18.0]);
//! ```
//!
//! Ranks must run identical graphs: a collective whose output does not reach the loss on
//! one rank is skipped by that rank's backward while the others wait for it (they fail at
//! the timeout, naming the call).
//!
//! Inputs may be non-contiguous, of any float dtype, on any device: CUDA tensors take their
//! group's CUDA path ([`crate::gpu`]: NCCL on the device, or staged through a pinned host
//! buffer and the CPU backend), with the same backward rules (the backward's collectives run
//! on the gradients' device); other non-CPU tensors are staged through host memory by the
//! CPU backend. When the input does not track gradients the op is a plain collective.

mod all_gather;
mod all_reduce;
mod all_to_all;
mod broadcast;
mod ppermute;
mod reduce_scatter;

pub use all_gather::all_gather;
pub use all_reduce::all_reduce;
pub use all_to_all::{all_to_all, all_to_all_sizes};
pub use broadcast::broadcast;
pub use ppermute::{ppermute, ring_destinations, ring_shift};
pub use reduce_scatter::reduce_scatter;

use std::sync::OnceLock;

use candle_core::{CpuStorage, Device, Layout, Result, Shape, Tensor, WithDType};

use crate::group::host_ops::Kind;
use crate::group::ProcessGroup;
use crate::reduce::ReduceOp;

/// Applies a collective's custom op to `x`: directly on the CPU and on CUDA (the op's
/// `cuda_fwd` takes the group's CUDA path); tensors of other devices are staged through host
/// memory (the copies are differentiable, so gradients flow back to the original device).
pub(crate) fn on_host(x: &Tensor, f: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let x = x.contiguous()?;
    if x.device().is_cpu() || x.device().is_cuda() {
        f(&x)
    } else {
        let dev = x.device().clone();
        f(&x.to_device(&Device::Cpu)?)?.to_device(&dev)
    }
}

/// The `cpu_fwd` of the differentiable ops: runs `kind` on the CPU backend and records the
/// rows per rank it learned (all_gather, all_to_all) in `sizes`.
pub(crate) fn host_fwd(
    pg: &ProcessGroup,
    kind: Kind,
    s: &CpuStorage,
    l: &Layout,
    sizes: Option<&OnceLock<Vec<usize>>>,
) -> Result<(CpuStorage, Shape)> {
    let (start, end) =
        l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("collective input is not contiguous".into()))?;
    crate::with_elem_type!(candle_core::backend::BackendStorage::dtype(s), T => {
        let v: &[T] = &s.as_slice::<T>()?[start..end];
        let out = crate::group::host_ops::run(pg, &kind, v, l.dims())?;
        if let (Some(cell), Some(learned)) = (sizes, out.sizes) {
            let _ = cell.set(learned);
        }
        Ok((T::to_cpu_storage_owned(out.data), Shape::from(out.dims)))
    }, d => Err(crate::dispatch::unsupported_dtype(d).into()))
}

/// The `cuda_fwd` of the differentiable ops: runs `kind` through the group's CUDA path and
/// records the rows per rank it learned (all_gather, all_to_all) in `sizes`.
#[cfg(feature = "cuda")]
pub(crate) fn cuda_fwd(
    pg: &ProcessGroup,
    kind: Kind,
    s: &candle_core::CudaStorage,
    l: &Layout,
    sizes: Option<&OnceLock<Vec<usize>>>,
) -> Result<(candle_core::CudaStorage, Shape)> {
    let (out, shape, learned) = crate::group::cuda::forward(pg, &kind, s, l)?;
    if let (Some(cell), Some(v)) = (sizes, learned) {
        let _ = cell.set(v);
    }
    Ok((out, shape))
}

/// The gradient of an element-wise reduction `out = op_j x_j` with respect to this rank's
/// `x`, given `g_sum = Σ_k g_k`, the sum over ranks of the gradients of `out` (all three
/// tensors have the same shape). Implements the table in the module docs.
pub(crate) fn reduction_grad(pg: &ProcessGroup, op: ReduceOp, x: &Tensor, out: &Tensor, g_sum: &Tensor) -> Result<Tensor> {
    let w = pg.world_size();
    match op {
        ReduceOp::Sum => Ok(g_sum.clone()),
        ReduceOp::Avg => g_sum / w as f64,
        ReduceOp::Prod => {
            // Π_{j≠r} x_j from every rank's x, by multiplication only (no division by x_r).
            let all = pg.all_gather(&x.unsqueeze(0)?)?;
            let mut others = Tensor::ones_like(x)?;
            for j in (0..w).filter(|j| *j != pg.rank()) {
                others = others.mul(&all.get(j)?)?;
            }
            g_sum * others
        }
        ReduceOp::Max | ReduceOp::Min => {
            // The holders of the extremum share the gradient equally.
            // Counted and divided in the gradient's own dtype: a 1/3 share in f32 would cost
            // an f64 run seven digits.
            let holds = x.eq(out)?.to_dtype(g_sum.dtype())?;
            let holders = pg.all_reduce(&holds, ReduceOp::Sum)?;
            // 1 made on the device (a fill), not uploaded as Candle's scalar operand would be.
            let one = Tensor::full(1.0f64, (), holders.device())?.to_dtype(holders.dtype())?;
            g_sum * holds.div(&holders.broadcast_maximum(&one)?)?
        }
    }
}
