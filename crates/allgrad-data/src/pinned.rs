//! Batches onto a CUDA device ahead of the step (feature `cuda`; [`crate::host`] uses it).
//!
//! - The workers assemble each view in a page-locked (pinned) host buffer from a pool: the
//!   copy to the device is then one DMA that needs no staging by the driver and does not
//!   block the host.
//! - The copy runs on a stream of its own (created with the driver call directly, not with
//!   cudarc's `new_stream`, which would switch the whole context to recording events for
//!   every allocation). Ordering with the step's stream (Candle's device stream) is by
//!   events: the copy stream waits until the destination, allocated on the step's stream,
//!   exists; the step's stream waits for the copy before anything later on it (the forward
//!   pass) reads the batch. Nothing waits on the host.
//! - A buffer goes back to the pool when its batch is handed over; the next worker that takes
//!   it waits for the event recorded after the copy that read it, so a buffer is never
//!   written while the DMA still reads it.

use std::sync::{Arc, Mutex};

use candle_core::cuda::cudarc::driver::{result, sys, CudaStream, DevicePtr, DriverError, PinnedHostSlice};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, Device, Storage, Tensor};

use crate::error::{DataError, DataResult};

fn cuda<T>(r: Result<T, DriverError>, what: &'static str) -> DataResult<T> {
    r.map_err(|e| DataError::Device { what, reason: format!("{e:?}") })
}

/// A driver event, destroyed on drop (a pending event is released when it completes).
struct Event(sys::CUevent);

// SAFETY: CUDA driver handles may be used from any thread of the process.
unsafe impl Send for Event {}
unsafe impl Sync for Event {}

impl Event {
    fn new() -> DataResult<Self> {
        cuda(result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING), "creating an event").map(Event)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created by `Event::new`, destroyed once here.
        let _ = unsafe { result::event::destroy(self.0) };
    }
}

/// A device's pinned-buffer pool and copy stream.
pub(crate) struct Uploader {
    device: CudaDevice,
    compute: Arc<CudaStream>,
    copy: sys::CUstream,
    free: Mutex<Vec<(PinnedHostSlice<f32>, Event)>>,
}

// SAFETY: `copy` is a driver stream handle, usable from any thread; the pool is behind a mutex.
unsafe impl Send for Uploader {}
unsafe impl Sync for Uploader {}

impl Uploader {
    /// The pool and copy stream of `device`.
    pub(crate) fn new(device: &CudaDevice) -> DataResult<Arc<Self>> {
        let compute = device.cuda_stream();
        cuda(compute.context().bind_to_thread(), "binding the device's context")?;
        let copy = cuda(result::stream::create(result::stream::StreamKind::NonBlocking), "creating the copy stream")?;
        Ok(Arc::new(Uploader { device: device.clone(), compute, copy, free: Mutex::new(Vec::new()) }))
    }

    /// A pinned buffer of `len` values: a free one of that length, or a new one.
    pub(crate) fn take(self: &Arc<Self>, len: usize) -> DataResult<PinnedBuf> {
        let reused = {
            let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
            free.iter().position(|(h, _)| h.len() == len).map(|i| free.swap_remove(i))
        };
        let (host, done) = match reused {
            Some(b) => b,
            None => {
                let ctx = self.compute.context();
                cuda(ctx.bind_to_thread(), "binding the device's context")?;
                // SAFETY: the memory is uninitialised; every value is written before the
                // buffer is copied (a batch view fills its whole buffer).
                let host = cuda(unsafe { ctx.alloc_pinned::<f32>(len) }, "allocating pinned host memory")?;
                (host, Event::new()?)
            }
        };
        Ok(PinnedBuf { host: Some((host, done)), owner: self.clone() })
    }
}

impl Drop for Uploader {
    fn drop(&mut self) {
        self.free.lock().unwrap_or_else(|p| p.into_inner()).clear();
        // SAFETY: created in `new`; pending work completes before the stream's resources go.
        let _ = unsafe { result::stream::destroy(self.copy) };
    }
}

