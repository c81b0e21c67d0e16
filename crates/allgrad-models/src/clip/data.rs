//! Image-caption pairs as data sets of the loader ([`allgrad_data::Dataset`] with each sample's
//! caption as its text): [`CsvPairs`] (a CSV of image path and caption) and [`ClassCaptions`]
//! (a labelled image data set whose captions are made from class names, synonyms and
//! templates). Webdataset shards of image-caption pairs are read as a stream
//! (`allgrad_data::webdataset::ShardStream::with_caption`). Images are decoded and captions
//! tokenized on the loader's threads ([`super::inputs`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use allgrad_data::{ColorMode, DataError, DataResult, Dataset, Image};
use candle_core::Result;

fn msg(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

/// Pairs listed in a CSV file: a header `image,caption`, then one pair a line; an image path
/// is taken from the CSV's folder when relative; a caption may be quoted (`"..."`, with `""`
/// for a quote). Images are decoded when asked for (PNG, JPEG or WebP); every sample is class 0.
#[derive(Clone, Debug)]
pub struct CsvPairs {
    rows: Vec<(PathBuf, String)>,
}

/// Splits one CSV line into fields (RFC 4180 quoting, no newlines inside fields).
fn csv_fields(line: &str) -> Vec<String> {
    let mut out = vec![String::new()];
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                chars.next();
                out.last_mut().expect("one field at least").push('"');
            }
            ('"', _) => quoted = !quoted,
            (',', false) => out.push(String::new()),
            (c, _) => out.last_mut().expect("one field at least").push(c),
        }
    }
    out
}

impl CsvPairs {
    /// Reads the CSV (every image path is checked to exist).
    pub fn open(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| msg(format!("reading {}: {e}", path.display())))?;
        let base = path.parent().unwrap_or(Path::new("."));
        let mut lines = text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty());
        match lines.next() {
            Some((_, h)) if csv_fields(h).iter().map(|f| f.trim()).eq(["image", "caption"]) => {}
            other => candle_core::bail!(
                "{}: the first line must be the header `image,caption`, got {:?}",
                path.display(),
                other.map(|(_, l)| l)
            ),
        }
        let mut rows = Vec::new();
        for (n, line) in lines {
            let f = csv_fields(line);
            if f.len() != 2 || f[0].trim().is_empty() {
                candle_core::bail!("{} line {}: expected `image,caption`, got {line:?}", path.display(), n + 1);
            }
            let img = base.join(f[0].trim());
            if !img.is_file() {
                candle_core::bail!("{} line {}: image {} does not exist", path.display(), n + 1, img.display());
            }
            rows.push((img, f[1].clone()));
        }
        if rows.is_empty() {
            candle_core::bail!("{}: no pairs", path.display());
        }
        Ok(CsvPairs { rows })
    }
}

impl CsvPairs {
    /// Pair `index`'s image file.
    pub fn path(&self, index: usize) -> DataResult<&Path> {
        self.rows.get(index).map(|(p, _)| p.as_path()).ok_or(DataError::IndexOutOfRange { index, len: self.rows.len() })
    }

    /// Pair `index`'s caption.
    pub fn caption(&self, index: usize) -> DataResult<&str> {
        self.rows.get(index).map(|(_, c)| c.as_str()).ok_or(DataError::IndexOutOfRange { index, len: self.rows.len() })
    }
}

impl Dataset for CsvPairs {
    fn len(&self) -> usize {
        self.rows.len()
    }
    /// Pair `index`'s image file decoded (allgrad-data's decoder: JPEG, PNG or WebP), gray files as
    /// one channel, colour files as three.
    fn get(&self, index: usize) -> DataResult<Image> {
        let (path, _) = self.rows.get(index).ok_or(DataError::IndexOutOfRange { index, len: self.rows.len() })?;
        let bytes = std::fs::read(path).map_err(|source| DataError::Io { path: path.clone(), source })?;
        allgrad_data::decode_image(&bytes, ColorMode::Auto, path)
    }
    fn label(&self, index: usize) -> DataResult<usize> {
        self.caption(index).map(|_| 0)
    }
    fn num_classes(&self) -> usize {
        1
    }
    fn text(&self, index: usize) -> DataResult<Option<String>> {
        self.caption(index).map(|c| Some(c.to_string()))
    }
}

/// A labelled image data set captioned from its class names: sample i's caption is one of
/// `templates` (each with one `{}`) filled with one of its class's names, both chosen by a
/// hash of `(seed, i)`, so a sample's caption is fixed and independent of the world size.
#[derive(Clone)]
pub struct ClassCaptions {
    images: Arc<dyn Dataset>,
    names: Vec<Vec<String>>,
    templates: Vec<String>,
    seed: u64,
    limit: usize,
}

impl ClassCaptions {
    /// `names[c]`: class c's names (the first is its name, the others synonyms);
    /// `templates`: caption templates with one `{}`; the first `limit` samples.
    pub fn new(
        images: Arc<dyn Dataset>,
        names: Vec<Vec<String>>,
        templates: Vec<String>,
        seed: u64,
        limit: Option<usize>,
    ) -> Result<Self> {
        Self::check(&names, &templates).map_err(|(_, m)| msg(format!("class captions: {m}")))?;
        if names.len() != images.num_classes() {
            candle_core::bail!(
                "class captions: {} classes need a non-empty list of names each, got {} lists",
                images.num_classes(),
                names.len()
            );
        }
        let limit = limit.unwrap_or(usize::MAX).min(images.len());
        Ok(ClassCaptions { images, names, templates, seed, limit })
    }

    /// The one check of class names and templates (`Err((which, why))`, `which` being
    /// `"classes"` or `"templates"`): every class a non-empty list of names, at least one
    /// template, each with exactly one `{}`.
    pub fn check(names: &[Vec<String>], templates: &[String]) -> std::result::Result<(), (&'static str, String)> {
        if names.is_empty() || names.iter().any(|n| n.is_empty()) {
            return Err(("classes", "each class needs a non-empty list of names (its name first, then synonyms)".into()));
        }
        if templates.is_empty() {
            return Err(("templates", "needs at least one template".into()));
        }
        if let Some(t) = templates.iter().find(|t| t.matches("{}").count() != 1) {
            return Err(("templates", format!("{t:?} must hold exactly one {{}} (the class name)")));
        }
        Ok(())
    }

    /// Sample `index`'s caption: a template filled with a name of its class, both picked by
    /// a hash of (seed, index).
    pub fn caption(&self, index: usize) -> DataResult<String> {
        let names = &self.names[self.label(index)?];
        let h = allgrad_rng::key_hash(&[self.seed, index as u64]);
        let name = &names[(h % names.len() as u64) as usize];
        let template = &self.templates[((h >> 32) % self.templates.len() as u64) as usize];
        Ok(template.replace("{}", name))
    }
}

impl Dataset for ClassCaptions {
    fn len(&self) -> usize {
        self.limit
    }
    fn get(&self, index: usize) -> DataResult<Image> {
        if index >= self.limit {
            return Err(DataError::IndexOutOfRange { index, len: self.limit });
        }
        self.images.get(index)
    }
    fn label(&self, index: usize) -> DataResult<usize> {
        if index >= self.limit {
            return Err(DataError::IndexOutOfRange { index, len: self.limit });
        }
        self.images.label(index)
    }
    fn num_classes(&self) -> usize {
        self.images.num_classes()
    }
    fn text(&self, index: usize) -> DataResult<Option<String>> {
        self.caption(index).map(Some)
    }
}
