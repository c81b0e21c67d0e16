//! `face`: the class-sharded face-recognition method ([`FaceObjective`]): a backbone, the
//! ArcFace / CosFace head whose centres are split across ranks, Partial FC, open-set
//! verification. Sections: `data` (`synthetic`, `images` or `recordio`), `model` (`linear` or
//! `resnet`), `head`, and optionally `verify` (pairs drawn from the held-out identities) and
//! `eval` (the benchmarks' verification `.bin` files).

use allgrad_models::face::{CentreStorage, EvalConfig, FaceData, FaceModel, FaceObjective, HeadConfig, VerifyConfig};
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
    /// The benchmarks' verification `.bin` files.
    #[serde(default)]
    pub eval: EvalConfig,
}

/// `face`: see the module docs.
pub struct Face;

impl Method for Face {
    type Sections = FaceSections;

    fn path_keys(&self) -> &'static [&'static str] {
        &["data.dir", "eval.verification", "model.init_from"]
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
        if let Some((cfg, _)) = s.model.insightface() {
            let crop = match &s.data {
                FaceData::Images(d) => d.augment.crop.as_ref(),
                FaceData::Recordio(d) => d.augment.crop.as_ref(),
                FaceData::Synthetic(_) => None,
            };
            if let Some(c) = crop.filter(|c| c.size != cfg.input_size) {
                return Err(SectionError::new(
                    "model.input_size",
                    format!(
                        "is {}, and data.augment.crop.size is {}: the crops are the backbone's input (insightface's faces \
                         are 112x112)",
                        cfg.input_size, c.size
                    ),
                ));
            }
        }
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
                "data.kind `synthetic` takes model.kind `linear`, `images` and `recordio` take `resnet`, `iresnet` or `mobilefacenet`",
            ));
        }
        if !s.eval.verification.is_empty() && kinds.0 {
            return Err(SectionError::new("eval.verification", "verification .bin files need image data (images or recordio)"));
        }
        if s.eval.batch == 0 {
            return Err(SectionError::new("eval.batch", "must be positive"));
        }
        Ok(())
    }

    fn objective(&self, s: FaceSections, run: &RunConfig, device: &Device) -> candle_core::Result<Box<dyn Objective>> {
        Ok(Box::new(FaceObjective::with_eval(
            &s.data,
            s.model,
            s.head,
            s.verify,
            s.eval,
            run.seed,
            device.clone(),
            run.candle_dtype(),
        )?))
    }
}
