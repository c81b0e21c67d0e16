//! The `host` path of collectives of CUDA tensors: the input is copied into the group's
//! pinned host buffer (`gpu::cuda::Staging`: page-locked, so the copy is a direct DMA;
//! allocated once, grown to the largest collective and reused), the CPU backend runs the
//! collective on it ([`run_staged`], the code a CPU tensor runs) and the result is copied to
//! a new allocation on the tensor's device. In-place collectives (all_reduce, broadcast,
//! reduce) run on the pinned buffer and are copied back from it; the others (all_gather,
//! reduce_scatter, all_to_all) copy back the CPU backend's output vector.
//!
//! Every copy is waited for before the call returns: the CPU backend needs the values, and
//! the buffer is reused by the next call.

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::DeviceRepr;
use candle_core::cuda::CudaDType;
use candle_core::host_traffic;
use candle_core::{CudaStorage, Device, Layout, Result, Shape};

use super::Out;
use crate::dispatch::unsupported_dtype;
use crate::gpu::cuda::cuda;
use crate::group::host_ops::{run_staged, Kind};
use crate::group::ProcessGroup;
use crate::reduce::Elem;

/// Runs `kind` on the CUDA storage `s` (layout `l`, contiguous) through host memory.
pub(crate) fn forward(pg: &ProcessGroup, kind: &Kind, s: &CudaStorage, l: &Layout) -> Result<Out> {
    crate::with_elem_type!(s.dtype(), T => typed::<T>(pg, kind, s, l), d => Err(unsupported_dtype(d).into()))
}

fn typed<T: Elem + CudaDType + DeviceRepr>(pg: &ProcessGroup, kind: &Kind, s: &CudaStorage, l: &Layout) -> Result<Out> {
    let (start, end) =
        l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("collective input is not contiguous".into()))?;
    let dev = s.device.clone();
    let stream = dev.cuda_stream();
    let src = s.as_cuda_slice::<T>()?.slice(start..end);
    let mut staging = pg.staging();
    let buf = staging.slice::<T>(stream.context(), end - start)?;
    // Staged through the host: a read, an upload and two synchronisations, counted where
    // Candle counts its own copies.
    let counted = Device::Cuda(dev.clone());
    host_traffic::count_read(&counted);
    cuda(stream.memcpy_dtoh(&src, buf), "copying a collective's input to the host")?;
    host_traffic::count_sync(&counted);
    cuda(stream.synchronize(), "waiting for a collective's input to reach the host")?;
    let ((out, shape), sizes) = run_staged(pg, kind, buf, l.dims(), |v, dims| {
        host_traffic::count_upload(&counted);
        let slice = cuda(stream.clone_htod(v), "copying a collective's result to the device")?;
        // The source is the reused buffer (or a vector about to be dropped): wait for the copy.
        host_traffic::count_sync(&counted);
        cuda(stream.synchronize(), "waiting for a collective's result to reach the device")?;
        Ok((T::wrap_cuda_slice(slice, dev.clone()), Shape::from(dims)))
    })?;
    Ok((out, shape, sizes))
}
