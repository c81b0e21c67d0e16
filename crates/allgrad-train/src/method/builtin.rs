//! The built-in methods and the sections they share: `data`, `model` and `loss`.
//!
//! - `vectors` ([`Vectors`]): an MLP on seeded synthetic vectors, with either loss.
//! - `simclr` and `barlowtwins` ([`ImageMethod`]): the two-view image method with NT-Xent
//!   (both views in one batch) or the cross-correlation loss (each view on its own).
//!
//! NT-Xent takes `loss.tile: T` to compute its logits in `T x T` blocks
//! (`allgrad_models::tiled`): the same loss and gradients with the loss's memory independent of
//! the batch, and with it `loss.queue: K` to score every anchor also against the candidates of
//! the last K global batches (a memory bank: negatives without gradient, identical on every
//! rank, checkpointed as the buffer `loss.queue`). The cross-correlation has no tiled form and
//! refuses the keys.

use allgrad_models::image_ssl::{ImageData, ImageModel, TwoViewMethod, ViewBatch};
use allgrad_models::losses::LossConfig;
use allgrad_models::vectors::{VectorContrastive, VectorData, VectorModel};
use allgrad_models::{ModelError, Objective};
use candle_core::Device;
use serde::{Deserialize, Serialize};

use super::{Method, SectionError};
use crate::config::RunConfig;

/// The sections of the built-in methods.
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
fn expect_kind(method: &str, key: &str, want: &str, got: &str) -> Result<(), SectionError> {
    if want == got {
        return Ok(());
    }
    Err(SectionError::new(key, format!("method `{method}` takes {key} `{want}`, got `{got}`")))
}

fn check_loss(loss: &LossConfig) -> Result<(), SectionError> {
    loss.validate().map_err(|e| match e {
        ModelError::LossValue { key, .. } | ModelError::LossKey { key, .. } => {
            SectionError::new(format!("loss.{key}"), e.to_string())
        }
        e => SectionError::new("loss", e.to_string()),
    })
}

/// `vectors`: [`VectorContrastive`], an MLP on seeded synthetic vectors trained with either
/// loss (default NT-Xent). Seconds to train: smoke runs, examples, equivalence tests.
pub struct Vectors;

impl Vectors {
    fn parts(s: &ContrastiveSections) -> Option<(&VectorData, &VectorModel)> {
        match (&s.data, &s.model) {
            (DataConfig::Vectors(d), ModelConfig::Mlp(m)) => Some((d, m)),
            _ => None,
        }
    }
}

impl Method for Vectors {
    type Sections = ContrastiveSections;

    fn validate(&self, s: &ContrastiveSections, run: &RunConfig, _world_size: usize) -> Result<(), SectionError> {
        expect_kind("vectors", "data.kind", "vectors", s.data.kind())?;
        expect_kind("vectors", "model.kind", "mlp", s.model.kind())?;
        if let Some(loss) = &s.loss {
            check_loss(loss)?;
        }
        if let Some((d, _)) = Self::parts(s) {
            if d.samples < run.train.global_batch {
                return Err(SectionError::new(
                    "data.samples",
                    format!("data.samples = {} is smaller than train.global_batch = {}", d.samples, run.train.global_batch),
                ));
            }
        }
        Ok(())
    }

    fn objective(&self, s: ContrastiveSections, run: &RunConfig, device: &Device) -> candle_core::Result<Box<dyn Objective>> {
        let Some((d, m)) = Self::parts(&s) else {
            candle_core::bail!("method `vectors` needs data.kind `vectors` and model.kind `mlp`");
        };
        let loss = s.loss.clone().unwrap_or_default();
        Ok(Box::new(VectorContrastive::new(d.clone(), m.clone(), loss, run.seed, device.clone(), run.candle_dtype())?))
    }
}

/// `simclr` and `barlowtwins`: [`TwoViewMethod`] on image data with a ResNet encoder, with
/// the loss (and view batching) that names the method.
pub struct ImageMethod {
    name: &'static str,
    default_loss: LossConfig,
    batch: ViewBatch,
}

impl ImageMethod {
    /// SimCLR: NT-Xent over global negatives, both views in one batch.
    pub const SIMCLR: ImageMethod = ImageMethod {
        name: "simclr",
        default_loss: LossConfig::NtXent { temperature: 0.2, tile: None, queue: None },
        batch: ViewBatch::Joint,
    };
    /// BarlowTwins: the cross-correlation over the global batch, each view on its own.
    pub const BARLOW_TWINS: ImageMethod = ImageMethod {
        name: "barlowtwins",
        default_loss: LossConfig::CrossCorrelation { lambda: 0.005, scale: 1.0, tile: None },
        batch: ViewBatch::PerView,
    };

    fn loss(&self, s: &ContrastiveSections) -> LossConfig {
        s.loss.clone().unwrap_or_else(|| self.default_loss.clone())
    }
}

impl Method for ImageMethod {
    type Sections = ContrastiveSections;

    fn path_keys(&self) -> &'static [&'static str] {
        &["data.dir"]
    }

    fn validate(&self, s: &ContrastiveSections, run: &RunConfig, world_size: usize) -> Result<(), SectionError> {
        expect_kind(self.name, "data.kind", "images", s.data.kind())?;
        expect_kind(self.name, "model.kind", "resnet", s.model.kind())?;
        let loss = self.loss(s);
        expect_kind(self.name, "loss.kind", self.default_loss.kind(), loss.kind())?;
        if let DataConfig::Images(d) = &s.data {
            if d.format == allgrad_models::image_ssl::ImageFormat::Webdataset {
                d.webdataset.validate(run.train.global_batch, world_size).map_err(|e| match e {
                    allgrad_data::DataError::Config { field, reason } => SectionError::new(format!("data.{field}"), reason),
                    e => SectionError::new("data.webdataset", e.to_string()),
                })?;
                if !d.webdataset.test.is_empty() && d.knn.bank == 0 {
                    return Err(SectionError::new(
                        "data.knn.bank",
                        "with webdataset test shards, give the kNN bank's size: its samples (the first of the training \
                         shards) are indexed when the run starts, and 0 (all) would read every training shard",
                    ));
                }
            }
            let knn = &d.knn;
            if knn.k == 0 {
                return Err(SectionError::new("data.knn.k", "must be at least 1 (the neighbours that vote)"));
            }
            if !(knn.temperature > 0.0 && knn.temperature.is_finite()) {
                return Err(SectionError::new("data.knn.temperature", format!("must be positive, got {}", knn.temperature)));
            }
        }
        check_loss(&loss)
    }

    fn objective(&self, s: ContrastiveSections, run: &RunConfig, device: &Device) -> candle_core::Result<Box<dyn Objective>> {
        let loss = self.loss(&s);
        let (DataConfig::Images(d), ModelConfig::Resnet(m)) = (s.data, s.model) else {
            candle_core::bail!("method `{}` needs data.kind `images` and model.kind `resnet`", self.name);
        };
        let method = TwoViewMethod::new(&d, m, loss, self.batch, device.clone(), run.candle_dtype())?;
        Ok(Box::new(method.with_global_batch(run.train.global_batch)?))
    }
}
