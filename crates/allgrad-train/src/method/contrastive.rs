//! The sections the `vectors`, `simclr` and `barlowtwins` methods share: `data`, `model` and
//! `loss`, one schema whose `kind` tags pick the method's data and model (a kind another method
//! takes is refused naming the method), and their checks of those tags and of the loss.
//!
//! NT-Xent takes `loss.tile: T` to compute its logits in `T x T` blocks
//! (`allgrad_models::tiled`): the same loss and gradients with the loss's memory independent of
//! the batch, and with it `loss.queue: K` to score every anchor also against the candidates of
//! the last K global batches (a memory bank: negatives without gradient, identical on every
//! rank, checkpointed as the buffer `loss.queue`). The cross-correlation has no tiled form and
//! refuses the keys.

use allgrad_models::image_ssl::{ImageData, ImageModel};
use allgrad_models::losses::LossConfig;
use allgrad_models::vectors::{VectorData, VectorModel};
use serde::{Deserialize, Serialize};

use super::SectionError;

/// The sections of the `vectors`, `simclr` and `barlowtwins` methods.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ContrastiveSections {
    /// The training data.
    pub data: DataConfig,
    /// The model.
    pub model: ModelConfig,
    /// The loss (default: the method's own, with its default parameters).
    #[serde(default)]
    pub loss: Option<LossConfig>,
}

/// The `data` section.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum DataConfig {
    /// Seeded synthetic vectors around random cluster centres.
    Vectors(VectorData),
    /// An image data set on disk, with the augmentations that make two views.
    Images(Box<ImageData>),
}

impl DataConfig {
    /// The `kind` tag.
    pub fn kind(&self) -> &'static str {
        match self {
            DataConfig::Vectors(_) => "vectors",
            DataConfig::Images(_) => "images",
        }
    }
}

/// The `model` section.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ModelConfig {
    /// A two-layer perceptron encoder (for vector data).
    Mlp(VectorModel),
    /// A ResNet encoder and a projection MLP (for images).
    Resnet(ImageModel),
}

impl ModelConfig {
    /// The `kind` tag.
    pub fn kind(&self) -> &'static str {
        match self {
            ModelConfig::Mlp(_) => "mlp",
            ModelConfig::Resnet(_) => "resnet",
        }
    }
}

/// `key: method `name` takes `want`, got `got``, unless they agree.
pub(super) fn expect_kind(method: &str, key: &str, want: &str, got: &str) -> Result<(), SectionError> {
    if want == got {
        return Ok(());
    }
    Err(SectionError::new(key, format!("method `{method}` takes {key} `{want}`, got `{got}`")))
}

/// The `loss` section's own checks, as an error at its key.
pub(super) fn check_loss(loss: &LossConfig) -> Result<(), SectionError> {
    loss.validate().map_err(|e| SectionError::from_model(e, "loss"))
}
