//! The `simclr` and `barlowtwins` methods ([`ImageMethod`]): the two-view image method with
//! NT-Xent (both views in one batch) or the cross-correlation loss (each view on its own), on
//! the sections of [`super::contrastive`].

use allgrad_models::image_ssl::{TwoViewMethod, ViewBatch};
use allgrad_models::losses::LossConfig;
use allgrad_models::Objective;
use candle_core::Device;

use super::contrastive::{check_loss, expect_kind, ContrastiveSections, DataConfig, ModelConfig};
use super::{Method, SectionError};
use crate::config::RunConfig;

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
        &["data.dir", "model.init_from"]
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
