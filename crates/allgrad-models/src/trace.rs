//! Which path the tiled losses took, counted per calling thread (as `allgrad_nn::kernel_paths`
//! counts the kernels' paths): tests read it to see that a case built for the fused CPU
//! kernel took it, and fail when the block-by-block fallback ran instead. One integer
//! addition per loss call and per backward, on the thread that calls them.

use std::cell::Cell;

/// Counts of the paths taken by tiled cross-entropy calls on this thread.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TiledPaths {
    /// Forwards by the fused CPU kernel (`q·k / τ`, f32 and f64).
    pub fused_forward: u64,
    /// Backwards by the fused CPU kernel.
    pub fused_backward: u64,
    /// Forwards through a scores function on tensor blocks (other devices and dtypes, or a
    /// [`crate::tiled::TileScores`] of your own).
    pub blocks_forward: u64,
    /// Backwards through a scores function on tensor blocks.
    pub blocks_backward: u64,
    /// Forward passes of the memory-flat ring losses (`crate::clip::ring`), each a ring of
    /// point-to-point exchanges on the host with a communication thread.
    pub ring_forward: u64,
    /// Their backward passes (the ring run again, tiles recomputed).
    pub ring_backward: u64,
    /// Ring passes whose inputs lived on another device and were staged through host memory.
    pub ring_staged: u64,
}

impl TiledPaths {
    /// The counts taken since `before` (an earlier reading on the same thread).
    pub fn since(self, before: TiledPaths) -> TiledPaths {
        TiledPaths {
            fused_forward: self.fused_forward - before.fused_forward,
            fused_backward: self.fused_backward - before.fused_backward,
            blocks_forward: self.blocks_forward - before.blocks_forward,
            blocks_backward: self.blocks_backward - before.blocks_backward,
            ring_forward: self.ring_forward - before.ring_forward,
            ring_backward: self.ring_backward - before.ring_backward,
            ring_staged: self.ring_staged - before.ring_staged,
        }
    }
}

thread_local! {
    static PATHS: Cell<TiledPaths> = Cell::new(TiledPaths::default());
}

/// Adds to this thread's counts.
pub(crate) fn count(f: impl FnOnce(&mut TiledPaths)) {
    PATHS.with(|p| {
        let mut v = p.get();
        f(&mut v);
        p.set(v);
    });
}

/// The paths taken by tiled cross-entropy calls on this thread so far.
#[doc(hidden)]
pub fn tiled_paths() -> TiledPaths {
    PATHS.with(|p| p.get())
}
