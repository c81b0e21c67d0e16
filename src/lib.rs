//! # allgrad
//!
//! Large-batch contrastive learning across many ranks on Candle, where every cross-rank
//! operation inside a loss has a correct backward.
//!
//! - [`dist`]: process groups, rendezvous, the CPU/TCP collectives backend and the
//!   differentiable collectives (`allgrad::dist::all_gather`, `all_reduce`, ...).
//! - [`nn`]: CPU kernels with backward (conv2d, pooling, norms, softmax, cross-entropy).
//! - [`data`]: readers, keyed augmentations, the distributed sampler, the threaded loader.
//! - [`rng`]: the keyed random streams every random choice goes through.
//! - [`models`]: the `Objective` trait (a method = parameters + the loss of a local batch),
//!   distributed losses and built-in methods.
//! - [`train`]: the trainer (config, DDP sync, optimizers, checkpoints, metrics).
//! - [`testing`]: check your own distributed loss for world-size invariance.
//! - [`launch`]: the torchrun-style launcher behind the `launch` binary (re-exported from
//!   [`dist::launch`]).
//! - [`tune_allocator`]: allocator settings that make CPU training steps much faster.
//! - [`candle`] and [`candle_nn`]: Candle as allgrad builds it (candle-core with allgrad's patch,
//!   and candle-nn on it). Name tensors through them (`allgrad::candle::Tensor`): a crate that
//!   depends on allgrad then needs no Candle dependency of its own.

#![warn(missing_docs)]

pub use allgrad_data as data;
pub use allgrad_dist as dist;
pub use allgrad_models as models;
pub use allgrad_nn as nn;
pub use allgrad_rng as rng;
pub use allgrad_train as train;
pub use candle_core as candle;
pub use candle_nn;

mod alloc;

pub use allgrad_dist::launch;

pub use alloc::tune_allocator;

/// The README's Rust examples, compiled and run by `cargo test --doc`.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// Checks for users' own distributed code (re-exported from [`dist::testing`]).
pub mod testing {
    pub use allgrad_dist::testing::*;
}
