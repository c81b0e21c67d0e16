//! The IDX format of MNIST and Fashion-MNIST: an images file (magic 0x00000803, dimensions
//! count x rows x cols, unsigned bytes) and a labels file (magic 0x00000801, dimension count,
//! unsigned bytes; or magic 0x00000C01, big-endian 32-bit integers, for more than 256 classes
//! such as the glyph identities of `data/glyphs`), big-endian, each plain or gzipped
//! (detected from the content, not the name).

use std::path::{Path, PathBuf};

use crate::dataset::{Dataset, Split};
use crate::error::{DataError, DataResult};
use crate::image::Image;
use crate::read::Source;

const IMAGES_MAGIC: u32 = 0x0000_0803;
const LABELS_MAGIC: u32 = 0x0000_0801;
const LABELS_I32_MAGIC: u32 = 0x0000_0C01;

/// An MNIST-style dataset held in memory: 8-bit grayscale images with their labels.
#[derive(Clone, Debug)]
pub struct IdxDataset {
    rows: usize,
    cols: usize,
    pixels: Vec<u8>,
    labels: Vec<u32>,
    num_classes: usize,
}

impl IdxDataset {
    /// Reads an images file and a labels file. Checks both magic numbers, that each file
    /// holds exactly the bytes its header announces (neither truncated nor longer), that the
    /// two counts match and that there is at least one image.
    ///
    /// `num_classes()` is the largest label plus one.
    pub fn open(images: impl AsRef<Path>, labels: impl AsRef<Path>) -> DataResult<Self> {
        let (images, labels) = (images.as_ref(), labels.as_ref());
        let (dims, pixels) = read_idx(images, IMAGES_MAGIC, "unsigned bytes, 3 dimensions: count, rows, cols")?;
        if dims[1] == 0 || dims[2] == 0 {
            return Err(DataError::IdxDims { path: images.into(), dims, reason: "rows and cols must be positive" });
        }
        let (ldims, labels_data) = read_labels(labels)?;
        let (n_images, n_labels) = (dims[0] as usize, ldims[0] as usize);
        if n_images != n_labels {
            return Err(DataError::CountMismatch { images: images.into(), n_images, labels: labels.into(), n_labels });
        }
        if n_images == 0 {
            return Err(DataError::Empty { path: images.into() });
        }
        let num_classes = labels_data.iter().copied().max().map_or(0, |m| m as usize + 1);
        Ok(IdxDataset { rows: dims[1] as usize, cols: dims[2] as usize, pixels, labels: labels_data, num_classes })
    }

    /// Opens a split from a folder with the standard MNIST file names:
    /// `train-images-idx3-ubyte` / `train-labels-idx1-ubyte` (train) or `t10k-...` (test),
    /// each with or without `.gz` (the gzipped name is tried first).
    pub fn open_dir(dir: impl AsRef<Path>, split: Split) -> DataResult<Self> {
        let prefix = match split {
            Split::Train => "train",
            Split::Test => "t10k",
        };
        let dir = dir.as_ref();
        let find = |stem: String| -> PathBuf {
            let gz = dir.join(format!("{stem}.gz"));
            if gz.exists() {
                gz
            } else if dir.join(&stem).exists() {
                dir.join(stem)
            } else {
                gz // reported as not found
            }
        };
        Self::open(find(format!("{prefix}-images-idx3-ubyte")), find(format!("{prefix}-labels-idx1-ubyte")))
    }

    /// Image height in pixels.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Image width in pixels.
    pub fn cols(&self) -> usize {
        self.cols
    }

    fn check(&self, index: usize) -> DataResult<()> {
        if index < self.labels.len() {
            Ok(())
        } else {
            Err(DataError::IndexOutOfRange { index, len: self.labels.len() })
        }
    }
}

impl Dataset for IdxDataset {
    fn len(&self) -> usize {
        self.labels.len()
    }

    fn get(&self, index: usize) -> DataResult<Image> {
        self.check(index)?;
        let n = self.rows * self.cols;
        Ok(Image { width: self.cols, height: self.rows, channels: 1, pixels: self.pixels[index * n..(index + 1) * n].to_vec() })
    }

