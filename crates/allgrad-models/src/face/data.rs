//! The face method's data: identities with several "photos" each.
//!
//! - `synthetic`: seeded vectors, sample i of class `i mod C` (C = `head.num_classes`) at
//!   that class's random direction plus noise, keyed by (seed, i). Seconds to train: the
//!   trainer's equivalence and resume tests.
//! - `images`: an image data set on disk (the image methods' `data` section; for the glyph
//!   stand-in, `data/glyphs` in IDX format with 32-bit labels): identities A in `train`,
//!   disjoint identities B in `test` for open-set verification.
//! - `recordio`: an insightface training set, `train.rec`/`train.idx`/`property` in `dir`
//!   ([`allgrad_data::RecordIo`]); no held-out split (verification comes from the `.bin` files
//!   of `eval.verification`).

use std::sync::Arc;

use std::path::PathBuf;

use allgrad_data::{Augment, AugmentConfig, ColorMode, Dataset, OnBadRecord, RecordIo, RecordIoOptions, Split, ViewKey};
use allgrad_rng::{normals, stream};
use candle_core::{DType, Device, Result, Tensor};
use serde::{Deserialize, Serialize};

use crate::image_ssl::ImageData;
use crate::ModelError;

/// Key words of the synthetic data's streams.
const CLASS_KEY: u64 = 0xDA7A_C1A5_5000_0005;
const SAMPLE_KEY: u64 = 0xDA7A_5A4E_0000_0006;

/// The `data` section of the face method.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum FaceData {
    /// Seeded synthetic vectors.
    Synthetic(SyntheticFaces),
    /// Images on disk.
    Images(Box<ImageData>),
    /// An indexed RecordIO training set.
    Recordio(Box<RecordIoData>),
}

/// The `recordio` data: insightface's `train.rec`, `train.idx` and `property` in one folder.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RecordIoData {
    /// The folder of `train.rec`, `train.idx` and (optionally) `property`.
    pub dir: PathBuf,
    /// Channel conversion of every image (and of the `.bin` images of `eval.verification`).
    #[serde(default)]
    pub color: ColorMode,
    /// A bad record: `error` (the default) or `skip` (left out, with a warning).
    #[serde(default)]
    pub on_corrupt: OnBadRecord,
    /// Augmentations of the training images (the normalisation is also the evaluation's).
    #[serde(default)]
    pub augment: AugmentConfig,
}

impl FaceData {
    /// The colour mode the images are read in (RGB for synthetic data, which has none).
    pub fn color(&self) -> ColorMode {
        match self {
            FaceData::Synthetic(_) => ColorMode::Rgb,
            FaceData::Images(d) => d.folder.color,
            FaceData::Recordio(d) => d.color,
        }
    }
}

/// Synthetic identities.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SyntheticFaces {
    /// Training samples.
    pub samples: usize,
    /// Width of each vector.
    pub dim: usize,
    /// Standard deviation of the noise around the class direction.
    #[serde(default = "default_noise")]
    pub noise: f64,
}

fn default_noise() -> f64 {
    0.5
}

/// Opened data: the training samples and their labels, and (images) the held-out set (one
/// per objective: the size difference of the variants does not matter).
#[allow(clippy::large_enum_variant)]
pub(crate) enum Source {
    Synthetic { cfg: SyntheticFaces, classes: usize, seed: u64 },
    Images { train: Arc<dyn Dataset>, test: Option<Arc<dyn Dataset>>, augment: Augment, eval: Augment },
}

impl Source {
    pub(crate) fn open(data: &FaceData, classes: usize, seed: u64) -> Result<Source> {
        match data {
            FaceData::Synthetic(cfg) => {
                if cfg.samples == 0 || cfg.dim == 0 {
                    return Err(ModelError::HeadInput("data.samples and data.dim must be positive".into()).into());
                }
                Ok(Source::Synthetic { cfg: cfg.clone(), classes, seed })
            }
            FaceData::Images(d) => {
                let train = d.open(Split::Train)?;
                let test = d.open(Split::Test)?;
                if train.num_classes() > classes {
                    return Err(ModelError::HeadInput(format!(
                        "the training set has {} identities, more than head.num_classes = {classes}",
                        train.num_classes()
                    ))
                    .into());
                }
                let augment = Augment::new(d.augment.clone()).map_err(ModelError::Augment)?;
                let eval = Augment::new(AugmentConfig::eval(d.augment.normalize.clone())).map_err(ModelError::Augment)?;
                Ok(Source::Images { train, test: Some(test), augment, eval })
            }
            FaceData::Recordio(d) => {
                let opts = RecordIoOptions { color: d.color, on_corrupt: d.on_corrupt };
                let err = |source| ModelError::OpenData { dir: d.dir.clone(), source };
                let train: Arc<dyn Dataset> = Arc::new(RecordIo::open(&d.dir, &opts).map_err(err)?);
                if train.num_classes() > classes {
                    return Err(ModelError::HeadInput(format!(
                        "{}: the training set has {} identities, more than head.num_classes = {classes}",
                        d.dir.display(),
                        train.num_classes()
                    ))
                    .into());
                }
                let augment = Augment::new(d.augment.clone()).map_err(ModelError::Augment)?;
                let eval = Augment::new(AugmentConfig::eval(d.augment.normalize.clone())).map_err(ModelError::Augment)?;
                Ok(Source::Images { train, test: None, augment, eval })
            }
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            Source::Synthetic { cfg, .. } => cfg.samples,
            Source::Images { train, .. } => train.len(),
        }
    }

