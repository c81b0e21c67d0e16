//! Which path the CPU kernels took, counted per calling thread: tests read it to see that a
//! case they built for a path took it. A few integer additions per kernel call, on the thread
//! that plans the call (the kernels' parallel tasks do not touch it).

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

/// Counts of the paths taken by kernel calls planned on this thread.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelPaths {
    /// conv2d passes (forward or backward) of a 1x1, stride-1, unpadded kernel that read the
    /// input planes directly, without im2col.
    pub conv_pointwise: u64,
    /// conv2d passes through im2col (or col2im) and GEMM.
    pub conv_im2col: u64,
    /// conv2d weight gradients split over slabs of the weight's input channels instead of over
    /// chunks of images (few output pixels per image and a large weight).
    pub conv_weight_slabs: u64,
    /// Batches planned with GEMMs that use the whole thread pool (fewer images than threads).
    pub parallel_gemm: u64,
    /// Batch-norm kernel calls (forward or backward) cut into more than one task of rows.
    pub batch_norm_split: u64,
    /// Batch-norm kernel calls run as one task.
    pub batch_norm_whole: u64,
    /// conv2d passes (forward or backward) through cuDNN (feature `cudnn`, CUDA tensors).
    pub conv_cudnn: u64,
    /// Of those, f32 passes with TF32 allowed (`crate::set_tf32`): cuDNN may use tensor cores.
    pub conv_cudnn_tf32: u64,
}

thread_local! {
    static PATHS: Cell<KernelPaths> = Cell::new(KernelPaths::default());
}

/// Adds to this thread's counts.
pub(crate) fn count(f: impl FnOnce(&mut KernelPaths)) {
    PATHS.with(|p| {
        let mut v = p.get();
        f(&mut v);
        p.set(v);
    });
}

/// The paths taken by kernel calls planned on this thread so far.
#[doc(hidden)]
pub fn kernel_paths() -> KernelPaths {
    PATHS.with(|p| p.get())
}

/// The traffic between the host and a device: device→host reads, host→device uploads and
/// synchronisations, counted where they happen, in Candle's copy functions
/// (`candle_core::host_traffic`: `to_vec*`, `to_scalar`, `Tensor::new`, `from_vec`, `to_device`,
/// the CUDA backend's copies) and in allgrad's own staging, with allgrad's cuDNN heuristic
/// queries. A read blocks the thread until the device has finished everything queued before it,
/// so a step whose forward and backward make none lets the CPU run ahead of the GPU.
/// [`host_traffic`] is the calling thread's; [`process_host_traffic`] every thread's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostTraffic {
    /// Device→host reads (one per call that copies device values to the host).
    pub reads: u64,
    /// Host→device uploads (one per call that copies host values into a device tensor).
    pub uploads: u64,
    /// Explicit synchronisations of a device with the host (a read synchronises too, and is
    /// counted as a read).
    pub syncs: u64,
    /// Uploads of kernel launch parameters (Candle's strided layouts on CUDA), asynchronous.
    pub param_uploads: u64,
    /// cuDNN algorithm heuristic queries (`cudnnGetConvolution*Algorithm_v7`).
    pub heuristic_queries: u64,
}

impl std::ops::Sub for HostTraffic {
    type Output = HostTraffic;

    /// The traffic between two snapshots (`later - earlier`).
    fn sub(self, earlier: HostTraffic) -> HostTraffic {
        HostTraffic {
            reads: self.reads - earlier.reads,
            uploads: self.uploads - earlier.uploads,
            syncs: self.syncs - earlier.syncs,
            param_uploads: self.param_uploads - earlier.param_uploads,
            heuristic_queries: self.heuristic_queries - earlier.heuristic_queries,
        }
    }
}

impl std::ops::AddAssign for HostTraffic {
    fn add_assign(&mut self, o: HostTraffic) {
        self.reads += o.reads;
        self.uploads += o.uploads;
        self.syncs += o.syncs;
        self.param_uploads += o.param_uploads;
        self.heuristic_queries += o.heuristic_queries;
    }
}

thread_local! {
    static QUERIES: Cell<u64> = const { Cell::new(0) };
}
static PROCESS_QUERIES: AtomicU64 = AtomicU64::new(0);

/// Counts one cuDNN heuristic query on this thread.
pub(crate) fn count_heuristic_query() {
    QUERIES.with(|q| q.set(q.get() + 1));
    PROCESS_QUERIES.fetch_add(1, Ordering::Relaxed);
}

fn with_candle(t: candle_core::host_traffic::Traffic, heuristic_queries: u64) -> HostTraffic {
    HostTraffic { reads: t.reads, uploads: t.uploads, syncs: t.syncs, param_uploads: t.param_uploads, heuristic_queries }
}

/// This thread's traffic so far (take the difference of two snapshots for one region).
pub fn host_traffic() -> HostTraffic {
    with_candle(candle_core::host_traffic::thread_traffic(), QUERIES.with(|q| q.get()))
}