    fn label(&self, index: usize) -> DataResult<usize> {
        self.check(index)?;
        Ok(self.labels[index] as usize)
    }

    fn num_classes(&self) -> usize {
        self.num_classes
    }
}

/// Reads one IDX file of unsigned bytes with the given magic; returns its dimensions and data.
fn read_idx(path: &Path, magic: u32, what: &'static str) -> DataResult<(Vec<u32>, Vec<u8>)> {
    read_idx_of(path, &[magic], what).map(|(dims, _, data)| (dims, data))
}

/// Reads a labels file of unsigned bytes or of 32-bit integers (negative labels are refused).
fn read_labels(path: &Path) -> DataResult<(Vec<u32>, Vec<u32>)> {
    let what = "1 dimension: count; unsigned bytes (0x0801) or 32-bit integers (0x0C01)";
    let (dims, magic, data) = read_idx_of(path, &[LABELS_MAGIC, LABELS_I32_MAGIC], what)?;
    if magic == LABELS_MAGIC {
        return Ok((dims, data.into_iter().map(u32::from).collect()));
    }
    let labels: Vec<i32> = data.chunks_exact(4).map(|b| i32::from_be_bytes([b[0], b[1], b[2], b[3]])).collect();
    if labels.iter().any(|l| *l < 0) {
        return Err(DataError::IdxDims { path: path.into(), dims, reason: "labels must not be negative" });
    }
    Ok((dims, labels.into_iter().map(|l| l as u32).collect()))
}

