//! The NCCL backend for CUDA tensors (feature `nccl`): the `nccl` path of a group whose ranks
//! each have a GPU of their own ([`crate::gpu`]). Nothing here runs in this repository's CI:
//! it is type-checked there (`scripts/ci/check_cuda_build.sh`) and exercised by
//! `scripts/ci/gpu_ci.sh` on a GPU machine (with two GPUs or more; on one GPU every group of
//! several ranks takes the `host` path).
//!
//! - One communicator per [`ProcessGroup`](crate::ProcessGroup) on the `nccl` path, made by
//!   the group's first collective on a CUDA tensor, on the stream of that tensor's device: rank 0 of the group
//!   creates the unique id and publishes it through the rendezvous store (`unique_id`), every
//!   member calls `ncclCommInitRank`. Subgroups (`new_group`) get their own.
//! - Every call is first checked against the peers' over the TCP mesh (`group/checked.rs`),
//!   which hands this backend what it may use of the group ([`Elsewhere`]): mismatched calls
//!   fail on every rank naming both, as on the CPU backend.
//! - A watchdog thread per communicator (`watchdog`) aborts it (`ncclCommAbort`) when a call
//!   outlives ALLGRAD_TIMEOUT_S; the call fails naming itself, the group is poisoned and its
//!   peers are told over TCP. Making the communicator (`ncclCommInitRank`, which waits for
//!   every member) is bounded by the same timeout, and by a peer's failure seen on the mesh.
//! - The collectives on tensors that run through it are in `group/cuda/nccl.rs`, for the plain
//!   collectives and the differentiable ops of [`crate::ops`] (their `cuda_fwd`), with the
//!   same backward rules.

use std::ffi::{c_char, CStr};
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use candle_core::cuda::cudarc;
use candle_core::CudaDevice;
use cudarc::driver::{CudaEvent, CudaStream};
use cudarc::nccl::{result, sys};

use crate::cpu::mesh::Mesh;
use crate::error::{DistError, DistResult};
use crate::gpu::unique_id::{share_unique_id, UNIQUE_ID_BYTES};
use crate::gpu::watchdog::{bounded, Abort, Armed, Watchdog};
use crate::gpu::{Elsewhere, Names};
use crate::reduce::ReduceOp;

/// An NCCL communicator handle, aborted (and so freed) exactly once: by the watchdog or on drop.
struct RawComm {
    comm: sys::ncclComm_t,
    aborted: AtomicBool,
}

// SAFETY: an NCCL communicator may be used from any thread. allgrad uses it from one thread at
// a time (under the group's lock); the only call from another thread is the watchdog's
// `ncclCommAbort`, which NCCL provides precisely to unblock a call hung in another thread, and
// after which no caller touches the handle (the watchdog marks the communicator aborted first).
unsafe impl Send for RawComm {}
// SAFETY: as for Send.
unsafe impl Sync for RawComm {}

impl Abort for RawComm {
    fn abort(&self) -> Result<(), String> {
        if self.aborted.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        // SAFETY: the handle came from ncclCommInitRank and has not been aborted (the flag).
        unsafe { result::comm_abort(self.comm) }.map(|_| ()).map_err(|e| describe(e.0))
    }
}

impl Drop for RawComm {
    fn drop(&mut self) {
        // Abort rather than destroy: destroy waits for pending work, which a dead peer never ends.
        if let Err(e) = self.abort() {
            tracing::warn!("releasing an NCCL communicator failed: {e}");
        }
    }
}

/// A communicator just made on the thread of [`bounded`], on its way to its [`RawComm`].
struct MadeComm(sys::ncclComm_t);

// SAFETY: as for RawComm: the handle is used by one thread at a time, and this one only
// carries it from the thread that made it to the caller.
unsafe impl Send for MadeComm {}

