//! [`TarDataset`]: shards indexed once for random access (evaluation sets, the kNN bank).

use std::path::{Path, PathBuf};

use super::shard::{Sample, ShardReader};
use crate::dataset::Dataset;
use crate::decode::ColorMode;
use crate::error::{DataError, DataResult};
use crate::image::{Decoded, Image};

/// The samples of some shards, in shard order, each read again (one seek) and decoded when
/// asked for. Opening reads every shard once to find the samples, their offsets and their
/// classes; every sample needs an image member and a `cls`.
#[derive(Clone, Debug)]
pub struct TarDataset {
    shards: Vec<PathBuf>,
    /// (shard, offset of the sample's first header, class).
    items: Vec<(usize, u64, usize)>,
    num_classes: usize,
    color: ColorMode,
}

impl TarDataset {
    /// Indexes `shards` (in order), stopping after `limit` samples when `limit` > 0. Errors:
    /// a shard missing or malformed, a sample without an image or a valid `cls`, no sample
    /// at all.
    pub fn open(shards: &[PathBuf], color: ColorMode, limit: usize) -> DataResult<Self> {
        let mut items = Vec::new();
        'shards: for (s, path) in shards.iter().enumerate() {
            let mut reader = ShardReader::open(path)?;
            while let Some(sample) = reader.next_sample()? {
                let class = class_of(path, &sample)?;
                items.push((s, sample.offset, class));
                if limit > 0 && items.len() == limit {
                    break 'shards;
                }
            }
        }
        if items.is_empty() {
            return Err(DataError::Empty { path: shards.first().cloned().unwrap_or_default() });
        }
        let num_classes = items.iter().map(|i| i.2).max().unwrap_or(0) + 1;
        Ok(TarDataset { shards: shards.to_vec(), items, num_classes, color })
    }

    /// The shard and byte offset of sample `index`.
    pub fn location(&self, index: usize) -> Option<(&Path, u64)> {
        self.items.get(index).map(|&(s, off, _)| (self.shards[s].as_path(), off))
    }

    fn item(&self, index: usize) -> DataResult<(usize, u64, usize)> {
        self.items.get(index).copied().ok_or(DataError::IndexOutOfRange { index, len: self.items.len() })
    }
}

/// The class of an evaluation sample (its `cls`, required), checking that it has an image.
fn class_of(path: &Path, sample: &Sample) -> DataResult<usize> {
    let corrupt =
        |reason: String| DataError::CorruptSample { shard: path.into(), key: sample.key.clone(), offset: sample.offset, reason };
    if sample.image().is_none() {
        return Err(corrupt(format!("no jpg, jpeg, png or webp member (members: {})", member_names(sample))));
    }
    match sample.class() {
        None => Err(corrupt("no cls member (evaluation samples need their class)".into())),
        Some(Err(text)) => Err(corrupt(format!("cls `{text}` is not a class id"))),
        Some(Ok(c)) => Ok(c),
    }
}

pub(super) fn member_names(sample: &Sample) -> String {
    sample.members.iter().map(|(e, _)| e.as_str()).collect::<Vec<_>>().join(", ")
}

/// Decodes a sample's image; errors name the shard, key and offset.
pub(super) fn decode_sample(path: &Path, sample: &Sample, color: ColorMode) -> DataResult<Image> {
    let corrupt =
        |reason: String| DataError::CorruptSample { shard: path.into(), key: sample.key.clone(), offset: sample.offset, reason };
    let (ext, bytes) =
        sample.image().ok_or_else(|| corrupt(format!("no jpg, jpeg, png or webp member (members: {})", member_names(sample))))?;
    let name = PathBuf::from(format!("{}:{}.{ext}", path.display(), sample.key));
    crate::decode::decode_image(bytes, color, &name).map_err(|e| corrupt(e.to_string()))
}

/// [`decode_sample`] at 1/`s` of the image's size, `s` from `shrink` ([`crate::decode_image_shrunk`]).
pub(super) fn decode_sample_shrunk(
    path: &Path,
    sample: &Sample,
    color: ColorMode,
    shrink: &dyn Fn(usize, usize) -> usize,
) -> DataResult<Decoded> {
    let corrupt =
        |reason: String| DataError::CorruptSample { shard: path.into(), key: sample.key.clone(), offset: sample.offset, reason };
    let (ext, bytes) =
        sample.image().ok_or_else(|| corrupt(format!("no jpg, jpeg, png or webp member (members: {})", member_names(sample))))?;
    let name = PathBuf::from(format!("{}:{}.{ext}", path.display(), sample.key));
    crate::decode::decode_image_shrunk(bytes, color, &name, shrink).map_err(|e| corrupt(e.to_string()))
}

impl Dataset for TarDataset {
    fn len(&self) -> usize {
        self.items.len()
    }

    fn get(&self, index: usize) -> DataResult<Image> {
        let (s, offset, _) = self.item(index)?;
        let path = &self.shards[s];
        let sample = ShardReader::open_at(path, offset)?.next_sample()?.ok_or_else(|| DataError::Shard {
            shard: path.clone(),
            offset,
            reason: "no sample where the index has one (the shard changed since it was opened)".into(),
        })?;
        decode_sample(path, &sample, self.color)
    }

    fn label(&self, index: usize) -> DataResult<usize> {
        Ok(self.item(index)?.2)
    }

    fn num_classes(&self) -> usize {
        self.num_classes
    }
}
