//! The `host` path of collectives of CUDA tensors: the input is copied into the group's
//! pinned host buffer (page-locked, so the copy is a direct DMA; allocated once, grown to the
//! largest collective and reused), the CPU backend runs the collective on it
//! ([`crate::host_ops::run_staged`], the code a CPU tensor runs) and the result is copied to
//! a new allocation on the tensor's device. In-place collectives (all_reduce, broadcast,
//! reduce) run on the pinned buffer and are copied back from it; the others (all_gather,
//! reduce_scatter, all_to_all) copy back the CPU backend's output vector.
//!
//! Every copy is waited for before the call returns: the CPU backend needs the values, and
//! the buffer is reused by the next call. Where pinned memory cannot be had (a driver that
//! refuses `cuMemHostAlloc`), the buffer is plain memory, reused the same way, with one
//! warning.

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{sys, CudaContext, DeviceRepr, PinnedHostSlice};
use candle_core::cuda::CudaDType;
use candle_core::{CudaStorage, Layout, Result, Shape};
use std::sync::Arc;

use super::{cuda, Out};
use crate::dispatch::unsupported_dtype;
use crate::error::{DistError, DistResult};
use crate::group::ProcessGroup;
use crate::host_ops::{run_staged, Kind};
use crate::reduce::Elem;

/// Smallest pinned allocation: collectives of a few values should not each grow the buffer.
const MIN_PINNED_BYTES: usize = 1 << 16;

/// A group's host buffer for the `host` path.
#[derive(Default)]
pub(crate) struct Staging {
    pinned: Option<PinnedHostSlice<u8>>,
    /// The buffer where pinned memory could not be had (u64 words: aligned for every dtype).
    plain: Vec<u64>,
    /// Set when pinned allocation failed once: plain memory from then on.
    no_pinned: bool,
}

impl Staging {
    /// `n` elements of host memory, pinned where possible, holding whatever the last call left.
    fn slice<T: Elem>(&mut self, ctx: &Arc<CudaContext>, n: usize) -> DistResult<&mut [T]> {
        let bytes = n * std::mem::size_of::<T>();
        if !self.no_pinned && self.pinned.as_ref().is_none_or(|p| p.len() < bytes) {
            // Free the old buffer before taking a larger one.
            self.pinned = None;
            let cap = bytes.next_power_of_two().max(MIN_PINNED_BYTES);
            // SAFETY: the memory is uninitialised; it is zeroed below before any slice of it
            // is made. PORTABLE: pinned for every context of the process, not only `ctx`'s.
            match unsafe { ctx.alloc_pinned_with_flags::<u8>(cap, sys::CU_MEMHOSTALLOC_PORTABLE) } {
                Ok(mut p) => {
                    let ptr = cuda(p.as_mut_ptr(), "waiting for a pinned buffer")?;
                    // SAFETY: `ptr` addresses `cap` bytes allocated above, used by nothing else.
                    unsafe { std::ptr::write_bytes(ptr, 0, cap) };
                    self.pinned = Some(p);
                }
                Err(e) => {
                    tracing::warn!(
                        "pinned host memory ({cap} bytes) could not be allocated ({e:?}): collectives of CUDA tensors \
                         on the host path use plain memory from now on"
                    );
                    self.no_pinned = true;
                }
            }
        }
        let raw: &mut [u8] = match self.pinned.as_mut() {
            Some(p) if !self.no_pinned => &mut cuda(p.as_mut_slice(), "waiting for a pinned buffer")?[..bytes],
            _ => {
                let words = bytes.div_ceil(8);
                if self.plain.len() < words {
                    self.plain.resize(words, 0);
                }
                &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.plain[..words])[..bytes]
            }
        };
        bytemuck::try_cast_slice_mut(raw)
            .map_err(|e| DistError::Invalid(format!("a staging buffer of {bytes} bytes does not hold {n} x {:?}: {e}", T::DTYPE)))
    }
}

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
    cuda(stream.memcpy_dtoh(&src, buf), "copying a collective's input to the host")?;
    cuda(stream.synchronize(), "waiting for a collective's input to reach the host")?;
    let ((out, shape), sizes) = run_staged(pg, kind, buf, l.dims(), |v, dims| {
        let slice = cuda(stream.clone_htod(v), "copying a collective's result to the device")?;
        // The source is the reused buffer (or a vector about to be dropped): wait for the copy.
        cuda(stream.synchronize(), "waiting for a collective's result to reach the device")?;
        Ok((T::wrap_cuda_slice(slice, dev.clone()), Shape::from(dims)))
    })?;
    Ok((out, shape, sizes))
}
