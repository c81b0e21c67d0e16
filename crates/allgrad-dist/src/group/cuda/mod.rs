//! Collectives of CUDA tensors (feature `cuda`): every call goes to the group's path
//! ([`crate::gpu`], chosen once in `cuda_path`): NCCL on the devices (`nccl`, feature `nccl`)
//! or the CPU backend through the group's pinned host buffer (`host`); the plain collectives
//! are Candle ops that keep their output on the device. The device resources they use (the
//! pinned buffer, the NCCL communicator) are in [`crate::gpu`].
//!
//! Nothing here runs in this repository's CI: it is type-checked there
//! (`scripts/ci/check_cuda_build.sh`) and exercised by `scripts/ci/gpu_ci.sh` on a GPU machine.
//! The parts that are not CUDA calls (choosing the path, the host half of the `host` path)
//! are tested on the CPU.

mod host;
#[cfg(feature = "nccl")]
mod nccl;
#[cfg(feature = "nccl")]
mod ring;

use std::sync::OnceLock;

use candle_core::{CudaStorage, CustomOp1, Device, Layout, Result, Shape, Tensor};

#[cfg(not(feature = "nccl"))]
use crate::error::DistError;
use crate::gpu::CudaPath;
use crate::group::host_ops::Kind;
use crate::group::ProcessGroup;
use crate::reduce::ReduceOp;
#[cfg(feature = "nccl")]
pub(crate) use ring::{ring_comm, ring_exchange, ring_settle};

/// A collective's output on the device: storage, shape and, for all_gather and all_to_all,
/// the rows per rank.
pub(crate) type Out = (CudaStorage, Shape, Option<Vec<usize>>);

/// Runs `kind` on the CUDA storage `s` (layout `l`, contiguous) through the group's path.
pub(crate) fn forward(pg: &ProcessGroup, kind: &Kind, s: &CudaStorage, l: &Layout) -> Result<Out> {
    match pg.cuda_path_of(&s.device)? {
        #[cfg(feature = "nccl")]
        CudaPath::Nccl => nccl::forward(pg, kind, s, l),
        #[cfg(not(feature = "nccl"))]
        CudaPath::Nccl => Err(DistError::Invalid("the nccl path was chosen in a build without the `nccl` feature".into()).into()),
        CudaPath::Host => host::forward(pg, kind, s, l),
    }
}

/// A CUDA collective as a Candle op without backward, so that its output stays on the device.
struct Plain {
    pg: ProcessGroup,
    kind: Kind,
    /// Rows per rank learned by the call (all_gather: each rank's; all_to_all: received).
    sizes: OnceLock<Vec<usize>>,
}

impl CustomOp1 for Plain {
    fn name(&self) -> &'static str {
        "allgrad.cuda_collective"
    }
    fn cpu_fwd(&self, _: &candle_core::CpuStorage, _: &Layout) -> Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("this op runs collectives of CUDA tensors only")
    }
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let (out, shape, sizes) = forward(&self.pg, &self.kind, s, l)?;
        if let Some(sizes) = sizes {
            let _ = self.sizes.set(sizes);
        }
        Ok((out, shape))
    }
}

fn plain(pg: &ProcessGroup, x: &Tensor, kind: Kind) -> Result<(Tensor, Vec<usize>)> {
    let op = Plain { pg: pg.clone(), kind, sizes: OnceLock::new() };
    let out = x.contiguous()?.apply_op1_no_bwd(&op)?;
    Ok((out, op.sizes.into_inner().unwrap_or_default()))
}

/// All-reduces a CUDA tensor.
pub(crate) fn all_reduce(pg: &ProcessGroup, x: &Tensor, op: ReduceOp) -> Result<Tensor> {
    Ok(plain(pg, x, Kind::AllReduce(op))?.0)
}
/// Gathers a CUDA tensor along dim 0; returns every rank's dim-0 size too.
pub(crate) fn all_gather(pg: &ProcessGroup, x: &Tensor) -> Result<(Tensor, Vec<usize>)> {
    plain(pg, x, Kind::AllGather)
}
/// Reduce-scatters a CUDA tensor along dim 0 into blocks of `rows[r]` rows.
pub(crate) fn reduce_scatter(pg: &ProcessGroup, x: &Tensor, op: ReduceOp, rows: &[usize]) -> Result<Tensor> {
    Ok(plain(pg, x, Kind::ReduceScatter(op, rows.to_vec()))?.0)
}
/// Broadcasts rank `root`'s CUDA tensor.
pub(crate) fn broadcast(pg: &ProcessGroup, x: &Tensor, root: usize) -> Result<Tensor> {
    Ok(plain(pg, x, Kind::Broadcast(root))?.0)
}
/// Reduces CUDA tensors to rank `root`.
pub(crate) fn reduce(pg: &ProcessGroup, x: &Tensor, root: usize, op: ReduceOp) -> Result<Tensor> {
    Ok(plain(pg, x, Kind::Reduce(op, root))?.0)
}
/// Sends `rows[j]` rows of a CUDA tensor to rank j; returns the rows received per rank too.
pub(crate) fn all_to_all(pg: &ProcessGroup, x: &Tensor, rows: &[usize]) -> Result<(Tensor, Vec<usize>)> {
    plain(pg, x, Kind::AllToAll(rows.to_vec()))
}

/// Sends a CUDA tensor to rank `dst_of[rank]`; returns the tensor received.
pub(crate) fn permute(pg: &ProcessGroup, x: &Tensor, dst_of: &[usize]) -> Result<Tensor> {
    Ok(plain(pg, x, Kind::Permute(dst_of.to_vec()))?.0)
}

/// Waits until every rank's `device` has reached this point: an all_reduce of one element
/// on the device, waited for (through NCCL, or through the host, whose copies wait for the
/// device's queued work).
pub(crate) fn device_barrier(pg: &ProcessGroup, device: &Device) -> Result<()> {
    let out = all_reduce(pg, &Tensor::zeros(1, candle_core::DType::F32, device)?, ReduceOp::Sum)?;
    device.synchronize()?;
    drop(out);
    Ok(())
}
