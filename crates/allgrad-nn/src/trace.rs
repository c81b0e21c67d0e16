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
