//! An image folder dataset: one sub-folder per class, PNG, JPEG or WebP files inside.
//!
//! ```text
//! root/cat/001.png      class 0 ("cat")
//! root/cat/002.jpg      class 0
//! root/dog/a.jpeg       class 1 ("dog")
//! ```
//!
//! Class ids follow the sorted sub-folder names; files within a class are sorted by name, so
//! sample indices do not depend on the file system's listing order. Only the files directly
//! inside a class folder count (no recursion); names starting with `.` and extensions other
//! than `png`, `jpg`, `jpeg`, `webp` (any case) are ignored. An empty class folder still takes a
//! class id, so ids stay stable when a class has no images.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::dataset::Dataset;
use crate::decode::ColorMode;
use crate::error::{DataError, DataResult};
use crate::image::{Decoded, Image};

/// Options of [`ImageFolder::open`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FolderOptions {
    /// Channel conversion of every image.
    pub color: ColorMode,
    /// Decode every image when opening and leave out the unreadable ones, each with a
    /// warning in the log. Opening then costs one full decode per file. Without it, opening
    /// only lists the files and an unreadable one is an error when it is read.
    pub skip_corrupt: bool,
}

/// A dataset of image files in class sub-folders, decoded when read.
#[derive(Clone, Debug)]
pub struct ImageFolder {
    root: PathBuf,
    classes: Vec<String>,
    items: Vec<(PathBuf, usize)>,
    color: ColorMode,
}

impl ImageFolder {
    /// Lists `root`'s class sub-folders and their image files (see the module docs). Fails
    /// when `root` is not a folder, has no sub-folders, or holds no usable image.
    pub fn open(root: impl AsRef<Path>, options: &FolderOptions) -> DataResult<Self> {
        let root = root.as_ref().to_path_buf();
        if !root.is_dir() {
            return Err(DataError::NotADataset { path: root, reason: "not a folder" });
        }
        let mut class_dirs: Vec<(String, PathBuf)> = list(&root)?
            .into_iter()
            .filter(|p| p.is_dir())
            .map(|p| (p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(), p))
            .collect();
        class_dirs.sort();
        if class_dirs.is_empty() {
            return Err(DataError::NotADataset { path: root, reason: "no class sub-folders" });
        }
        let mut items = Vec::new();
        for (class, (_, dir)) in class_dirs.iter().enumerate() {
            let mut files: Vec<PathBuf> = list(dir)?.into_iter().filter(|p| p.is_file() && is_image_name(p)).collect();
            files.sort();
            for f in files {
                if options.skip_corrupt {
                    if let Err(e) = decode(&f, options.color) {
                        tracing::warn!(path = %f.display(), error = %e, "skipping unreadable image");
                        continue;
                    }
                }
                items.push((f, class));
            }
        }
        if items.is_empty() {
            return Err(DataError::Empty { path: root });
        }
        let classes = class_dirs.into_iter().map(|(n, _)| n).collect();
        Ok(ImageFolder { root, classes, items, color: options.color })
    }

    /// The class names, in class id order.
    pub fn classes(&self) -> &[String] {
        &self.classes
    }

    /// The file of sample `index`.
    pub fn path(&self, index: usize) -> Option<&Path> {
        self.items.get(index).map(|(p, _)| p.as_path())
    }

    /// The folder the dataset was opened from.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn item(&self, index: usize) -> DataResult<&(PathBuf, usize)> {
        self.items.get(index).ok_or(DataError::IndexOutOfRange { index, len: self.items.len() })
    }
}

impl Dataset for ImageFolder {
    fn len(&self) -> usize {
        self.items.len()
    }

    fn get(&self, index: usize) -> DataResult<Image> {
        decode(&self.item(index)?.0, self.color)
    }

    fn get_shrunk(&self, index: usize, shrink: &dyn Fn(usize, usize) -> usize) -> DataResult<Decoded> {
        let path = &self.item(index)?.0;
        let bytes = std::fs::read(path).map_err(|e| DataError::io(path, e))?;
        crate::decode::decode_image_shrunk(&bytes, self.color, path, shrink)
    }

