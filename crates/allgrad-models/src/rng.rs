//! Keyed random streams (ARCHITECTURE.md, "Why W ranks equal one"): the workspace's one implementation, `allgrad-rng`.
//! Candle's CPU RNG cannot be seeded, so values are drawn there and uploaded.

pub use allgrad_rng::{name_key, normals, stream, uniform, KeyedRng};
