//! The `data` section of the image methods and the data sets it opens.

use std::path::PathBuf;
use std::sync::Arc;

use allgrad_data::{AugmentConfig, Cifar10, Dataset, FolderOptions, IdxDataset, ImageFolder, LoaderConfig, Split};
use candle_core::Result;
use serde::{Deserialize, Serialize};

use crate::ModelError;

/// The `data` section for images.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ImageData {
    /// Directory of the data set.
    pub dir: PathBuf,
    /// Its file format.
    pub format: ImageFormat,
    /// Augmentations making the two training views.
    #[serde(default)]
    pub augment: AugmentConfig,
    /// The kNN monitor.
    #[serde(default)]
    pub knn: KnnConfig,
    /// Threads that build the training views ahead of the model.
    #[serde(default)]
    pub loader: LoaderConfig,
    /// Options of the `folder` format.
    #[serde(default)]
    pub folder: FolderOptions,
}

/// On-disk formats.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ImageFormat {
    /// MNIST-style IDX files (`train-images-idx3-ubyte[.gz]`, ...).
    Idx,
    /// CIFAR-10 binary batches.
    Cifar10,
    /// Image files (PNG, JPEG, ...) in `train/` and `test/`, each with one sub-folder per
    /// class.
    Folder,
}

/// kNN evaluation of the encoder's features: each test image votes among its `k` most
/// similar training images (cosine similarity), weighted by `exp(similarity / temperature)`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct KnnConfig {
    /// Neighbours that vote.
    pub k: usize,
    /// Temperature of the vote weights.
    pub temperature: f64,
    /// Training images in the memory bank (the first ones of the set; 0 = all).
    pub bank: usize,
    /// Test images evaluated (the first ones; 0 = all).
    pub queries: usize,
    /// Full-batch steps of the linear probe trained on the same frozen features (0: no probe).
    pub linear_probe_steps: usize,
}

impl Default for KnnConfig {
    fn default() -> Self {
        KnnConfig { k: 200, temperature: 0.1, bank: 0, queries: 0, linear_probe_steps: 300 }
    }
}

impl ImageData {
    /// Opens the `split` of the data set.
    pub fn open(&self, split: Split) -> Result<Arc<dyn Dataset>> {
        let err = |source| ModelError::OpenData { dir: self.dir.clone(), source };
        Ok(match self.format {
            ImageFormat::Idx => Arc::new(IdxDataset::open_dir(&self.dir, split).map_err(err)?),
            ImageFormat::Cifar10 => Arc::new(Cifar10::open_dir(&self.dir, split).map_err(err)?),
            ImageFormat::Folder => {
                let sub = match split {
                    Split::Train => "train",
                    Split::Test => "test",
                };
                Arc::new(ImageFolder::open(self.dir.join(sub), &self.folder).map_err(err)?)
            }
        })
    }
}

pub(crate) fn data_err(e: allgrad_data::DataError) -> candle_core::Error {
    ModelError::Data(e).into()
}
