//! CIFAR-10 binary batches (`data_batch_1.bin` .. `data_batch_5.bin`, `test_batch.bin`):
//! records of 1 label byte (0..10) and 3072 pixel bytes, the 1024 red values of the 32x32
//! image row by row, then the green, then the blue. Files may also be gzipped.

use std::path::{Path, PathBuf};

use crate::dataset::{Dataset, Split};
use crate::error::{DataError, DataResult};
use crate::image::Image;
use crate::read::Source;

/// Side of a CIFAR image.
pub const CIFAR_SIDE: usize = 32;
/// Bytes of one record: the label and 3 x 32 x 32 pixels.
pub const CIFAR_RECORD: usize = 1 + 3 * CIFAR_SIDE * CIFAR_SIDE;
/// Number of CIFAR-10 classes.
pub const CIFAR10_CLASSES: usize = 10;

/// CIFAR-10 in memory: 32x32 RGB images (stored HWC) and their labels.
#[derive(Clone, Debug)]
pub struct Cifar10 {
    pixels: Vec<u8>,
    labels: Vec<u8>,
}

impl Cifar10 {
    /// Reads the given batch files, in order (sample indices follow that order). Each file
    /// must be a non-empty whole number of records with labels below 10.
    pub fn open<P: AsRef<Path>>(files: &[P]) -> DataResult<Self> {
        let (mut pixels, mut labels) = (Vec::new(), Vec::new());
        if files.is_empty() {
            return Err(DataError::Empty { path: PathBuf::new() });
        }
        for path in files {
            let path = path.as_ref();
            let data = Source::open(path)?.read_all()?;
            if data.is_empty() {
                return Err(DataError::Empty { path: path.into() });
            }
            if data.len() % CIFAR_RECORD != 0 {
                return Err(DataError::CifarRecords { path: path.into(), len: data.len() as u64, record: CIFAR_RECORD });
            }
            let plane = CIFAR_SIDE * CIFAR_SIDE;
            pixels.reserve(data.len() / CIFAR_RECORD * 3 * plane);
            for (index, rec) in data.chunks_exact(CIFAR_RECORD).enumerate() {
                let label = rec[0] as usize;
                if label >= CIFAR10_CLASSES {
                    return Err(DataError::LabelOutOfRange { path: path.into(), index, label, num_classes: CIFAR10_CLASSES });
                }
                labels.push(rec[0]);
                let (r, g, b) = (&rec[1..1 + plane], &rec[1 + plane..1 + 2 * plane], &rec[1 + 2 * plane..]);
                for p in 0..plane {
                    pixels.extend_from_slice(&[r[p], g[p], b[p]]);
                }
            }
        }
        Ok(Cifar10 { pixels, labels })
    }

    /// Opens a split from the folder `cifar-10-batches-bin`: `data_batch_1.bin` ..
    /// `data_batch_5.bin` for [`Split::Train`] (50,000 images), `test_batch.bin` for
    /// [`Split::Test`] (10,000).
    pub fn open_dir(dir: impl AsRef<Path>, split: Split) -> DataResult<Self> {
        let dir = dir.as_ref();
        let files: Vec<PathBuf> = match split {
            Split::Train => (1..=5).map(|i| dir.join(format!("data_batch_{i}.bin"))).collect(),
            Split::Test => vec![dir.join("test_batch.bin")],
        };
        Self::open(&files)
    }
}

impl Dataset for Cifar10 {
    fn len(&self) -> usize {
        self.labels.len()
    }

    fn get(&self, index: usize) -> DataResult<Image> {
        self.label(index)?; // bounds check
        let n = 3 * CIFAR_SIDE * CIFAR_SIDE;
        Ok(Image { width: CIFAR_SIDE, height: CIFAR_SIDE, channels: 3, pixels: self.pixels[index * n..(index + 1) * n].to_vec() })
    }

    fn label(&self, index: usize) -> DataResult<usize> {
        self.labels.get(index).map(|l| *l as usize).ok_or(DataError::IndexOutOfRange { index, len: self.labels.len() })
    }

    fn num_classes(&self) -> usize {
        CIFAR10_CLASSES
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record whose pixel (x, y) is (r, g, b) = (x, y, label).
    fn record(label: u8) -> Vec<u8> {
        let mut v = vec![label];
        for c in 0..3 {
            for y in 0..CIFAR_SIDE {
                for x in 0..CIFAR_SIDE {
                    v.push([x as u8, y as u8, label][c]);
                }
            }
        }
        v
    }

    #[test]
    fn reads_records_across_files_as_hwc() {
        let dir = tempfile::tempdir().unwrap();
        for i in 1..=5u8 {
            let bytes: Vec<u8> = [record(i), record(9 - i)].concat();
            std::fs::write(dir.path().join(format!("data_batch_{i}.bin")), bytes).unwrap();
        }
        let ds = Cifar10::open_dir(dir.path(), Split::Train).unwrap();
        assert_eq!((ds.len(), ds.num_classes()), (10, 10));
        assert_eq!(ds.label(2).unwrap(), 2);
        assert_eq!(ds.label(3).unwrap(), 7);
        let img = ds.get(3).unwrap();
        assert_eq!((img.width, img.height, img.channels), (32, 32, 3));
        assert_eq!([img.at(5, 17, 0), img.at(5, 17, 1), img.at(5, 17, 2)], [5, 17, 7]);
        assert!(matches!(ds.get(10), Err(DataError::IndexOutOfRange { .. })));
    }

    #[test]
    fn truncated_bad_label_and_missing_files_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("test_batch.bin");
        let mut two = [record(1), record(2)].concat();
        two.pop();
        std::fs::write(&p, &two).unwrap();
        let err = Cifar10::open_dir(dir.path(), Split::Test).unwrap_err();
        assert!(matches!(err, DataError::CifarRecords { len: 6145, .. }), "{err}");
        assert!(err.to_string().contains("test_batch.bin"), "{err}");
        std::fs::write(&p, [record(1), record(10)].concat()).unwrap();
        let err = Cifar10::open_dir(dir.path(), Split::Test).unwrap_err();
        assert!(matches!(err, DataError::LabelOutOfRange { index: 1, label: 10, .. }), "{err}");
        std::fs::write(&p, []).unwrap();
        assert!(matches!(Cifar10::open_dir(dir.path(), Split::Test), Err(DataError::Empty { .. })));
        let err = Cifar10::open_dir(dir.path(), Split::Train).unwrap_err();
        assert!(matches!(err, DataError::Io { .. }) && err.to_string().contains("data_batch_1.bin"), "{err}");
    }
}