/// Reads one IDX file whose magic is one of `magics` (the element size from its type byte:
/// 0x08 unsigned byte, 0x0C 32-bit integer); returns its dimensions, magic and raw data.
fn read_idx_of(path: &Path, magics: &[u32], what: &'static str) -> DataResult<(Vec<u32>, u32, Vec<u8>)> {
    let ndims = (magics[0] & 0xff) as usize;
    let header_len = 4 + 4 * ndims;
    let mut src = Source::open(path)?;
    let header = src.read_up_to(header_len as u64)?;
    if header.len() < 4 {
        return Err(DataError::Truncated { path: path.into(), expected: header_len as u64, found: header.len() as u64 });
    }
    let found = u32::from_be_bytes([header[0], header[1], header[2], header[3]]);
    if !magics.contains(&found) {
        return Err(DataError::IdxMagic { path: path.into(), found, expected: magics[0], what });
    }
    let elem = if (found >> 8) & 0xff == 0x0C { 4u64 } else { 1u64 };
    if header.len() < header_len {
        return Err(DataError::Truncated { path: path.into(), expected: header_len as u64, found: header.len() as u64 });
    }
    let dims: Vec<u32> = header[4..].chunks_exact(4).map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]])).collect();
    let payload = dims.iter().try_fold(elem, |acc, &d| acc.checked_mul(d as u64));
    let payload = match payload {
        Some(p) if usize::try_from(p).is_ok() => p,
        _ => return Err(DataError::IdxDims { path: path.into(), dims, reason: "their product overflows" }),
    };
    // One byte more than announced, to detect trailing data (and to drive a gzip stream to
    // its end, where its checksum is verified).
    let data = src.read_up_to(payload + 1)?;
    let total = |n: u64| header_len as u64 + n;
    if (data.len() as u64) < payload {
        return Err(DataError::Truncated { path: src.path().into(), expected: total(payload), found: total(data.len() as u64) });
    }
    if data.len() as u64 > payload {
        return Err(DataError::TrailingData {
            path: src.path().into(),
            expected: total(payload),
            found: total(data.len() as u64),
        });
    }
    Ok((dims, found, data))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn idx_bytes(magic: u32, dims: &[u32], data: &[u8]) -> Vec<u8> {
        let mut v = magic.to_be_bytes().to_vec();
        for d in dims {
            v.extend_from_slice(&d.to_be_bytes());
        }
        v.extend_from_slice(data);
        v
    }

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        e.write_all(bytes).unwrap();
        e.finish().unwrap()
    }

    /// Three 2x3 images (pixel values = image*10 + position) and labels 2, 0, 1.
    fn sample(dir: &Path, gz: bool) -> (PathBuf, PathBuf) {
        let pixels: Vec<u8> = (0..3).flat_map(|i| (0..6).map(move |p| i * 10 + p)).collect();
        let img = idx_bytes(IMAGES_MAGIC, &[3, 2, 3], &pixels);
        let lab = idx_bytes(LABELS_MAGIC, &[3], &[2, 0, 1]);
        let (ip, lp) = if gz {
            (dir.join("train-images-idx3-ubyte.gz"), dir.join("train-labels-idx1-ubyte.gz"))
        } else {
            (dir.join("train-images-idx3-ubyte"), dir.join("train-labels-idx1-ubyte"))
        };
        std::fs::write(&ip, if gz { gzip(&img) } else { img }).unwrap();
        std::fs::write(&lp, if gz { gzip(&lab) } else { lab }).unwrap();
        (ip, lp)
    }

    #[test]
    fn reads_32_bit_labels_above_255_and_refuses_negative_ones() {
        let dir = tempfile::tempdir().unwrap();
        let (ip, lp) = (dir.path().join("i"), dir.path().join("l"));
        std::fs::write(&ip, gzip(&idx_bytes(IMAGES_MAGIC, &[2, 1, 1], &[7, 9]))).unwrap();
        let labels = |a: i32, b: i32| [a.to_be_bytes(), b.to_be_bytes()].concat();
        std::fs::write(&lp, gzip(&idx_bytes(LABELS_I32_MAGIC, &[2], &labels(2999, 4)))).unwrap();
        let ds = IdxDataset::open(&ip, &lp).unwrap();
        assert_eq!((ds.label(0).unwrap(), ds.label(1).unwrap(), ds.num_classes()), (2999, 4, 3000));
        std::fs::write(&lp, idx_bytes(LABELS_I32_MAGIC, &[2], &labels(1, -3))).unwrap();
        assert!(matches!(IdxDataset::open(&ip, &lp), Err(DataError::IdxDims { .. })));
        // Three bytes short of two 32-bit labels: truncated.
        std::fs::write(&lp, idx_bytes(LABELS_I32_MAGIC, &[2], &[0, 0, 0, 1, 0])).unwrap();
        assert!(matches!(IdxDataset::open(&ip, &lp), Err(DataError::Truncated { .. })));
    }

    #[test]
    fn reads_raw_and_gzip_alike() {
        for gz in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            sample(dir.path(), gz);
            let ds = IdxDataset::open_dir(dir.path(), Split::Train).unwrap();
            assert_eq!((ds.len(), ds.rows(), ds.cols(), ds.num_classes()), (3, 2, 3, 3));
            let img = ds.get(1).unwrap();
            assert_eq!((img.width, img.height, img.channels), (3, 2, 1));
            assert_eq!(img.pixels, vec![10, 11, 12, 13, 14, 15]);
            assert_eq!(img.at(2, 1, 0), 15);
            assert_eq!(ds.label(0).unwrap(), 2);
            assert!(matches!(ds.get(3), Err(DataError::IndexOutOfRange { index: 3, len: 3 })));
            assert!(matches!(ds.label(9), Err(DataError::IndexOutOfRange { .. })));
        }
    }

    #[test]
    fn swapped_files_are_a_magic_error() {
        let dir = tempfile::tempdir().unwrap();
        let (ip, lp) = sample(dir.path(), false);
        let err = IdxDataset::open(&lp, &ip).unwrap_err();
        assert!(matches!(err, DataError::IdxMagic { found: 0x801, expected: 0x803, .. }), "{err}");
        assert!(err.to_string().contains("train-labels-idx1-ubyte"), "{err}");
    }

    #[test]
    fn truncated_and_overlong_files_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let (ip, lp) = sample(dir.path(), false);
        let full = std::fs::read(&ip).unwrap();
        // Cut inside the pixels, inside the header, and one byte too many.
        std::fs::write(&ip, &full[..full.len() - 1]).unwrap();
        let err = IdxDataset::open(&ip, &lp).unwrap_err();
        assert!(matches!(err, DataError::Truncated { expected: 34, found: 33, .. }), "{err}");
        assert!(err.to_string().contains("train-images-idx3-ubyte"), "{err}");
        std::fs::write(&ip, &full[..10]).unwrap();
        assert!(matches!(IdxDataset::open(&ip, &lp), Err(DataError::Truncated { expected: 16, found: 10, .. })));
        std::fs::write(&ip, &full[..2]).unwrap();
        assert!(matches!(IdxDataset::open(&ip, &lp), Err(DataError::Truncated { .. })));
        std::fs::write(&ip, []).unwrap();
        assert!(matches!(IdxDataset::open(&ip, &lp), Err(DataError::Truncated { found: 0, .. })));
        let mut long = full.clone();
        long.push(0);
        std::fs::write(&ip, &long).unwrap();
        assert!(matches!(IdxDataset::open(&ip, &lp), Err(DataError::TrailingData { .. })));
    }

    #[test]
    fn corrupt_and_truncated_gzip_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let (ip, lp) = sample(dir.path(), true);
        let full = std::fs::read(&ip).unwrap();
        std::fs::write(&ip, &full[..full.len() / 2]).unwrap();
        let err = IdxDataset::open(&ip, &lp).unwrap_err();
        assert!(matches!(err, DataError::Gzip { .. } | DataError::Truncated { .. }), "{err}");
        assert!(err.to_string().contains("train-images-idx3-ubyte.gz"), "{err}");
        let mut bad = full.clone();
        for b in bad[12..].iter_mut() {
            *b ^= 0x5a;
        }
        std::fs::write(&ip, &bad).unwrap();
        let err = IdxDataset::open(&ip, &lp).unwrap_err();
        assert!(matches!(err, DataError::Gzip { .. } | DataError::Truncated { .. }), "{err}");
        // A wrong CRC in the trailer only: all data decodes, the checksum does not match.
        let mut crc = full.clone();
        let n = crc.len();
        crc[n - 8] ^= 1;
        std::fs::write(&ip, &crc).unwrap();
        assert!(matches!(IdxDataset::open(&ip, &lp), Err(DataError::Gzip { .. })));
    }

    #[test]
    fn count_mismatch_and_bad_dims_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let (ip, lp) = sample(dir.path(), false);
        std::fs::write(&lp, idx_bytes(LABELS_MAGIC, &[2], &[0, 1])).unwrap();
        let err = IdxDataset::open(&ip, &lp).unwrap_err();
        assert!(matches!(err, DataError::CountMismatch { n_images: 3, n_labels: 2, .. }), "{err}");
        // A header claiming a huge size over a few bytes: truncated, no huge allocation.
        std::fs::write(&ip, idx_bytes(IMAGES_MAGIC, &[u32::MAX, 60000, 60000], &[1, 2, 3])).unwrap();
        assert!(matches!(IdxDataset::open(&ip, &lp), Err(DataError::Truncated { .. } | DataError::IdxDims { .. })));
        std::fs::write(&ip, idx_bytes(IMAGES_MAGIC, &[3, 0, 3], &[])).unwrap();
        assert!(matches!(IdxDataset::open(&ip, &lp), Err(DataError::IdxDims { .. })));
        std::fs::write(&ip, idx_bytes(IMAGES_MAGIC, &[0, 2, 3], &[])).unwrap();
        std::fs::write(&lp, idx_bytes(LABELS_MAGIC, &[0], &[])).unwrap();
        assert!(matches!(IdxDataset::open(&ip, &lp), Err(DataError::Empty { .. })));
    }

    #[test]
    fn every_prefix_is_an_error_not_a_panic() {
        for gz in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let (ip, lp) = sample(dir.path(), gz);
            for path in [&ip, &lp] {
                let full = std::fs::read(path).unwrap();
                for n in 0..full.len() {
                    std::fs::write(path, &full[..n]).unwrap();
                    assert!(IdxDataset::open(&ip, &lp).is_err(), "prefix {n} of {}", path.display());
                }
                std::fs::write(path, &full).unwrap();
            }
            assert!(IdxDataset::open(&ip, &lp).is_ok());
        }
    }

    #[test]
    fn missing_files_name_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let err = IdxDataset::open_dir(dir.path(), Split::Test).unwrap_err();
        assert!(matches!(err, DataError::Io { .. }));
        assert!(err.to_string().contains("t10k-images-idx3-ubyte.gz"), "{err}");
    }
}
