//! Keyed random streams (ARCHITECTURE.md, "Why W ranks equal one"): the workspace's one implementation, `allgrad-rng`,
//! re-exported for the augmentations of this crate.

pub use allgrad_rng::{below, bernoulli, shuffle, stream, uniform, KeyedRng};
