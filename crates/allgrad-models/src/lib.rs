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
//! - [`barlow_twins::BarlowTwins`]: BarlowTwins on images (ResNet + BN projector, the
//!   cross-correlation of the two views over the global batch).
//! - [`image_ssl`]: what the image methods share (data, views built ahead on loader
//!   threads, encoder + projector, kNN monitor and linear probe).
//! - [`losses`]: the distributed losses themselves; [`batch_norm`]: (Sync)BatchNorm.

#![warn(missing_docs)]

pub mod barlow_twins;
pub mod batch_norm;
pub mod bert;
pub mod image_ssl;
pub mod losses;
mod objective;
pub mod resnet;
pub mod rng;
pub mod simclr;
pub mod simcse;
pub mod vectors;

pub use objective::{Batch, Objective};
