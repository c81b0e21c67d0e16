//! # allgrad-models
//!
//! Training objectives: each method (a model plus its distributed loss) implements
//! [`Objective`], the one trait the trainer needs.
//!
//! - [`vectors::VectorContrastive`]: an MLP on seeded synthetic vector data with a local
//!   NT-Xent loss (global negatives through the differentiable all_gather) or a replicated
//!   cross-correlation loss (statistics through the differentiable all_reduce). Small and
//!   fast: smoke runs, examples and the trainer's equivalence tests.
//! - [`losses`]: the distributed losses themselves.

#![warn(missing_docs)]

pub mod losses;
mod objective;
pub mod rng;
pub mod vectors;

pub use objective::{Batch, Objective};