/// A pinned buffer of the pool; back to the pool on drop.
pub(crate) struct PinnedBuf {
    host: Option<(PinnedHostSlice<f32>, Event)>,
    owner: Arc<Uploader>,
}

impl PinnedBuf {
    fn parts(&self) -> &(PinnedHostSlice<f32>, Event) {
        self.host.as_ref().expect("held until drop")
    }

    fn len(&self) -> usize {
        self.parts().0.len()
    }

    /// The values, to write into, once the last copy that read them is done.
    pub(crate) fn as_mut_slice(&mut self) -> DataResult<&mut [f32]> {
        let (host, done) = self.host.as_mut().expect("held until drop");
        cuda(self.owner.compute.context().bind_to_thread(), "binding the device's context")?;
        candle_core::host_traffic::count_sync(&Device::Cuda(self.owner.device.clone()));
        // SAFETY: a live event (an event never recorded counts as complete).
        cuda(unsafe { result::event::synchronize(done.0) }, "waiting for a pinned buffer's last copy")?;
        cuda(host.as_mut_slice(), "opening a pinned buffer")
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        if let Some(b) = self.host.take() {
            self.owner.free.lock().unwrap_or_else(|p| p.into_inner()).push(b);
        }
    }
}

/// One `[n, c, h, w]` f32 tensor on the pool's device from `parts` (in order), copied
/// asynchronously on the copy stream; the device's stream waits for the copy.
pub(crate) fn upload(parts: Vec<PinnedBuf>, shape: (usize, usize, usize, usize)) -> DataResult<Tensor> {
    let owner = parts[0].owner.clone();
    let (compute, copy) = (&owner.compute, owner.copy);
    let total: usize = parts.iter().map(PinnedBuf::len).sum();
    if total != shape.0 * shape.1 * shape.2 * shape.3 {
        return Err(DataError::Device { what: "uploading a batch", reason: format!("{total} values for shape {shape:?}") });
    }
    cuda(compute.context().bind_to_thread(), "binding the device's context")?;
    // SAFETY: every value is written by the copies below before the step's stream (which
    // waits for them) reads the tensor.
    let dst = cuda(unsafe { compute.alloc::<f32>(total) }, "allocating a batch on the device")?;
    // One upload of the batch (its parts copied by one queue of asynchronous copies).
    candle_core::host_traffic::count_upload(&Device::Cuda(owner.device.clone()));
    {
        let (ptr, _sync) = dst.device_ptr(compute);
        let allocated = Event::new()?;
        // SAFETY: live streams and events; the destination holds `total` values, the parts
        // are `total` values together; each part's `done` is recorded after its copy.
        unsafe {
            cuda(result::event::record(allocated.0, compute.cu_stream()), "ordering a batch's copy")?;
            cuda(
                result::stream::wait_event(copy, allocated.0, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT),
                "ordering a batch's copy",
            )?;
            let mut offset = 0u64;
            for p in &parts {
                let (host, done) = p.parts();
                let src = cuda(host.as_slice(), "reading a pinned buffer")?;
                cuda(result::memcpy_htod_async(ptr + offset, src, copy), "copying a batch to the device")?;
                cuda(result::event::record(done.0, copy), "recording a batch's copy")?;
                offset += std::mem::size_of_val(src) as u64;
            }
            let copied = Event::new()?;
            cuda(result::event::record(copied.0, copy), "recording a batch's copy")?;
            cuda(
                result::stream::wait_event(compute.cu_stream(), copied.0, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT),
                "ordering the step after a batch's copy",
            )?;
        }
    }
    drop(parts); // back to the pool; rewritten only after their `done` events
    let storage = CudaStorage::wrap_cuda_slice(dst, owner.device.clone());
    Ok(Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false))
}
