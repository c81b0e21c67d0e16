//! Ring passes of CUDA tensors through NCCL (feature `nccl`): the device half of
//! `RingPass::exchange_tensors` and `RingPass::settle` (`group/ring.rs`) for a group on the `nccl` path.
//!
//! Each exchange is one group of `ncclSend`/`ncclRecv` (`ncclGroupStart`/`ncclGroupEnd`) on
//! the ring's own stream (`GroupComm::ring_stream`, forked from the compute stream once per
//! group), so that a chunk moves while the one before is scored:
//!
//! 1. the ring's stream waits (on the device) for the work queued so far on the compute
//!    stream: the chunks about to be sent, and the receive buffers' allocation;
//! 2. the sends and receives are launched on it, and an event recorded after them;
//! 3. the caller's `during` queues the scoring of the chunks received before on the compute
//!    stream, which runs beside the exchange;
//! 4. the compute stream waits (on the device) for the event: what is queued after the
//!    exchange returns (the scoring of the chunks it brings) starts once they have arrived.
//!
//! No host read and no host wait happens inside the pass: sizes come from the pass's one
//! check (`RingPass::chunk_len`). A peer that dies mid-pass leaves NCCL waiting on the device;
//! `RingPass::settle`, at the pass's end, is the one host wait, bounded by the group's
//! watchdog and watching the peers on the TCP mesh, so that it fails naming the peer instead
//! of hanging.
//!
//! Buffers: received chunks are allocated on the compute stream (freed there, after the
//! scoring that reads them); the chunks sent are the caller's tensors, borrowed for the call,
//! and freed (on the compute stream) only after step 4, which orders them after the sends.
//! This ordering is explicit (stream joins), so it holds whether or not cudarc's event
//! tracking is on.

use candle_core::cuda::cudarc;
use candle_core::cuda::CudaDType;
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, Storage, Tensor};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::{result, NcclType};

use crate::cpu::mesh::OpCode;
use crate::error::{DistError, DistResult};
use crate::gpu::cuda::cuda;
use crate::gpu::nccl::comm_for;
use crate::gpu::Names;
use crate::group::ProcessGroup;
use crate::reduce::Elem;

/// Makes the group's NCCL communicator on `dev` if no collective has yet: a checked call (the
/// group's ranks make it together), once in the group's life.
pub(crate) fn ring_comm(pg: &ProcessGroup, dev: &CudaDevice) -> DistResult<()> {
    if pg.lock().nccl.is_some() {
        return Ok(());
    }
    let what = || "making the NCCL communicator for ring passes".to_string();
    pg.call_checked::<f32, _>(OpCode::Ring, None, &[0], what, |mut p| comm_for(&mut p, dev).map(|_| ()))
}