/// A group's communicator with its watchdog and device.
pub(crate) struct GroupComm {
    // Dropped first: its thread holds a reference to `comm`.
    watchdog: Watchdog,
    comm: Arc<RawComm>,
    device: CudaDevice,
    stream: Arc<CudaStream>,
    /// The stream ring passes exchange on (`group/cuda/ring.rs`), made by the first: beside
    /// `stream`, which computes, so that the next chunk moves while the current one is scored.
    ring_stream: OnceLock<Arc<CudaStream>>,
}

/// NCCL's own words for a result code.
fn describe(r: sys::ncclResult_t) -> String {
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string for every code.
    let s = unsafe { sys::ncclGetErrorString(r) };
    if s.is_null() {
        return format!("{r:?}");
    }
    // SAFETY: non-null, static, NUL-terminated (above).
    format!("{r:?}: {}", unsafe { CStr::from_ptr(s) }.to_string_lossy())
}

fn nccl_error(names: Names<'_>, step: &str, detail: impl std::fmt::Display) -> DistError {
    DistError::Nccl { group: names.group.to_string(), call: format!("{} ({step})", names.what), detail: detail.to_string() }
}

/// The group's communicator on `device`, made now when this is the group's first CUDA call.
pub(crate) fn comm_for<'p>(place: &'p mut Elsewhere<'_>, device: &CudaDevice) -> DistResult<&'p GroupComm> {
    let names = place.names();
    if place.nccl.is_none() {
        let id = share_unique_id(place.store, place.group, place.rank, || {
            let id = result::get_uniqueid().map_err(|e| nccl_error(names, "ncclGetUniqueId", describe(e.0)))?;
            Ok(id.internal.map(|c| c as u8))
        })?;
        let id = sys::ncclUniqueId { internal: id.map(|b| b as c_char) };
        debug_assert_eq!(id.internal.len(), UNIQUE_ID_BYTES);
        let stream = device.cuda_stream();
        stream.context().bind_to_thread().map_err(|e| nccl_error(names, "binding the CUDA context", format!("{e:?}")))?;
        let (world, rank) = (place.world_size as i32, place.rank as i32);
        let (context, group, what) = (stream.context().clone(), place.group.to_string(), names.what.to_string());
        let init_error =
            move |step: &str, detail: String| DistError::Nccl { group: group.clone(), call: format!("{what} ({step})"), detail };
        let mesh = place.mesh;
        // ncclCommInitRank waits for every member and has no timeout, and there is no
        // communicator to abort yet: it runs on a thread of its own, and this rank stops
        // waiting at the group's timeout or when a peer is seen failing on the TCP mesh.
        let made = bounded(
            "ncclCommInitRank",
            place.group,
            place.timeout,
            || mesh.peer_failure(names.what),
            move || {
                context.bind_to_thread().map_err(|e| init_error("binding the CUDA context", format!("{e:?}")))?;
                let mut raw = MaybeUninit::uninit();
                // SAFETY: `raw` is written by a successful call, which every member makes with the
                // same id and world size (the call header was checked over TCP first).
                unsafe { result::comm_init_rank(raw.as_mut_ptr(), world, id, rank) }
                    .map_err(|e| init_error("ncclCommInitRank", describe(e.0)))?;
                // SAFETY: initialised by the successful call above.
                Ok(MadeComm(unsafe { raw.assume_init() }))
            },
        )?;
        let comm = Arc::new(RawComm { comm: made.0, aborted: AtomicBool::new(false) });
        let watchdog = Watchdog::start(comm.clone(), place.group, place.timeout)?;
        tracing::debug!("group {}: NCCL communicator made on {:?}", place.group, device);
        *place.nccl = Some(GroupComm { watchdog, comm, device: device.clone(), stream, ring_stream: OnceLock::new() });
    }
    let gc = place.nccl.as_ref().expect("made above");
    if gc.device.id() != device.id() {
        return Err(DistError::Invalid(format!(
            "{} on group {}: the tensor is on {device:?}, but the group's NCCL communicator lives on {:?}; \
             keep every CUDA tensor of a rank on one Device (Device::new_cuda(local_rank) once)",
            place.what, place.group, gc.device
        )));
    }
    Ok(gc)
}

