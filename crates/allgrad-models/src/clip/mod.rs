//! Image-text contrastive learning over the global batch: CLIP (Radford et al., 2021) and
//! SigLIP (Zhai et al., 2023).
//!
//! - [`loss`]: CLIP's symmetric InfoNCE (whole, or in tiles through [`crate::tiled`]) and
//!   SigLIP's sigmoid loss in its all-gather form, each rank's rows against every rank's
//!   columns through the differentiable collectives; W-invariant by the sum rule.
//! - [`ring`]: both losses in the ring form, whose memory does not grow with the ranks: each
//!   rank keeps its own blocks and per-row statistics, the backward runs the ring again.
//! - [`ClipModel`]: a Vision Transformer and CLIP's causal text transformer with projections
//!   and the learned logit scale, under `transformers`' `CLIPModel` parameter names.
//! - [`ClipFolder`], [`export_clip_folder`]: Hugging Face CLIP folders in and out.
//! - [`PairSource`]: image-caption pairs ([`CsvPairs`], [`ClassCaptions`]).
//! - [`Clip`]: the objective (`method: clip` in allgrad-train), with gradient caching
//!   (both towers embed each chunk) and zero-shot / retrieval evaluation.

mod config;
mod data;
mod folder;
pub mod loss;
mod model;
mod objective;
pub mod ring;
mod settings;

pub use config::{Activation, ClipConfig, ClipTextConfig, ClipVisionConfig};
pub use data::{ClassCaptions, CsvPairs, PairSource, Pixels};
pub use folder::{export_clip_folder, ClipFolder, ClipTokenizer, ClipWeights};
pub use loss::{clip_loss, clip_loss_tiled, clip_scale, siglip_loss};
pub use model::{ClipModel, TextTower, VisionTower};
pub use objective::{Clip, OPENAI_MEAN, OPENAI_STD};
pub use ring::{clip_loss_ring, siglip_loss_ring, RingOptions};
pub use settings::{ClipData, ClipEval, ClipLoss, ClipModelSection, LossKind};
