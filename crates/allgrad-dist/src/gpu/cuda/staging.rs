//! The host buffer of a group's `host` path for CUDA tensors: page-locked (pinned), so a copy
//! between it and the device is a direct DMA; allocated once, grown to the largest collective
//! and reused by every call. Where pinned memory cannot be had (a driver that refuses
//! `cuMemHostAlloc`), the buffer is plain memory, reused the same way, with one warning. The
//! path that copies through it is `group/cuda/host.rs`.

use candle_core::cuda::cudarc::driver::{sys, CudaContext, PinnedHostSlice};
use std::sync::Arc;

use super::cuda;
use crate::error::{DistError, DistResult};
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
    pub(crate) fn slice<T: Elem>(&mut self, ctx: &Arc<CudaContext>, n: usize) -> DistResult<&mut [T]> {
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