/// The traffic of every thread of the process so far: a region's difference catches reads
/// made on any thread (the loader's, a kernel pool's), where [`host_traffic`] sees only the
/// calling thread's.
pub fn process_host_traffic() -> HostTraffic {
    with_candle(candle_core::host_traffic::process_traffic(), PROCESS_QUERIES.load(Ordering::Relaxed))
}

/// The pass of an op an [`OpTime`] is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Pass {
    /// The forward.
    Forward,
    /// The backward.
    Backward,
}

/// The time one kind of op (`conv`, `batch_norm`, `relu`, `linear`, `pool`, `layer_norm`,
/// `attention`, `gelu`) took in one pass, summed over its calls on this thread since timing was
/// turned on ([`set_op_timing`]) or last taken ([`take_op_times`]).
#[derive(Clone, Debug, PartialEq)]
pub struct OpTime {
    /// The kind.
    pub kind: &'static str,
    /// Forward or backward.
    pub pass: Pass,
    /// Seconds: the device's time between CUDA events around each call on a GPU, wall-clock
    /// on the CPU (where an op runs while it is called).
    pub seconds: f64,
    /// Calls.
    pub calls: u64,
}

#[cfg(feature = "cuda")]
type OpEvent = candle_core::cuda::cudarc::driver::CudaEvent;

/// A timed call on a GPU not yet resolved: its CUDA events (read when the times are taken).
#[cfg(feature = "cuda")]
struct Pending {
    key: (&'static str, Pass),
    events: (OpEvent, OpEvent),
}

#[derive(Default)]
struct OpTiming {
    totals: std::collections::BTreeMap<(&'static str, Pass), (f64, u64)>,
    #[cfg(feature = "cuda")]
    pending: Vec<Pending>,
}

thread_local! {
    static OP_TIMING: std::cell::RefCell<Option<OpTiming>> = const { std::cell::RefCell::new(None) };
}

/// Turns the timing of the ops' passes on or off for this thread (off by default: then an op
/// pays one thread-local check). On a GPU each timed call records two CUDA events on the
/// device's stream; [`take_op_times`] waits for them.
pub fn set_op_timing(on: bool) {
    OP_TIMING.with(|t| *t.borrow_mut() = on.then(OpTiming::default));
}

/// The times since timing was turned on or last taken, by kind and pass (reset to zero); on a
/// GPU this waits for the device to reach the last timed call.
pub fn take_op_times() -> Vec<OpTime> {
    OP_TIMING.with(|t| {
        let mut t = t.borrow_mut();
        let Some(timing) = t.as_mut() else { return Vec::new() };
        #[cfg(feature = "cuda")]
        for p in timing.pending.drain(..) {
            let s = p.events.0.elapsed_ms(&p.events.1).map(|ms| ms as f64 / 1e3).unwrap_or(0.0);
            let e = timing.totals.entry(p.key).or_default();
            e.0 += s;
            e.1 += 1;
        }
        std::mem::take(&mut timing.totals)
            .into_iter()
            .map(|((kind, pass), (seconds, calls))| OpTime { kind, pass, seconds, calls })
            .collect()
    })
}

/// Times one pass of an op while alive (see [`set_op_timing`]); inert when timing is off.
pub(crate) struct OpTimer {
    key: (&'static str, Pass),
    start: Option<std::time::Instant>,
    #[cfg(feature = "cuda")]
    event: Option<(OpEvent, candle_core::Device)>,
}

impl OpTimer {
    /// Starts timing `pass` of an op of `kind` running on `dev`.
    pub fn start(kind: &'static str, pass: Pass, dev: &candle_core::Device) -> OpTimer {
        let on = OP_TIMING.with(|t| t.borrow().is_some());
        let mut timer = OpTimer {
            key: (kind, pass),
            start: None,
            #[cfg(feature = "cuda")]
            event: None,
        };
        if !on {
            return timer;
        }
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(d) = dev {
            use candle_core::cuda::cudarc::driver::sys::CUevent_flags;
            if let Ok(e) = d.cuda_stream().record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)) {
                timer.event = Some((e, dev.clone()));
                return timer;
            }
        }
        let _ = dev;
        timer.start = Some(std::time::Instant::now());
        timer
    }
}

impl Drop for OpTimer {
    fn drop(&mut self) {
        #[cfg(feature = "cuda")]
        if let Some((start, candle_core::Device::Cuda(d))) = self.event.take() {
            use candle_core::cuda::cudarc::driver::sys::CUevent_flags;
            if let Ok(end) = d.cuda_stream().record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)) {
                let key = self.key;
                OP_TIMING.with(|t| {
                    if let Some(timing) = t.borrow_mut().as_mut() {
                        timing.pending.push(Pending { key, events: (start, end) });
                    }
                });
            }
            return;
        }
        if let Some(start) = self.start {
            let s = start.elapsed().as_secs_f64();
            let key = self.key;
            let _ = OP_TIMING.try_with(|t| {
                if let Some(timing) = t.borrow_mut().as_mut() {
                    let e = timing.totals.entry(key).or_default();
                    e.0 += s;
                    e.1 += 1;
                }
            });
        }
    }
}
