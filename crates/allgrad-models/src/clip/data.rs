//! Image-caption pairs: a [`PairSource`] gives sample i's image and caption by global index.
//! Two sources ship: [`CsvPairs`] (a CSV of image path and caption) and [`ClassCaptions`]
//! (a labelled image data set whose captions are made from class names, synonyms and
//! templates). Another source (webdataset shards of `jpg` + `txt`, say) plugs in by
//! implementing the trait; the objective sees nothing else.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use allgrad_data::{Dataset, Image};
use candle_core::Result;

fn msg(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

/// Image-caption pairs by global sample index.
pub trait PairSource: Send + Sync {
    /// Number of pairs.
    fn len(&self) -> usize;
    /// True when there are none.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Pair `index`'s image, 8-bit HWC.
    fn image(&self, index: usize) -> Result<Image>;
    /// Pair `index`'s caption.
    fn caption(&self, index: usize) -> Result<String>;
}

/// Pairs listed in a CSV file: a header `image,caption`, then one pair a line; an image path
/// is taken from the CSV's folder when relative; a caption may be quoted (`"..."`, with `""`
/// for a quote). Images are decoded when asked for (PNG or JPEG).
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

impl PairSource for CsvPairs {
    fn len(&self) -> usize {
        self.rows.len()
    }
    fn image(&self, index: usize) -> Result<Image> {
        let (path, _) =
            self.rows.get(index).ok_or_else(|| msg(format!("pair {index} out of range ({} pairs)", self.rows.len())))?;
        let img = image::open(path).map_err(|e| msg(format!("decoding {}: {e}", path.display())))?;
        let (width, height) = (img.width() as usize, img.height() as usize);
        Ok(if img.color().has_color() {
            Image { width, height, channels: 3, pixels: img.to_rgb8().into_raw() }
        } else {
            Image { width, height, channels: 1, pixels: img.to_luma8().into_raw() }
        })
    }
    fn caption(&self, index: usize) -> Result<String> {
        self.rows
            .get(index)
            .map(|(_, c)| c.clone())
            .ok_or_else(|| msg(format!("pair {index} out of range ({} pairs)", self.rows.len())))
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
        if names.len() != images.num_classes() || names.iter().any(|n| n.is_empty()) {
            candle_core::bail!(
                "class captions: {} classes need a non-empty list of names each, got {} lists",
                images.num_classes(),
                names.len()
            );
        }
        if templates.is_empty() || templates.iter().any(|t| t.matches("{}").count() != 1) {
            candle_core::bail!("class captions: templates must be non-empty, each with exactly one {{}}: {templates:?}");
        }
        let limit = limit.unwrap_or(usize::MAX).min(images.len());
        Ok(ClassCaptions { images, names, templates, seed, limit })
    }

    /// Sample `index`'s class.
    pub fn label(&self, index: usize) -> Result<usize> {
        self.images.label(index).map_err(msg)
    }
}

impl PairSource for ClassCaptions {
    fn len(&self) -> usize {
        self.limit
    }
    fn image(&self, index: usize) -> Result<Image> {
        if index >= self.limit {
            candle_core::bail!("pair {index} out of range ({} pairs)", self.limit);
        }
        self.images.get(index).map_err(msg)
    }
    fn caption(&self, index: usize) -> Result<String> {
        let names = &self.names[self.label(index)?];
        let h = allgrad_rng::key_hash(&[self.seed, index as u64]);
        let name = &names[(h % names.len() as u64) as usize];
        let template = &self.templates[((h >> 32) % self.templates.len() as u64) as usize];
        Ok(template.replace("{}", name))
    }
}

/// How images become the vision tower's input: channels, side, per-channel mean and std.
#[derive(Clone, Debug, PartialEq)]
pub struct Pixels {
    /// Channels the tower takes (1 or 3).
    pub channels: usize,
    /// Side of the square input.
    pub size: usize,
    /// Per-channel mean subtracted after scaling to [0, 1].
    pub mean: Vec<f32>,
    /// Per-channel standard deviation divided by.
    pub std: Vec<f32>,
}

impl Pixels {
    /// `img` as `channels x size x size` floats: gray to RGB by repetition and RGB to gray by
    /// the mean of the channels, resized (bilinear) when its size differs, scaled to [0, 1] and
    /// standardised.
    pub fn chw(&self, img: &Image) -> Result<Vec<f32>> {
        let (w, h, c) = (img.width, img.height, img.channels);
        let mut px: Vec<u8> = match (c, self.channels) {
            (a, b) if a == b => img.pixels.clone(),
            (1, 3) => img.pixels.iter().flat_map(|p| [*p; 3]).collect(),
            (3, 1) => img.pixels.chunks(3).map(|p| ((p[0] as u32 + p[1] as u32 + p[2] as u32) / 3) as u8).collect(),
            (a, b) => candle_core::bail!("an image of {a} channels cannot feed a tower of {b}"),
        };
        let s = self.size;
        if (w, h) != (s, s) {
            px = if self.channels == 3 {
                let im =
                    image::RgbImage::from_raw(w as u32, h as u32, px).ok_or_else(|| msg("image buffer of the wrong size"))?;
                image::imageops::resize(&im, s as u32, s as u32, image::imageops::FilterType::Triangle).into_raw()
            } else {
                let im =
                    image::GrayImage::from_raw(w as u32, h as u32, px).ok_or_else(|| msg("image buffer of the wrong size"))?;
                image::imageops::resize(&im, s as u32, s as u32, image::imageops::FilterType::Triangle).into_raw()
            };
        }
        let k = self.channels;
        let mut out = vec![0f32; k * s * s];
        for (i, p) in px.iter().enumerate() {
            let (pos, ch) = (i / k, i % k);
            out[ch * s * s + pos] = (*p as f32 / 255.0 - self.mean[ch]) / self.std[ch];
        }
        Ok(out)
    }
}