    /// Input width of the linear backbone (0 for images).
    pub(crate) fn in_dim(&self) -> usize {
        match self {
            Source::Synthetic { cfg, .. } => cfg.dim,
            Source::Images { .. } => 0,
        }
    }

    /// The inputs and labels of training samples `indices` (augmented, keyed by the epoch).
    pub(crate) fn batch(
        &self,
        indices: &[usize],
        seed: u64,
        epoch: usize,
        device: &Device,
        dtype: DType,
    ) -> Result<(Tensor, Vec<usize>)> {
        match self {
            Source::Synthetic { cfg, classes, seed: data_seed } => {
                let mut v = Vec::with_capacity(indices.len() * cfg.dim);
                let mut labels = Vec::with_capacity(indices.len());
                for &i in indices {
                    let c = i % classes;
                    let dir = normals(&mut stream(&[*data_seed, CLASS_KEY, c as u64]), cfg.dim);
                    let noise = normals(&mut stream(&[*data_seed, SAMPLE_KEY, i as u64]), cfg.dim);
                    v.extend(dir.iter().zip(&noise).map(|(d, n)| d + cfg.noise * n));
                    labels.push(c);
                }
                Ok((Tensor::from_vec(v, (indices.len(), cfg.dim), device)?.to_dtype(dtype)?, labels))
            }
            Source::Images { train, augment, .. } => {
                let key = |i: usize| ViewKey { seed, epoch: epoch as u64, index: i as u64, view: 0 };
                images(train, augment, indices, key, device, dtype)
            }
        }
    }

    /// The labels of training samples `indices` (without reading their inputs).
    pub(crate) fn labels(&self, indices: &[usize]) -> Result<Vec<usize>> {
        match self {
            Source::Synthetic { classes, .. } => Ok(indices.iter().map(|i| i % classes).collect()),
            Source::Images { train, .. } => {
                indices.iter().map(|&i| train.label(i).map_err(|e| ModelError::Data(e).into())).collect()
            }
        }
    }

    /// The un-augmented held-out images `indices` and their identities (images only).
    pub(crate) fn test_batch(&self, indices: &[usize], device: &Device, dtype: DType) -> Result<Option<(Tensor, Vec<usize>)>> {
        match self {
            Source::Synthetic { .. } => Ok(None),
            Source::Images { test: Some(test), eval, .. } => {
                let key = |i: usize| ViewKey { seed: 0, epoch: 0, index: i as u64, view: 0 };
                images(test, eval, indices, key, device, dtype).map(Some)
            }
            Source::Images { test: None, .. } => Ok(None),
        }
    }

    /// The held-out set (images only).
    pub(crate) fn test(&self) -> Option<&Arc<dyn Dataset>> {
        match self {
            Source::Synthetic { .. } => None,
            Source::Images { test, .. } => test.as_ref(),
        }
    }

    /// The evaluation pipeline (images only): the training data's normalisation, nothing random.
    pub(crate) fn eval(&self) -> Option<&Augment> {
        match self {
            Source::Synthetic { .. } => None,
            Source::Images { eval, .. } => Some(eval),
        }
    }
}

fn images(
    set: &Arc<dyn Dataset>,
    augment: &Augment,
    indices: &[usize],
    key: impl Fn(usize) -> ViewKey,
    device: &Device,
    dtype: DType,
) -> Result<(Tensor, Vec<usize>)> {
    let mut data = Vec::new();
    let mut labels = Vec::with_capacity(indices.len());
    let mut shape = (0, 0, 0);
    for &i in indices {
        let img = set.get(i).map_err(ModelError::Data)?;
        let v = augment.apply(&img, key(i)).map_err(ModelError::Data)?;
        shape = (v.channels, v.height, v.width);
        data.extend(v.data);
        labels.push(set.label(i).map_err(ModelError::Data)?);
    }
    let t = Tensor::from_vec(data, (indices.len(), shape.0, shape.1, shape.2), device)?.to_dtype(dtype)?;
    Ok((t, labels))
}
