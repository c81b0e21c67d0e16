//! The `data` section of the image methods and the data sets it opens.

use std::path::PathBuf;
use std::sync::Arc;

use allgrad_data::webdataset::{ShardStream, TarDataset, WebDatasetOptions};
use allgrad_data::{AugmentConfig, Cifar10, Dataset, FolderOptions, IdxDataset, ImageFolder, InMemory, LoaderConfig, Split};
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
    /// Options of the `webdataset` format (shards, epoch length, streams, shuffle buffer).
    #[serde(default)]
    pub webdataset: WebDatasetOptions,
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
    /// webdataset tar shards (`data.webdataset`): training samples streamed, shards split
    /// over ranks, a shuffle buffer, an epoch of `epoch_samples` samples.
    Webdataset,
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
    /// Opens the `split` of the data set. For `webdataset`, the evaluation sets: the test
    /// shards (the first `knn.queries`) and, as the training split, the kNN bank (the first
    /// `knn.bank` samples of the training shards, in the order listed); both empty when no
    /// test shards are listed (no kNN monitor then). Training samples come from
    /// [`ImageData::stream`].
    pub fn open(&self, split: Split) -> Result<Arc<dyn Dataset>> {
        let err = |source| ModelError::OpenData { dir: self.dir.clone(), source };
        Ok(match self.format {
            ImageFormat::Webdataset => {
                let opts = &self.webdataset;
                if opts.test.is_empty() {
                    return Ok(Arc::new(InMemory::new(Vec::new(), Vec::new(), 0).map_err(err)?));
                }
                let (shards, limit) = match split {
                    Split::Train => (opts.train_shards(&self.dir).map_err(err)?, self.knn.bank),
                    Split::Test => (opts.test_shards(&self.dir).map_err(err)?, self.knn.queries),
                };
                Arc::new(TarDataset::open(&shards, self.folder.color, limit).map_err(err)?)
            }
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

impl ImageData {
    /// The training stream of the `webdataset` format for global batches of `global_batch`
    /// (`None` for the other formats).
    pub fn stream(&self, global_batch: usize) -> Result<Option<Arc<ShardStream>>> {
        if self.format != ImageFormat::Webdataset {
            return Ok(None);
        }
        let err = |source| ModelError::OpenData { dir: self.dir.clone(), source };
        let shards = self.webdataset.train_shards(&self.dir).map_err(err)?;
        let stream = ShardStream::new(shards, self.webdataset.clone(), global_batch, self.folder.color).map_err(err)?;
        Ok(Some(Arc::new(stream)))
    }
}

pub(crate) fn data_err(e: allgrad_data::DataError) -> candle_core::Error {
    ModelError::Data(e).into()
}
