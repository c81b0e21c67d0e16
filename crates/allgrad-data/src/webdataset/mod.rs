//! webdataset tar shards: the format OpenCLIP, img2dataset and most large image sets use.
//!
//! A shard is a tar file; consecutive members with the same key (file name up to its first
//! dot) form one sample, each member under its extension: `jpg`/`jpeg`/`png` for the image,
//! `cls` for the class id, `txt` or `json` for text ([`shard`]); image-caption pairs carry their
//! caption in a member or a field of the `json` member ([`CaptionField`],
//! [`ShardStream::with_caption`]). Shards are listed as paths or brace patterns,
//! `train-{000000..000127}.tar` ([`expand`]), several in one entry joined by `::` ([`shard_paths`]).
//!
//! Two ways to read them:
//!
//! - [`ShardStream`] streams training samples, the webdataset way (shards read front to
//!   back, a shuffle buffer), yet exactly reproducibly: the stream is cut into `streams`
//!   independent streams, each with its own sequence of shards and its own shuffle buffer,
//!   every choice drawn from a keyed random stream (seed, epoch, stream, ...). A global batch
//!   of B takes B / streams consecutive samples from each stream, streams in order, so rank r
//!   of W reads only streams `r·streams/W .. (r+1)·streams/W` (its shards), and the batches
//!   are the same for any W and any number of loader workers: a view depends on (seed,
//!   epoch, the sample's position in the epoch, view) only. An epoch is a number of samples,
//!   drawn with replacement over shards (`resampled`, OpenCLIP's `--dataset-resampled`) or
//!   from each stream's share of a per-epoch permutation. A run resumed from a checkpoint at
//!   any step reads each stream forward to where the step left it, so the batches after a
//!   resume are those of an uninterrupted run ([`StreamLoader`]).
//! - [`TarDataset`] indexes shards (one pass) for random access: the evaluation sets.
//!
//! [`ShardWriter`] writes shards (the `write-shards` binary turns an image folder into
//! them).

mod index;
mod loader;
mod pattern;
pub mod shard;
mod stream;
mod write;

pub use index::TarDataset;
pub use loader::StreamLoader;
pub use pattern::expand;
pub use shard::{CaptionField, Sample, ShardReader};
pub use stream::{LaneState, ShardStream, StreamLayout, StreamState};
pub use write::ShardWriter;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{DataError, DataResult};

/// What a corrupt training sample (no image member, a `cls` that is not a class id, an image
/// that does not decode) does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnCorrupt {
    /// Stop with an error naming the shard, the sample's key and its byte offset.
    #[default]
    Error,
    /// Leave the sample out (the stream takes the next one), log it and count it.
    Skip,
}

/// The `webdataset` options of an image data set (`data.webdataset` in a run config).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WebDatasetOptions {
    /// Training shards: paths or brace patterns, relative to the data directory.
    pub train: Vec<String>,
    /// Evaluation shards (the kNN monitor's queries; every sample needs a `cls`), read in
    /// the order listed.
    pub test: Vec<String>,
    /// Samples in one epoch (required): the trainer's epoch is this many samples, whatever
    /// the shards hold.
    pub epoch_samples: usize,
    /// Independent sample streams, each with its own shards and shuffle buffer. Must be a
    /// multiple of the world size and divide the global batch; a rank reads `streams / W` of
    /// them, on up to as many loader workers. Changing it changes the data order.
    pub streams: usize,
    /// Samples each stream holds in its shuffle buffer (0: no shuffling within shards).
    pub shuffle_buffer: usize,
    /// Each stream draws its shards uniformly with replacement (true), or cycles through its
    /// share of a per-epoch permutation of the shards (false; needs at least `streams`
    /// shards). Without resampling each pass over a stream's shards gives each of their
    /// samples once (the shuffle buffer is emptied at the end of a pass), so an epoch gives
    /// every sample exactly once when each stream's shards hold `epoch_samples / streams`
    /// samples (for instance shards of equal size, a number of them that `streams` divides,
    /// and `epoch_samples` their total).
    pub resampled: bool,
    /// What a corrupt sample does. Under `skip`, a stream all of whose shards have been read
    /// through giving only corrupt samples (shards of GIF images only, say) is an error naming the last
    /// such shard and why, instead of skipping forever.
    pub on_corrupt: OnCorrupt,
    /// Under `on_corrupt: skip`, the most a stream may leave out in one epoch, as a fraction
    /// in (0, 1) of its share of the epoch (`epoch_samples / streams`): a stream that leaves
    /// out more stops the run with an error naming the count. `None` (the default): no limit.
    pub max_skipped: Option<f64>,
    /// On resume, when a shard the checkpoint's stream position names is missing or changed
    /// (size or modification time): `false` (the default) stops with an error naming the
    /// shard; `true` logs it and restarts the epoch's streams from their first shards (the
    /// steps already taken in that epoch see their samples again).
    pub reshard_ok: bool,
    /// The member extensions a training sample keeps (`[jpg, jpeg, png, cls]`, say): the others
    /// are dropped as each sample is read, before it waits in a shuffle buffer. Empty (the
    /// default): every member is kept.
    pub fields: Vec<String>,
}

