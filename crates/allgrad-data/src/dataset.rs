//! The [`Dataset`] trait shared by every reader, [`Split`], and the [`InMemory`] dataset.

use crate::error::{DataError, DataResult};
use crate::image::{Decoded, Image};

/// A labelled image dataset indexed by global sample index `0..len()`.
///
/// `Send + Sync` so that one dataset can be shared by the loader's worker threads.
pub trait Dataset: Send + Sync {
    /// Number of samples.
    fn len(&self) -> usize;

    /// True when there are no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sample `index` as an 8-bit HWC image. Fails for an index out of range, and for
    /// readers that decode lazily, for a file that turned out unreadable.
    fn get(&self, index: usize) -> DataResult<Image>;

    /// Sample `index` decoded at 1/`s` of its size, `s` what `shrink(width, height)` answers
    /// for its full size, where the reader can decode smaller (JPEG files); otherwise, and by
    /// default, [`Dataset::get`] at full size.
    fn get_shrunk(&self, index: usize, shrink: &dyn Fn(usize, usize) -> usize) -> DataResult<Decoded> {
        let _ = shrink;
        Ok(Decoded::whole(self.get(index)?))
    }

    /// The class id of sample `index`, in `0..num_classes()`. Fails for an index out of range.
    fn label(&self, index: usize) -> DataResult<usize>;

    /// Number of classes.
    fn num_classes(&self) -> usize;

    /// The text of sample `index` (a caption), for a data set of image-text pairs. Default:
    /// none.
    fn text(&self, _index: usize) -> DataResult<Option<String>> {
        Ok(None)
    }
}

/// Which part of a dataset with a standard train/test split to open.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Split {
    /// The training set.
    Train,
    /// The test set.
    Test,
}

/// A dataset of images already in memory (for tests, examples and generated data).
#[derive(Clone, Debug)]
pub struct InMemory {
    images: Vec<Image>,
    labels: Vec<usize>,
    num_classes: usize,
}

impl InMemory {
    /// Images with their labels; fails unless there is one label per image, each below
    /// `num_classes`.
    pub fn new(images: Vec<Image>, labels: Vec<usize>, num_classes: usize) -> DataResult<Self> {
        if images.len() != labels.len() {
            return Err(DataError::CountMismatch {
                images: "<memory>".into(),
                n_images: images.len(),
                labels: "<memory>".into(),
                n_labels: labels.len(),
            });
        }
        if let Some((index, &label)) = labels.iter().enumerate().find(|(_, l)| **l >= num_classes) {
            return Err(DataError::LabelOutOfRange { path: "<memory>".into(), index, label, num_classes });
        }
        Ok(InMemory { images, labels, num_classes })
    }
}

impl Dataset for InMemory {
    fn len(&self) -> usize {
        self.images.len()
    }

    fn get(&self, index: usize) -> DataResult<Image> {
        self.images.get(index).cloned().ok_or(DataError::IndexOutOfRange { index, len: self.images.len() })
    }

    fn label(&self, index: usize) -> DataResult<usize> {
        self.labels.get(index).copied().ok_or(DataError::IndexOutOfRange { index, len: self.labels.len() })
    }

    fn num_classes(&self) -> usize {
        self.num_classes
    }
}