    fn label(&self, index: usize) -> DataResult<usize> {
        Ok(self.item(index)?.1)
    }

    fn num_classes(&self) -> usize {
        self.classes.len()
    }
}

/// The entries of a folder, skipping names that start with a dot.
fn list(dir: &Path) -> DataResult<Vec<PathBuf>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| DataError::io(dir, e))? {
        let entry = entry.map_err(|e| DataError::io(dir, e))?;
        if !entry.file_name().to_string_lossy().starts_with('.') {
            out.push(entry.path());
        }
    }
    Ok(out)
}

fn is_image_name(p: &Path) -> bool {
    let ext = p.extension().map(|e| e.to_string_lossy().to_ascii_lowercase());
    matches!(ext.as_deref(), Some("png" | "jpg" | "jpeg" | "webp"))
}

/// Decodes a PNG, JPEG or WebP file (format from the content).
fn decode(path: &Path, color: ColorMode) -> DataResult<Image> {
    let bytes = std::fs::read(path).map_err(|e| DataError::io(path, e))?;
    crate::decode::decode_image(&bytes, color, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png_rgb(path: &Path, w: u32, h: u32, f: impl Fn(u32, u32) -> [u8; 3]) {
        image::RgbImage::from_fn(w, h, |x, y| image::Rgb(f(x, y))).save(path).unwrap();
    }

    /// root/b_dogs: d1.png (gray 2x2), d0.jpg (RGB 4x4); root/a_cats: c.png (RGB 3x2),
    /// notes.txt, .hidden.png; root/empty_class; root/readme.md.
    fn sample(root: &Path) {
        for d in ["a_cats", "b_dogs", "empty_class"] {
            std::fs::create_dir(root.join(d)).unwrap();
        }
        png_rgb(&root.join("a_cats/c.png"), 3, 2, |x, y| [x as u8 * 10, y as u8 * 10, 200]);
        std::fs::write(root.join("a_cats/notes.txt"), "not an image").unwrap();
        std::fs::write(root.join("a_cats/.hidden.png"), "junk").unwrap();
        image::GrayImage::from_fn(2, 2, |x, y| image::Luma([(x + 2 * y) as u8 * 50])).save(root.join("b_dogs/d1.png")).unwrap();
        png_rgb(&root.join("b_dogs/d0.jpg"), 4, 4, |_, _| [128, 128, 128]);
        std::fs::write(root.join("readme.md"), "top-level file").unwrap();
    }

    #[test]
    fn classes_and_files_are_sorted_and_decoded() {
        let dir = tempfile::tempdir().unwrap();
        sample(dir.path());
        let ds = ImageFolder::open(dir.path(), &FolderOptions::default()).unwrap();
        assert_eq!(ds.classes(), ["a_cats", "b_dogs", "empty_class"]);
        assert_eq!((ds.len(), ds.num_classes()), (3, 3));
        let names: Vec<_> = (0..3).map(|i| ds.path(i).unwrap().file_name().unwrap().to_str().unwrap()).collect();
        assert_eq!(names, ["c.png", "d0.jpg", "d1.png"]);
        assert_eq!([ds.label(0).unwrap(), ds.label(1).unwrap(), ds.label(2).unwrap()], [0, 1, 1]);
        let c = ds.get(0).unwrap();
        assert_eq!((c.width, c.height, c.channels), (3, 2, 3));
        assert_eq!([c.at(2, 1, 0), c.at(2, 1, 1), c.at(2, 1, 2)], [20, 10, 200]);
        let jpg = ds.get(1).unwrap();
        assert_eq!((jpg.width, jpg.height, jpg.channels), (4, 4, 3));
        assert!(jpg.pixels.iter().all(|&v| (v as i32 - 128).abs() <= 3), "{:?}", jpg.pixels);
        // A grayscale file becomes RGB by default, stays 1 channel with Gray or Auto.
        let g = ds.get(2).unwrap();
        assert_eq!((g.channels, g.at(1, 1, 0), g.at(1, 1, 2)), (3, 150, 150));
        for color in [ColorMode::Gray, ColorMode::Auto] {
            let ds = ImageFolder::open(dir.path(), &FolderOptions { color, skip_corrupt: false }).unwrap();
            let g = ds.get(2).unwrap();
            assert_eq!((g.channels, g.pixels.clone()), (1, vec![0, 50, 100, 150]));
        }
        assert!(matches!(ds.get(3), Err(DataError::IndexOutOfRange { .. })));
    }

    #[test]
    fn corrupt_images_are_errors_or_skipped() {
        let dir = tempfile::tempdir().unwrap();
        sample(dir.path());
        // A truncated PNG and a file of junk with a JPEG name.
        let good = std::fs::read(dir.path().join("a_cats/c.png")).unwrap();
        std::fs::write(dir.path().join("a_cats/d_truncated.png"), &good[..good.len() / 2]).unwrap();
        std::fs::write(dir.path().join("b_dogs/bad.jpg"), b"definitely not a jpeg").unwrap();
        let ds = ImageFolder::open(dir.path(), &FolderOptions::default()).unwrap();
        assert_eq!(ds.len(), 5);
        let err = ds.get(1).unwrap_err();
        assert!(matches!(err, DataError::Decode { .. }) && err.to_string().contains("d_truncated.png"), "{err}");
        let err = ds.get(2).unwrap_err();
        assert!(matches!(err, DataError::Decode { .. }) && err.to_string().contains("bad.jpg"), "{err}");
        // A JPEG cut short: an error from the JPEG decoder naming the file.
        let jpg = std::fs::read(dir.path().join("b_dogs/d0.jpg")).unwrap();
        std::fs::write(dir.path().join("b_dogs/cut.jpg"), &jpg[..jpg.len() * 2 / 3]).unwrap();
        let ds = ImageFolder::open(dir.path(), &FolderOptions::default()).unwrap();
        let i = (0..ds.len()).find(|&i| ds.path(i).unwrap().ends_with("b_dogs/cut.jpg")).unwrap();
        let err = ds.get(i).unwrap_err();
        assert!(matches!(err, DataError::Jpeg { .. }) && err.to_string().contains("cut.jpg"), "{err}");
        let ds = ImageFolder::open(dir.path(), &FolderOptions { skip_corrupt: true, ..Default::default() }).unwrap();
        assert_eq!(ds.len(), 3);
        assert!((0..3).all(|i| ds.get(i).is_ok()));
    }

    #[test]
    fn every_prefix_of_an_image_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        sample(dir.path());
        // Every cut into the data fails. Only PNG's end chunk may be missing (12 bytes, IEND):
        // the decoder accepts a complete image without it. A JPEG needs its end marker.
        for (name, trailer) in [("a_cats/c.png", 12), ("b_dogs/d0.jpg", 0)] {
            let path = dir.path().join(name);
            let full = std::fs::read(&path).unwrap();
            let ds = ImageFolder::open(dir.path(), &FolderOptions::default()).unwrap();
            let i = (0..ds.len()).find(|&i| ds.path(i) == Some(path.as_path())).unwrap();
            for n in 0..full.len() - trailer {
                std::fs::write(&path, &full[..n]).unwrap();
                assert!(ds.get(i).is_err(), "prefix {n} of {} bytes of {name} decoded", full.len());
            }
            std::fs::write(&path, &full).unwrap();
        }
    }

    #[test]
    fn bad_roots_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let opts = FolderOptions::default();
        assert!(matches!(ImageFolder::open(dir.path(), &opts), Err(DataError::NotADataset { .. })));
        assert!(matches!(ImageFolder::open(dir.path().join("missing"), &opts), Err(DataError::NotADataset { .. })));
        std::fs::create_dir(dir.path().join("only")).unwrap();
        let err = ImageFolder::open(dir.path(), &opts).unwrap_err();
        assert!(matches!(err, DataError::Empty { .. }), "{err}");
    }
}
