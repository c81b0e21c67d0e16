//! # allgrad-models
//!
//! Training objectives: each method (a model plus its distributed loss) implements
//! [`Objective`], the one trait the trainer needs; methods whose loss is a function of
//! per-sample embeddings also implement [`EmbeddingObjective`], which lets the trainer cache
//! gradients (`train.cache_chunk`).
//!
//! - [`vectors::VectorContrastive`]: an MLP on seeded synthetic vector data with a local
//!   NT-Xent loss (global negatives through the differentiable all_gather) or a replicated
//!   cross-correlation loss (statistics through the differentiable all_reduce). Small and
//!   fast: smoke runs, examples and the trainer's equivalence tests.
//! - [`image_ssl::TwoViewMethod`]: SimCLR and BarlowTwins on images, one method
//!   parameterised by its loss (ResNet + projection MLP, two augmented views built ahead on
//!   loader threads, NT-Xent over global negatives or the cross-correlation over the global
//!   batch, SyncBatchNorm, kNN monitor and linear probe).
//! - [`face`]: the class-sharded face-recognition head (ArcFace / CosFace margins, parallel
//!   softmax, Partial FC).
//! - [`losses`]: the distributed losses themselves; [`batch_norm`]: (Sync)BatchNorm.
//! - [`tiled`]: the contrastive losses computed in tiles (online log-sum-exp, blocks
//!   recomputed in the backward), exact, with loss memory per rank independent of the batch;
//!   and the same for a pairwise loss of your own.
//! - [`bert`]: a BERT encoder (Hugging Face checkpoints and tokenizers, keyed dropout) and
//!   [`simcse`]: SimCSE (InfoNCE losses, the objective, evaluation; `method: simcse` in allgrad-train).
//! - [`clip`]: CLIP and SigLIP on image-caption pairs (a ViT and a causal text transformer,
//!   losses over the global batch, Hugging Face folders in and out; `method: clip`).
//!
//! The modules import one way, each only from those before it: the errors (`error.rs`), `trace`,
//! `rng`, `files`; `batch_norm` and `resnet`; the temperature, the tiled losses, [`losses`] and
//! [`resnet_io`] (a ResNet in torchvision's layout, out and in); the [`Objective`] trait and what
//! it speaks of (`objective.rs`); [`bert`]; then the methods ([`image_ssl`], [`vectors`],
//! [`simcse`], [`clip`], and [`face`], whose image data are those of [`image_ssl`]).

#![warn(missing_docs)]

pub mod batch_norm;
pub mod bert;
pub mod clip;
mod error;
pub mod face;
mod files;
pub mod image_ssl;
pub mod losses;
mod objective;
pub mod resnet;
pub mod resnet_io;
pub mod rng;
pub mod simcse;
mod temperature;
pub mod tiled;
mod trace;
pub mod vectors;

pub use error::ModelError;
pub use files::save_safetensors;
pub use objective::{loss_of_embedded_batch, Batch, EmbeddingObjective, Objective, RowRange, SparseRows};
#[doc(hidden)]
pub use trace::{tiled_paths, TiledPaths};