impl GroupComm {
    /// Launches one NCCL operation (or group of operations) through `launch`, which receives
    /// the communicator and the stream, and waits for it under the watchdog. While waiting it
    /// also looks at the group's TCP mesh: a peer that failed (and said so, or closed its
    /// connections) makes this rank abort the communicator and fail at once, naming it.
    pub(crate) fn run(
        &self,
        names: Names<'_>,
        mesh: &Mesh,
        launch: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> Result<(), result::NcclError>,
    ) -> DistResult<()> {
        let armed = self.watchdog.arm(names.what)?;
        launch(self.comm.comm, self.stream.cu_stream() as _).map_err(|e| nccl_error(names, "launch", describe(e.0)))?;
        let done = self.stream.record_event(None).map_err(|e| nccl_error(names, "recording an event", format!("{e:?}")))?;
        self.wait_armed(armed, names, mesh, &done)
    }

    /// The stream ring passes exchange on, made (forked from the compute stream) the first time.
    pub(crate) fn ring_stream(&self, names: Names<'_>) -> DistResult<&Arc<CudaStream>> {
        if self.ring_stream.get().is_none() {
            let forked = self.stream.fork().map_err(|e| nccl_error(names, "making the ring's stream", format!("{e:?}")))?;
            let _ = self.ring_stream.set(forked);
        }
        Ok(self.ring_stream.get().expect("set above"))
    }

    /// The stream the group's tensors are computed on (the device's).
    pub(crate) fn compute_stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Launches NCCL operations on `stream` through `launch` and returns without waiting for
    /// them: the watchdog is armed only while `launch` runs (`ncclGroupEnd` may wait for a
    /// peer's connection). The caller waits later, on the device or with [`GroupComm::wait`].
    pub(crate) fn launch_on(
        &self,
        names: Names<'_>,
        stream: &CudaStream,
        launch: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> Result<(), result::NcclError>,
    ) -> DistResult<()> {
        let armed = self.watchdog.arm(names.what)?;
        let launched = launch(self.comm.comm, stream.cu_stream() as _).map_err(|e| nccl_error(names, "launch", describe(e.0)));
        drop(armed);
        launched
    }

    /// Waits on the host, under the watchdog, for `done` (an event recorded after NCCL
    /// operations), looking at the group's TCP mesh as [`GroupComm::run`] does.
    pub(crate) fn wait(&self, names: Names<'_>, mesh: &Mesh, done: &CudaEvent) -> DistResult<()> {
        let armed = self.watchdog.arm(names.what)?;
        self.wait_armed(armed, names, mesh, done)
    }

    fn wait_armed(&self, armed: Armed<'_>, names: Names<'_>, mesh: &Mesh, done: &CudaEvent) -> DistResult<()> {
        let comm = self.comm.comm;
        // A window of the connections per look, moving on each time (PeerWatch,
        // ALLGRAD_PEER_WINDOW): a look every 50 µs over all W - 1 would keep this thread in
        // poll(2) at a thousand ranks.
        let mut watch = mesh.peer_watch();
        armed.wait(|| {
            if done.try_is_complete().map_err(|e| nccl_error(names, "waiting", format!("{e:?}")))? {
                return Ok(true);
            }
            if let Some(e) = watch.look(mesh, names.what) {
                return Err(e);
            }
            let mut state = sys::ncclResult_t::ncclSuccess;
            // SAFETY: runs under the watchdog's lock while the communicator is not aborted.
            unsafe { sys::ncclCommGetAsyncError(comm, &mut state) }
                .result()
                .map_err(|e| nccl_error(names, "ncclCommGetAsyncError", describe(e.0)))?;
            match state {
                sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => Ok(false),
                e => Err(nccl_error(names, "asynchronous error", describe(e))),
            }
        })
    }
}

pub(crate) fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Prod => sys::ncclRedOp_t::ncclProd,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
    }
}
