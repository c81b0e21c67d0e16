//! The `vectors` method ([`Vectors`]): an MLP on seeded synthetic vectors, with either loss,
//! on the sections of [`super::contrastive`].

use allgrad_models::vectors::{VectorContrastive, VectorData, VectorModel};
use allgrad_models::Objective;
use candle_core::Device;

use super::contrastive::{check_loss, expect_kind, ContrastiveSections, DataConfig, ModelConfig};
use super::{Method, SectionError};
use crate::config::RunConfig;

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
