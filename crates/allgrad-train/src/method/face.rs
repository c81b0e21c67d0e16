//! `face`: the class-sharded face-recognition method ([`FaceObjective`]): a backbone, the
//! ArcFace / CosFace head whose centres are split across ranks, Partial FC, open-set
//! verification. Sections: `data` (`synthetic` or `images`), `model` (`linear` or `resnet`),
//! `head`, and optionally `verify`.

use allgrad_models::face::{CentreStorage, FaceData, FaceModel, FaceObjective, HeadConfig, VerifyConfig};
use allgrad_models::Objective;
use candle_core::Device;
use serde::{Deserialize, Serialize};

use super::{Method, SectionError};
use crate::config::{DeviceKind, OptimConfig, ParamDtype, RunConfig};

/// The sections of `face`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FaceSections {
    /// The training (and held-out) data.
    pub data: FaceData,
    /// The backbone.
    pub model: FaceModel,
    /// The head.
    pub head: HeadConfig,
    /// Open-set verification.
    #[serde(default)]
    pub verify: VerifyConfig,
}

/// `face`: see the module docs.
pub struct Face;

impl Method for Face {
    type Sections = FaceSections;

    fn path_keys(&self) -> &'static [&'static str] {
        &["data.dir", "model.init_from"]
    }

    fn validate(&self, s: &FaceSections, run: &RunConfig, world_size: usize) -> Result<(), SectionError> {
        if let FaceData::Images(d) = &s.data {
            if d.format == allgrad_models::image_ssl::ImageFormat::Webdataset {
                return Err(SectionError::new(
                    "data.format",
                    "face reads idx, cifar10 or folder data (webdataset streams are read by simclr and barlowtwins)",
                ));
            }
        }
        s.head.validate().map_err(|e| SectionError::from_model(e, "model"))?;
        s.model.validate().map_err(|e| SectionError::from_model(e, "model"))?;
        if s.head.num_classes < world_size {
            return Err(SectionError::new(
                "head.num_classes",
                format!("{} classes cannot be split over {world_size} ranks (each needs one)", s.head.num_classes),
            ));
        }
        if s.head.storage == CentreStorage::Bf16 {
            if matches!(run.optim, OptimConfig::Lars { .. }) {
                return Err(SectionError::new(
                    "head.storage",
                    "bf16 centres take optim.kind sgd or adamw: LARS updates every centre each step in the centres' dtype",
                ));
            }
            if run.dtype != ParamDtype::F32 {
                return Err(SectionError::new(
                    "head.storage",
                    "bf16 centres take dtype: f32 (the centres they use are read into f32 rows and updated in f32)",
                ));
            }
            if run.device != DeviceKind::Cpu {
                return Err(SectionError::new("head.storage", "bf16 centres are updated on the CPU only (device: cpu)"));
            }
        }
        let kinds = (matches!(s.data, FaceData::Synthetic(_)), matches!(s.model, FaceModel::Linear { .. }));
        if kinds.0 != kinds.1 {
            return Err(SectionError::new(
                "model.kind",
                "data.kind `synthetic` takes model.kind `linear`, `images` takes `resnet`",
            ));
        }
        Ok(())
    }

    fn objective(&self, s: FaceSections, run: &RunConfig, device: &Device) -> candle_core::Result<Box<dyn Objective>> {
        Ok(Box::new(FaceObjective::new(&s.data, s.model, s.head, s.verify, run.seed, device.clone(), run.candle_dtype())?))
    }
}