impl Default for WebDatasetOptions {
    fn default() -> Self {
        WebDatasetOptions {
            train: Vec::new(),
            test: Vec::new(),
            epoch_samples: 0,
            streams: 8,
            shuffle_buffer: 1000,
            resampled: true,
            on_corrupt: OnCorrupt::Error,
            max_skipped: None,
            reshard_ok: false,
            fields: Vec::new(),
        }
    }
}

impl WebDatasetOptions {
    /// Checks the values against each other and the global batch and world size; field
    /// names are those under `data.webdataset`.
    pub fn validate(&self, global_batch: usize, world_size: usize) -> DataResult<()> {
        let bad = |field, reason: String| Err(DataError::Config { field, reason });
        if self.train.is_empty() {
            return bad("webdataset.train", "lists no shards".into());
        }
        if self.epoch_samples == 0 {
            return bad("webdataset.epoch_samples", "is required: the samples of one epoch (at least one global batch)".into());
        }
        if self.streams == 0 {
            return bad("webdataset.streams", "must be at least 1".into());
        }
        if !self.streams.is_multiple_of(world_size) {
            return bad(
                "webdataset.streams",
                format!("webdataset.streams = {} is not a multiple of the world size {world_size}", self.streams),
            );
        }
        if !global_batch.is_multiple_of(self.streams) {
            return bad(
                "webdataset.streams",
                format!("train.global_batch = {global_batch} is not divisible by webdataset.streams = {}", self.streams),
            );
        }
        if let Some(f) = self.max_skipped {
            if !(f > 0.0 && f < 1.0) {
                return bad(
                    "webdataset.max_skipped",
                    format!("webdataset.max_skipped = {f} is not a fraction in (0, 1) (leave it out for no limit)"),
                );
            }
        }
        if self.epoch_samples < global_batch {
            return bad(
                "webdataset.epoch_samples",
                format!("webdataset.epoch_samples = {} is smaller than train.global_batch = {global_batch}", self.epoch_samples),
            );
        }
        Ok(())
    }

    /// The training shards, patterns expanded, relative paths taken from `dir`.
    pub fn train_shards(&self, dir: &Path) -> DataResult<Vec<PathBuf>> {
        shard_paths(&self.train, dir)
    }

    /// The evaluation shards, as [`WebDatasetOptions::train_shards`].
    pub fn test_shards(&self, dir: &Path) -> DataResult<Vec<PathBuf>> {
        shard_paths(&self.test, dir)
    }
}

/// The shard paths of `patterns`, relative ones joined to `dir`: each entry may join several
/// with `::` (as OpenCLIP's `--train-data` does, `a-{0..9}.tar::b-{0..4}.tar`), and each of
/// those is a brace pattern ([`expand`]).
pub fn shard_paths(patterns: &[String], dir: &Path) -> DataResult<Vec<PathBuf>> {
    let mut out = Vec::new();
    for p in patterns {
        for part in p.split("::") {
            if part.trim().is_empty() {
                return Err(DataError::Config {
                    field: "webdataset shards",
                    reason: format!("`{p}`: an empty entry between `::` separators"),
                });
            }
            out.extend(expand(part.trim())?.into_iter().map(|name| dir.join(name)));
        }
    }
    Ok(out)
}
