//! Image-text contrastive learning over the global batch: CLIP (Radford et al., 2021) and
//! SigLIP (Zhai et al., 2023).
//!
//! - [`loss`]: CLIP's symmetric InfoNCE (whole, or in tiles through [`crate::tiled`]) and
//!   SigLIP's sigmoid loss in its all-gather form, each rank's rows against every rank's
//!   columns through the differentiable collectives; W-invariant by the sum rule.
//! - [`ring`]: both losses in the ring form, whose memory does not grow with the ranks: each
//!   rank keeps its own blocks and per-row statistics, the backward runs the ring again.
//! - [`ClipModel`]: a Vision Transformer and CLIP's causal text transformer with projections
//!   and the learned logit scale, under `transformers`' `CLIPModel` parameter names; or
//!   SigLIP's towers (attention-pool head, last-token text pooling, logit bias) under
//!   `SiglipModel`'s ([`Architecture`]).
//! - [`ClipFolder`], [`export_clip_folder`]: Hugging Face CLIP and SigLIP folders in and out.
//! - [`ImageProcessor`]: a folder's `preprocessor_config.json`, run by allgrad-data's
//!   [`allgrad_data::Preprocess`] (Pillow's bicubic resize, centre crop, normalisation;
//!   OpenCLIP's random crop for training).
//! - [`CsvPairs`], [`ClassCaptions`]: image-caption pairs as data sets; webdataset shards as a
//!   stream; [`PairData`]: the training pairs through the loader's threads ([`ClipInputs`]).
//! - [`ClipEvaluation`]: zero-shot classification and retrieval on an IDX test split or an
//!   image folder ([`open_test_set`]), each rank embedding its share.
//! - [`Clip`]: the objective (`method: clip` in allgrad-train), with gradient caching
//!   (both towers embed each chunk).

mod config;
mod data;
mod eval;
mod folder;
mod inputs;
pub mod loss;
mod model;
mod objective;
mod preprocess;
pub mod ring;
mod ring_tensors;
mod settings;

pub use config::{Activation, Architecture, ClipConfig, ClipTextConfig, ClipVisionConfig, TextPooling, LEGACY_EOS, OPENAI_EOT};
pub use data::{ClassCaptions, CsvPairs};
pub use eval::{has_idx_test_split, open_test_set, ClipEvaluation, EvalShare, TestSet};
pub use folder::{export_clip_folder, ClipFolder, ClipTokenizer, ClipWeights};
pub use inputs::{ClipInputs, PairData};
pub use loss::{clip_loss, clip_loss_tiled, clip_scale, siglip_loss};
pub use model::{ClipModel, TextTower, VisionTower, SIGLIP_BIAS_INIT};
pub use objective::{image_processor, Clip};
pub use preprocess::{ImageProcessor, OPENAI_MEAN, OPENAI_STD, PREPROCESSOR_CONFIG};
pub use ring::{clip_loss_ring, siglip_loss_ring, RingOptions};
pub use settings::{ClipData, ClipEval, ClipLoss, ClipModelSection, LossKind};
