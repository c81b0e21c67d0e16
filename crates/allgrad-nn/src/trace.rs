//! Which path the CPU kernels took, counted per calling thread: tests read it to see that a
//! case they built for a path took it. A few integer additions per kernel call, on the thread
//! that plans the call (the kernels' parallel tasks do not touch it).

use std::cell::Cell;

/// Counts of the paths taken by kernel calls planned on this thread.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelPaths {
    /// conv2d passes (forward or backward) of a 1x1, stride-1, unpadded kernel that read the
    /// input planes directly, without im2col.
    pub conv_pointwise: u64,
    /// conv2d passes through im2col (or col2im) and GEMM.
    pub conv_im2col: u64,
    /// Batches planned with GEMMs that use the whole thread pool (fewer images than threads).
    pub parallel_gemm: u64,
    /// Batch-norm kernel calls (forward or backward) cut into more than one task of rows.
    pub batch_norm_split: u64,
    /// Batch-norm kernel calls run as one task.
    pub batch_norm_whole: u64,
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

/// The traffic between the host and a device that a thread's calls caused: every
/// device→host read, host→device upload and cuDNN heuristic query goes through
/// [`crate::transfer`], which counts it here (per calling thread, like [`KernelPaths`]). A
/// read blocks the thread until the device has finished everything queued before it, so a
/// step whose forward and backward make none lets the CPU run ahead of the GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostTraffic {
    /// Device→host reads (one per call that copies a device tensor to the host).
    pub reads: u64,
    /// Host→device uploads (one per call that copies host values into a device tensor).
    pub uploads: u64,
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
            heuristic_queries: self.heuristic_queries - earlier.heuristic_queries,
        }
    }
}

impl std::ops::AddAssign for HostTraffic {
    fn add_assign(&mut self, o: HostTraffic) {
        self.reads += o.reads;
        self.uploads += o.uploads;
        self.heuristic_queries += o.heuristic_queries;
    }
}

thread_local! {
    static TRAFFIC: Cell<HostTraffic> = Cell::new(HostTraffic::default());
}

/// Adds to this thread's traffic.
pub(crate) fn count_traffic(f: impl FnOnce(&mut HostTraffic)) {
    TRAFFIC.with(|p| {
        let mut v = p.get();
        f(&mut v);
        p.set(v);
    });
}

/// This thread's traffic so far (take the difference of two snapshots for one region).
pub fn host_traffic() -> HostTraffic {
    TRAFFIC.with(|p| p.get())
}
