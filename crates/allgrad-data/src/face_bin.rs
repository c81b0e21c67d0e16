//! The verification `.bin` files of face recognition benchmarks (`lfw.bin`, `cfp_fp.bin`,
//! `agedb_30.bin`, `calfw.bin`, `cplfw.bin` as insightface distributes them): a Python pickle of
//! the tuple `(bins, issame_list)`, `bins` a list of encoded images (JPEG or PNG bytes; Python 2
//! strings in the older files), two per pair, and `issame_list` a list of booleans, one per
//! pair. Pair `i` is images `2i` and `2i + 1`.
//!
//! The pickle is read by serde-pickle (any protocol, 0 to 5); anything else (another
//! structure, an odd number of images, an `issame_list` whose length is not half of it) is a
//! [`DataError::VerificationBin`] naming the file.

use std::path::{Path, PathBuf};

use serde_pickle::{DeOptions, Value};

use crate::decode::{decode_image, ColorMode};
use crate::error::{DataError, DataResult};
use crate::image::Image;

/// A verification set read from a `.bin` file: its encoded images and which pairs match.
#[derive(Clone, Debug)]
pub struct VerificationBin {
    path: PathBuf,
    images: Vec<Vec<u8>>,
    issame: Vec<bool>,
}

impl VerificationBin {
    /// Reads and checks `path` (the images are decoded by [`VerificationBin::image`]).
    pub fn open(path: impl AsRef<Path>) -> DataResult<Self> {
        let path = path.as_ref().to_path_buf();
        let file = std::fs::File::open(&path).map_err(|e| DataError::io(&path, e))?;
        let bad = |reason: String| DataError::VerificationBin { path: path.clone(), reason };
        let value = serde_pickle::value_from_reader(std::io::BufReader::new(file), DeOptions::new())
            .map_err(|e| bad(format!("cannot read it as a pickle: {e}")))?;
        let (bins, issame) = match value {
            Value::Tuple(v) | Value::List(v) if v.len() == 2 => {
                let mut it = v.into_iter();
                (it.next().expect("2 items"), it.next().expect("2 items"))
            }
            other => return Err(bad(format!("the pickle holds {}, not a pair (bins, issame_list)", describe(&other)))),
        };
        let Value::List(bins) = bins else {
            return Err(bad(format!("`bins` is {}, not a list of image bytes", describe(&bins))));
        };
        let images = bins
            .into_iter()
            .enumerate()
            .map(|(i, b)| match b {
                Value::Bytes(b) => Ok(b),
                other => Err(bad(format!("image {i} is {}, not bytes", describe(&other)))),
            })
            .collect::<DataResult<Vec<_>>>()?;
        let Value::List(flags) = issame else {
            return Err(bad(format!("`issame_list` is {}, not a list of booleans", describe(&issame))));
        };
        let issame = flags
            .into_iter()
            .enumerate()
            .map(|(i, f)| match f {
                Value::Bool(b) => Ok(b),
                Value::I64(0) => Ok(false),
                Value::I64(1) => Ok(true),
                other => Err(bad(format!("issame_list[{i}] is {}, not a boolean", describe(&other)))),
            })
            .collect::<DataResult<Vec<_>>>()?;
        if images.len() % 2 != 0 {
            return Err(bad(format!("{} images is an odd number (two per pair)", images.len())));
        }
        if issame.len() * 2 != images.len() {
            return Err(bad(format!(
                "issame_list has {} entries for {} images ({} pairs)",
                issame.len(),
                images.len(),
                images.len() / 2
            )));
        }
        if issame.is_empty() {
            return Err(bad("no pairs".into()));
        }
        Ok(VerificationBin { path, images, issame })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Number of images (twice the pairs).
    pub fn num_images(&self) -> usize {
        self.images.len()
    }

    /// Whether each pair shows the same identity.
    pub fn issame(&self) -> &[bool] {
        &self.issame
    }

    /// Image `i`, decoded (errors name the file and the image).
    pub fn image(&self, i: usize, color: ColorMode) -> DataResult<Image> {
        let bytes = self.images.get(i).ok_or(DataError::IndexOutOfRange { index: i, len: self.images.len() })?;
        decode_image(bytes, color, &PathBuf::from(format!("{}:image {i}", self.path.display())))
    }
}

fn describe(v: &Value) -> String {
    match v {
        Value::None => "None".into(),
        Value::Bool(_) => "a boolean".into(),
        Value::I64(_) | Value::Int(_) => "an integer".into(),
        Value::F64(_) => "a float".into(),
        Value::Bytes(_) => "bytes".into(),
        Value::String(_) => "a string".into(),
        Value::List(l) => format!("a list of {}", l.len()),
        Value::Tuple(t) => format!("a tuple of {}", t.len()),
        Value::Set(_) | Value::FrozenSet(_) => "a set".into(),
        Value::Dict(_) => "a dict".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, value: &Value) -> PathBuf {
        let p = dir.join("x.bin");
        std::fs::write(&p, serde_pickle::value_to_vec(value, serde_pickle::SerOptions::new()).unwrap()).unwrap();
        p
    }

    fn png() -> Vec<u8> {
        let img = image::GrayImage::from_fn(2, 2, |x, y| image::Luma([(x * 100 + y * 10) as u8]));
        let mut out = std::io::Cursor::new(Vec::new());
        img.write_to(&mut out, image::ImageOutputFormat::Png).unwrap();
        out.into_inner()
    }

    #[test]
    fn pairs_read_and_bad_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let bins = |n: usize| Value::List((0..n).map(|_| Value::Bytes(png())).collect());
        let flags = |n: usize| Value::List((0..n).map(|i| Value::Bool(i % 2 == 0)).collect());
        let p = write(dir.path(), &Value::Tuple(vec![bins(4), flags(2)]));
        let b = VerificationBin::open(&p).unwrap();
        assert_eq!((b.num_images(), b.issame()), (4, &[true, false][..]));
        assert_eq!(b.image(3, ColorMode::Gray).unwrap().pixels, vec![0, 100, 10, 110]);
        for (value, want) in [
            (Value::Tuple(vec![bins(3), flags(1)]), "odd number"),
            (Value::Tuple(vec![bins(4), flags(3)]), "issame_list has 3 entries for 4 images"),
            (Value::Tuple(vec![bins(4), flags(2), flags(2)]), "not a pair"),
            (Value::Tuple(vec![Value::List(vec![Value::I64(3), Value::I64(4)]), flags(1)]), "image 0 is an integer"),
            (Value::Dict(Default::default()), "a dict"),
        ] {
            let p = write(dir.path(), &value);
            let err = VerificationBin::open(&p).unwrap_err().to_string();
            assert!(err.contains("x.bin") && err.contains(want), "{err} (wanted {want})");
        }
        std::fs::write(&p, b"not a pickle at all").unwrap();
        let err = VerificationBin::open(&p).unwrap_err().to_string();
        assert!(err.contains("x.bin") && err.contains("pickle"), "{err}");
    }
}
