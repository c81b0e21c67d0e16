//! Which path the optimizer took, counted per calling thread (as `allgrad_nn::kernel_paths`
//! counts the kernels' paths): tests read it to see that a case built for a path took it,
//! and fail when the fallback ran instead. A few integer additions per parameter update, on
//! the thread that calls the optimizer (its parallel tasks do not touch it).

use std::cell::Cell;

/// Counts of the paths taken by optimizer updates on this thread.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OptimPaths {
    /// Parameter updates of a row-sparse gradient taken by the lazy path (`optim/lazy.rs`):
    /// only the gradient's rows were updated at the step.
    pub lazy_updates: u64,
    /// Rows a lazy update left behind (their updates deferred), summed over the updates.
    pub deferred_rows: u64,
    /// Rows brought up to date by replaying the updates they missed (a later gradient's rows,
    /// `Optimizer::catch_up` or `Optimizer::flush`).
    pub replayed_rows: u64,
    /// Row-sparse gradients scattered into zeros and given the dense update (LARS, or a
    /// tensor the lazy path does not take).
    pub sparse_as_dense: u64,
    /// Parameter updates by the fused in-place kernels on the CPU (`optim/fused.rs`).
    pub fused_cpu: u64,
    /// Parameter updates by the fused in-place kernels on CUDA (`allgrad_nn::optim_cuda`).
    pub fused_cuda: u64,
    /// Parameter updates composed of Candle ops (LARS, other dtypes, the kernels off).
    pub composed: u64,
}

impl OptimPaths {
    /// The counts taken since `before` (an earlier reading on the same thread).
    pub fn since(self, before: OptimPaths) -> OptimPaths {
        OptimPaths {
            lazy_updates: self.lazy_updates - before.lazy_updates,
            deferred_rows: self.deferred_rows - before.deferred_rows,
            replayed_rows: self.replayed_rows - before.replayed_rows,
            sparse_as_dense: self.sparse_as_dense - before.sparse_as_dense,
            fused_cpu: self.fused_cpu - before.fused_cpu,
            fused_cuda: self.fused_cuda - before.fused_cuda,
            composed: self.composed - before.composed,
        }
    }
}

thread_local! {
    static PATHS: Cell<OptimPaths> = Cell::new(OptimPaths::default());
}

/// Adds to this thread's counts.
pub(crate) fn count(f: impl FnOnce(&mut OptimPaths)) {
    PATHS.with(|p| {
        let mut v = p.get();
        f(&mut v);
        p.set(v);
    });
}

/// The paths taken by optimizer updates on this thread so far.
#[doc(hidden)]
pub fn optim_paths() -> OptimPaths {
    PATHS.with(|p| p.get())
}
