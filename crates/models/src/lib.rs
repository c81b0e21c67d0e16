//! # allgrad-models
//!
//! Training objectives: each method (a model plus its distributed loss) implements
//! [`Objective`], the one trait the trainer needs.
//!
//! - [`vectors::VectorContrastive`]: an MLP on seeded synthetic vector data with a local
//!   NT-Xent loss (global negatives through the differentiable all_gather) or a replicated
//!   cross-correlation loss (statistics through the differentiable all_reduce). Small and
//!   fast: smoke runs, examples and the trainer's equivalence tests.
//! - [`simclr::SimClr`]: SimCLR on images (ResNet + projection MLP, NT-Xent over global
//!   negatives, SyncBatchNorm, kNN monitor).
//! - [`losses`]: the distributed losses themselves; [`batch_norm`]: (Sync)BatchNorm.

#![warn(missing_docs)]

pub mod batch_norm;
pub mod losses;
mod objective;
pub mod resnet;
pub mod rng;
pub mod simclr;
pub mod vectors;

pub use objective::{Batch, Objective};