/// One exchange of a pass through NCCL (see the module docs).
///
/// `what` names the exchange (pass and step); `sends` are (peer, contiguous tensor of T on
/// `dev`), `recvs` (peer, elements): the sizes the pass's check announced.
pub(crate) fn ring_exchange<T, R>(
    pg: &ProcessGroup,
    what: String,
    dev: &CudaDevice,
    sends: &[(usize, &Tensor)],
    recvs: &[(usize, usize)],
    during: impl FnOnce() -> R,
) -> DistResult<(R, Vec<Tensor>)>
where
    T: Elem + NcclType + CudaDType + DeviceRepr + ValidAsZeroBits,
{
    let compute = dev.cuda_stream();
    if sends.is_empty() && recvs.is_empty() {
        return Ok((during(), Vec::new()));
    }
    // The receive buffers, on the compute stream (see the module docs).
    let mut bufs: Vec<CudaSlice<T>> =
        recvs.iter().map(|(_, n)| cuda(compute.alloc_zeros::<T>(*n), "allocating a ring chunk")).collect::<DistResult<_>>()?;
    {
        let mut st = pg.lock();
        st.mesh.check_usable()?;
        let st = &mut *st;
        let names = Names { group: pg.name(), what: &what };
        let gc = st.nccl.as_ref().ok_or_else(|| {
            DistError::Invalid(format!(
                "{what} on {}: the group has no NCCL communicator (ProcessGroup::ring_on_nccl makes it before a pass)",
                pg.name()
            ))
        })?;
        if gc.compute_stream().cu_stream() != compute.cu_stream() {
            return Err(DistError::Invalid(format!(
                "{what} on {}: the tensors are on {dev:?}, not on the device of the group's NCCL communicator",
                pg.name()
            )));
        }
        let ring = gc.ring_stream(names)?.clone();
        // 1. The ring's stream waits for what the compute stream queued so far.
        cuda(ring.join(&compute), "ordering the ring's stream after the compute stream")?;
        // The senders' device pointers. Each storage is read-locked only while its pointer is
        // taken: the tensors are borrowed for the whole call, and the compute stream waits for
        // the exchange (step 4) before anything can free them.
        let mut ptrs = Vec::with_capacity(sends.len());
        for (peer, t) in sends {
            let (storage, layout) = t.storage_and_layout();
            let (start, end) = layout
                .contiguous_offsets()
                .ok_or_else(|| DistError::Invalid(format!("{what} on {}: a chunk to send is not contiguous", pg.name())))?;
            let slice = match &*storage {
                Storage::Cuda(s) => s.as_cuda_slice::<T>().map_err(|e| DistError::Invalid(format!("{what}: {e}")))?,
                _ => return Err(DistError::Invalid(format!("{what} on {}: a chunk to send is not on the GPU", pg.name()))),
            };
            let view = slice.slice(start..end);
            let (p, _read) = view.device_ptr(&ring);
            ptrs.push((p, end - start, *peer));
        }
        let mut dst: Vec<_> =
            bufs.iter_mut().zip(recvs).map(|(b, (peer, _))| (b.len(), *peer, b.device_ptr_mut(&ring))).collect();
        // 2. One group of sends and receives; messages between two ranks match in the order
        // listed (the contract of RingPass::exchange).
        gc.launch_on(names, &ring, |c, st| {
            result::group_start()?;
            let launched = (|| {
                for (p, n, peer) in &ptrs {
                    // SAFETY: `p` addresses `n` elements of T of a tensor the caller borrows for
                    // the whole call; the compute stream waits for the exchange (step 4)
                    // before the tensor can be freed (on that stream).
                    unsafe { result::send(*p as _, *n, T::as_nccl_type(), *peer as i32, c, st) }?;
                }
                for (n, peer, (p, _)) in &mut dst {
                    // SAFETY: `p` addresses a fresh buffer of `n` elements of T.
                    unsafe { result::recv(*p as _, *n, T::as_nccl_type(), *peer as i32, c, st) }?;
                }
                Ok(())
            })();
            // The group is closed even when a send or receive failed to enqueue.
            let ended = result::group_end();
            launched.and(ended.map(|_| ()))
        })
        .map_err(|e| st.mesh.fail(e))?;
        drop(dst);
        st.ring.exchanges += 1;
        st.ring.overlapped += 1;
        st.ring.device_exchanges += 1;
        st.ring.messages_sent += sends.len() as u64;
        st.ring.frames_sent += sends.len() as u64;
    }
    // 3. The caller's work, queued on the compute stream beside the exchange.
    let out = during();
    // 4. The compute stream waits for the exchange, on the device.
    {
        let st = pg.lock();
        let names = Names { group: pg.name(), what: &what };
        let gc = st.nccl.as_ref().expect("checked above");
        let ring = gc.ring_stream(names)?;
        cuda(compute.join(ring), "ordering the compute stream after the ring's exchange")?;
    }
    let device = dev.clone();
    let got = bufs
        .into_iter()
        .map(|b| {
            let n = b.len();
            Tensor::from_storage(Storage::Cuda(T::wrap_cuda_slice(b, device.clone())), n, BackpropOp::none(), false)
        })
        .collect();
    Ok((out, got))
}

/// The pass's one host wait (see the module docs).
pub(crate) fn ring_settle(pg: &ProcessGroup, what: String) -> DistResult<()> {
    let mut st = pg.lock();
    let st = &mut *st;
    let Some(gc) = st.nccl.as_ref() else { return Ok(()) };
    let names = Names { group: pg.name(), what: &what };
    let ring = gc.ring_stream(names)?;
    let done = cuda(ring.record_event(None), "recording the end of a ring pass")?;
    st.ring.host_waits += 1;
    gc.wait(names, &st.mesh, &done).map_err(|e| st.mesh.fail(e))
}
