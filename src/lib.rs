//! # allgrad
//!
//! Large-batch contrastive learning across many ranks on Candle, where every cross-rank
//! operation inside a loss has a correct backward.
//!
//! - [`dist`]: process groups, rendezvous, the CPU/TCP collectives backend and the
//!   differentiable collectives (`allgrad::dist::all_gather`, `all_reduce`, ...).
//! - [`testing`]: check your own distributed loss for world-size invariance.
//! - [`launch`]: the torchrun-style launcher behind the `launch` binary.

#![warn(missing_docs)]

pub use allgrad_dist as dist;

pub mod launch;

/// Checks for users' own distributed code (re-exported from [`dist::testing`]).
pub mod testing {
    pub use allgrad_dist::testing::*;
}
