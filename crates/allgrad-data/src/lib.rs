//! # allgrad-data
//!
//! Datasets, augmentations and a threaded batch loader for allgrad's contrastive training.
//!
//! - Readers, each a [`Dataset`] of 8-bit [`Image`]s with class labels: [`IdxDataset`]
//!   (MNIST / Fashion-MNIST, raw or gzipped), [`ImageFolder`] (PNG/JPEG in one sub-folder per
//!   class), [`Cifar10`] (binary batches) and [`RecordIo`] (MXNet's indexed RecordIO, the face
//!   training sets of insightface); [`InMemory`] for images already in memory. The face
//!   benchmarks' verification pairs: [`VerificationBin`].
//!   Corrupt or truncated files give a [`DataError`] naming the file and the fault; nothing
//!   panics on bad input.
//! - Augmentations ([`Augment`], configured by [`AugmentConfig`]; [`TwoViews`] for pairs):
//!   RandomResizedCrop, flip, colour jitter, grayscale, Gaussian blur and normalisation,
//!   every random choice drawn from a stream keyed by (seed, epoch, global sample index,
//!   view), see [`rng`]. A sample's views therefore never depend on the rank, the worker or
//!   its position in a batch, which keeps a run on W ranks equal to a run on one.
//! - [`DistributedSampler`]: which global samples each rank takes at each step.
//! - [`Loader`]: batches of global indices in, `[B, C, H, W]` f32 tensors out, built on
//!   worker threads with bounded prefetch, in order and identical for any number of workers.
//!
//! A small Fashion-MNIST subset ships in the repository's `data/fashion-mnist/`:
//!
//! ```no_run
//! use std::sync::Arc;
//! use allgrad_data::{AugmentConfig, Dataset, IdxDataset, Loader, LoaderConfig, Normalize, Split, TwoViews};
//! let train = Arc::new(IdxDataset::open_dir("data/fashion-mnist", Split::Train)?);
//! let cfg = AugmentConfig { normalize: Normalize { mean: vec![0.2860], std: vec![0.3530] }, ..AugmentConfig::simclr(28) };
//! let views = Arc::new(TwoViews::new(cfg)?);
//! let plan: Vec<Vec<usize>> = (0..train.len() / 256).map(|b| (b * 256..(b + 1) * 256).collect()).collect();
//! for batch in Loader::new(train, views, 0, 0, plan, &LoaderConfig::default(), &candle_core::Device::Cpu)? {
//!     let batch = batch?; // batch.views[0], batch.views[1]: [256, 1, 28, 28]
//! }
//! # Ok::<(), allgrad_data::DataError>(())
//! ```

#![warn(missing_docs)]

pub mod augment;
mod cifar;
mod dataset;
mod decode;
mod error;
mod face_bin;
mod folder;
mod host;
mod idx;
mod image;
mod loader;
#[cfg(feature = "cuda")]
mod pinned;
mod preprocess;
mod read;
mod recordio;
pub mod rng;
mod sampler;
pub mod webdataset;

pub use augment::{resize_box, resize_box_shrunk, shrink_for};
pub use augment::{
    Augment, AugmentConfig, ColorJitter, CropBox, GaussianBlur, Normalize, Pipeline, RandomGrayscale, RandomHorizontalFlip,
    RandomResizedCrop, Resample, Stage, TwoViews, ViewKey,
};
pub use cifar::{Cifar10, CIFAR10_CLASSES, CIFAR_RECORD, CIFAR_SIDE};
pub use dataset::{Dataset, InMemory, Split};
pub use decode::{decode_counts, decode_image, decode_image_shrunk, is_jpeg, ColorMode};
pub use error::{DataError, DataResult};
pub use face_bin::VerificationBin;
pub use folder::{FolderOptions, ImageFolder};
pub use host::{pinned_uploads, Batch};
pub use idx::IdxDataset;
pub use image::{Chw, Decoded, FloatImage, Image};
pub use loader::{Loader, LoaderConfig};
pub use preprocess::Preprocess;
pub use recordio::{OnBadRecord, RecordHeader, RecordIo, RecordIoOptions, RecordIoWriter, IR_HEADER_LEN, RECORD_MAGIC};
pub use sampler::DistributedSampler;
