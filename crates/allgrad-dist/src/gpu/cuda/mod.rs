//! The CUDA side of the GPU backend (feature `cuda`): driver errors as [`DistError`]s, the
//! physical GPU of a device (its UUID), and the pinned host buffer of a group's `host` path
//! (`staging`). The collectives of CUDA tensors that use them are in `group/cuda/`.
//!
//! Nothing here runs in this repository's CI: it is type-checked there
//! (`scripts/ci/check_cuda_build.sh`) and exercised by `scripts/ci/gpu_ci.sh` on a GPU machine.

mod staging;

pub(crate) use staging::Staging;

use candle_core::CudaDevice;

use crate::error::{DistError, DistResult};
use crate::gpu::GpuId;

/// A CUDA driver error as a [`DistError`] saying where it happened.
pub(crate) fn cuda<T>(r: std::result::Result<T, candle_core::cuda::cudarc::driver::DriverError>, what: &str) -> DistResult<T> {
    r.map_err(|e| DistError::Invalid(format!("CUDA failed in {what}: {e:?}")))
}

/// The physical GPU of `device`, as its peers will see it.
pub(crate) fn gpu_id(device: &CudaDevice) -> DistResult<GpuId> {
    let ctx = device.cuda_stream().context().clone();
    let uuid = cuda(ctx.uuid(), &format!("reading the UUID of CUDA device {}", ctx.ordinal()))?;
    Ok(GpuId { uuid: uuid.bytes.map(|b| b as u8), ordinal: ctx.ordinal() })
}
