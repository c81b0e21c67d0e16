//! Augmentation pipelines keyed by (seed, epoch, global sample index, view).
//!
//! [`Augment`] runs, in the order of the SimCLR recipe: RandomResizedCrop, horizontal flip,
//! colour jitter (applied with probability p, operations in random order), random
//! grayscale, Gaussian blur, then normalisation to an f32 CHW sample. Each stage draws from
//! its own keyed stream `stream(&[seed, epoch, index, view, stage])`, so a view depends only
//! on its key and on the image: never on the rank, the worker thread or the batch position
//! (ARCHITECTURE.md, "Why W ranks equal one"), and changing one stage's settings does not change the draws of the others.
//!
//! Images may have 1 or 3 channels; on one channel, saturation, hue and grayscale are
//! no-ops. [`TwoViews`] gives the two views of a contrastive pair.
//!
//! ```
//! use allgrad_data::{AugmentConfig, Image, TwoViews};
//! let cfg: AugmentConfig = serde_yaml::from_str("crop: { size: 16 }").unwrap();
//! let views = TwoViews::new(cfg).unwrap();
//! let img = Image::new(32, 32, 3, (0..32 * 32 * 3).map(|i| (i % 251) as u8).collect()).unwrap();
//! let [a, b] = views.apply(&img, 0, 0, 7).unwrap();
//! assert_eq!(a.shape(), (3, 16, 16));
//! assert_ne!(a, b);
//! ```

mod blur;
mod crop;
mod flip;
mod jitter;
mod normalize;
mod resample;

pub use blur::{gaussian_blur, gaussian_blur_composed, gaussian_kernel, GaussianBlur};
pub use crop::{resize_bilinear, resize_box, resize_box_shrunk, shrink_for, CropBox, RandomResizedCrop};
pub use flip::{hflip, RandomHorizontalFlip};
pub use jitter::{
    adjust_brightness, adjust_contrast, adjust_hue, adjust_saturation, grayscale, hsv_to_rgb, rgb_to_hsv, ColorJitter,
    RandomGrayscale,
};
pub use normalize::Normalize;
pub use resample::{centre_box, resize_pil, resize_pil_part, resize_pil_part_on, shortest_side, Resample, ResizePath};

use serde::{Deserialize, Serialize};

use crate::error::{DataError, DataResult};
use crate::image::{Chw, FloatImage, Image};
use crate::rng::{stream, KeyedRng};

/// What names one augmented view: the run's seed, the epoch, the sample's global index in
/// the dataset and the view number (0 and 1 for a pair).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ViewKey {
    /// The run's seed.
    pub seed: u64,
    /// The epoch.
    pub epoch: u64,
    /// The sample's global index in the dataset.
    pub index: u64,
    /// The view number.
    pub view: u64,
}

/// Stage tags: the last word of each stage's stream key.
const CROP: u64 = 1;
const FLIP: u64 = 2;
const JITTER: u64 = 3;
const GRAY: u64 = 4;
const BLUR: u64 = 5;

impl ViewKey {
    /// The random stream of one stage of this view.
    fn stream(&self, stage: u64) -> KeyedRng {
        stream(&[self.seed, self.epoch, self.index, self.view, stage])
    }
}

/// The augmentations of one view. Every field has a default; the defaults are the SimCLR
/// CIFAR-10 recipe (crop 32 with scale (0.08, 1), flip 0.5, jitter (0.4, 0.4, 0.4, 0.1) with
/// p 0.8, grayscale 0.2, no blur, CIFAR-10 mean/std).
///
/// In YAML: `crop: null` leaves the crop out (images keep their size, so all images of a
/// batch must then have the same size); a probability of 0 leaves a stage out.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AugmentConfig {
    /// Random resized crop; `None` keeps the whole image at its size.
    pub crop: Option<RandomResizedCrop>,
    /// Random horizontal flip.
    pub flip: RandomHorizontalFlip,
    /// Random colour jitter.
    pub color_jitter: ColorJitter,
    /// Random conversion to grayscale.
    pub grayscale: RandomGrayscale,
    /// Random Gaussian blur.
    pub blur: GaussianBlur,
    /// Per-channel normalisation into the output sample.
    pub normalize: Normalize,
}

impl Default for AugmentConfig {
    fn default() -> Self {
        AugmentConfig {
            crop: Some(RandomResizedCrop::default()),
            flip: RandomHorizontalFlip::default(),
            color_jitter: ColorJitter::default(),
            grayscale: RandomGrayscale::default(),
            blur: GaussianBlur::default(),
            normalize: Normalize::default(),
        }
    }
}

impl AugmentConfig {
    /// The SimCLR CIFAR-10 recipe for `size` x `size` crops (the default is `size` 32).
    pub fn simclr(size: usize) -> Self {
        AugmentConfig { crop: Some(RandomResizedCrop { size, ..Default::default() }), ..Default::default() }
    }

    /// No randomness: the whole image, normalised (for evaluation and feature extraction).
    pub fn eval(normalize: Normalize) -> Self {
        AugmentConfig {
            crop: None,
            flip: RandomHorizontalFlip { p: 0.0 },
            color_jitter: ColorJitter { p: 0.0, ..Default::default() },
            grayscale: RandomGrayscale { p: 0.0 },
            blur: GaussianBlur { p: 0.0, ..Default::default() },
            normalize,
        }
    }

    /// Checks every stage.
    pub fn validate(&self) -> DataResult<()> {
        if let Some(c) = &self.crop {
            c.validate()?;
        }
        self.flip.validate()?;
        self.color_jitter.validate()?;
        self.grayscale.validate()?;
        self.blur.validate()?;
        self.normalize.validate()
    }
}

/// Something that turns an image into `num_views()` samples, each named by a [`ViewKey`].
/// The loader asks for views `0..num_views()` of every sample.
pub trait Pipeline: Send + Sync {
    /// Views per sample.
    fn num_views(&self) -> usize;

    /// View `key.view` of `img`.
    fn view(&self, img: &Image, key: ViewKey) -> DataResult<Chw>;

    /// The factor `s` (1, 2, 4 or 8) by which the image of sample `key` (its `view` ignored),
    /// `width` x `height` at full size, may be decoded smaller for all of its views: the
    /// largest that leaves every view's crop box at least `s` times the view's output size in
    /// both axes. The loaders ask it with `scaled_decode` on, then give
    /// [`Pipeline::view_shrunk`] the image decoded at 1/`s`. Default: 1 (full size).
    fn shrink(&self, _width: usize, _height: usize, _key: ViewKey) -> usize {
        1
    }

    /// View `key.view` of `img`, a source of size `full` decoded at 1/`shrink`, as
    /// [`crate::Decoded`] describes. Default: [`Pipeline::view`] for `shrink` 1, an error
    /// otherwise (a pipeline that can take a smaller decode overrides both methods).
    fn view_shrunk(&self, img: &Image, full: (usize, usize), shrink: usize, key: ViewKey) -> DataResult<Chw> {
        if shrink == 1 {
            return self.view(img, key);
        }
        Err(DataError::Config {
            field: "data.loader.scaled_decode",
            reason: format!("this pipeline takes images at full size only (given one decoded at 1/{shrink} of {full:?})"),
        })
    }

    /// Whether the pipeline takes each sample's text (its caption: [`crate::Dataset::text`],
    /// a shard sample's caption member): then every sample needs one, and the loaders turn it
    /// into token ids with [`Pipeline::encode_text`] on their threads, into
    /// [`crate::Batch::tokens`]. Default: false (batches carry no text).
    fn takes_text(&self) -> bool {
        false
    }

    /// The token ids of `text` (called only when [`Pipeline::takes_text`]). Default: an error.
    fn encode_text(&self, text: &str) -> DataResult<Vec<u32>> {
        Err(DataError::Text {
            reason: format!("this pipeline takes no text (given {:?})", text.chars().take(40).collect::<String>()),
        })
    }
}

/// A validated augmentation pipeline (one view per call).
#[derive(Clone, Debug)]
pub struct Augment {
    cfg: AugmentConfig,
}

impl Augment {
    /// Validates `cfg`.
    pub fn new(cfg: AugmentConfig) -> DataResult<Self> {
        cfg.validate()?;
        Ok(Augment { cfg })
    }

    /// The configuration.
    pub fn config(&self) -> &AugmentConfig {
        &self.cfg
    }

    /// The view of `img` named by `key`. Fails only when the image's channel count does not
    /// fit the normalisation statistics.
    ///
    /// The least work per pixel: the crop box is drawn on the 8-bit image and only the box is
    /// resized, straight from its bytes to floats at the output size ([`resize_box`]); flip,
    /// jitter, grayscale and blur then work on the output's pixels only. The values are those
    /// of converting the whole image to floats first and cropping it, bit for bit.
    pub fn apply(&self, img: &Image, key: ViewKey) -> DataResult<Chw> {
        self.apply_staged(img, key, |_| {})
    }

    /// [`Augment::apply`], calling `done(stage)` as each stage ends (in the order of
    /// [`Stage`]): what the loader benchmark times the stages with.
    pub fn apply_staged(&self, img: &Image, key: ViewKey, done: impl FnMut(Stage)) -> DataResult<Chw> {
        self.apply_shrunk_staged(img, (img.width, img.height), 1, key, done)
    }

    /// The factor the image of sample `key`, `width` x `height`, may be decoded smaller by for
    /// this view ([`Pipeline::shrink`]): from the view's crop box, drawn as [`Augment::apply`]
    /// draws it, and the crop's output size ([`shrink_for`]); 1 without a crop.
    pub fn shrink(&self, width: usize, height: usize, key: ViewKey) -> usize {
        match &self.cfg.crop {
            Some(crop) if width > 0 && height > 0 => {
                let b = crop.sample_box(width, height, &mut key.stream(CROP));
                shrink_for(b.width, b.height, crop.size, crop.size)
            }
            _ => 1,
        }
    }

    /// The view named by `key` of a source `full` in size, from `img`, that source decoded
    /// at 1/`shrink` ([`crate::Decoded`]): the crop box is drawn on the full size, as
    /// [`Augment::apply`] draws it, and mapped onto `img` exactly ([`resize_box_shrunk`]);
    /// the other stages work on the output's pixels as always. With `shrink` 1 it is
    /// [`Augment::apply`]. Without a crop only `shrink` 1 is taken.
    pub fn apply_shrunk(&self, img: &Image, full: (usize, usize), shrink: usize, key: ViewKey) -> DataResult<Chw> {
        self.apply_shrunk_staged(img, full, shrink, key, |_| {})
    }

    /// [`Augment::apply_shrunk`], calling `done(stage)` as each stage ends.
    pub fn apply_shrunk_staged(
        &self,
        img: &Image,
        full: (usize, usize),
        shrink: usize,
        key: ViewKey,
        mut done: impl FnMut(Stage),
    ) -> DataResult<Chw> {
        let cfg = &self.cfg;
        if shrink != 1 && (cfg.crop.is_none() || img.width != full.0.div_ceil(shrink) || img.height != full.1.div_ceil(shrink)) {
            return Err(DataError::Config {
                field: "data.loader.scaled_decode",
                reason: format!(
                    "a {}x{} image decoded at 1/{shrink} of {}x{} for a view {}",
                    img.width,
                    img.height,
                    full.0,
                    full.1,
                    if cfg.crop.is_none() { "without a crop" } else { "(its size is not the source's / the factor)" }
                ),
            });
        }
        if img.width == 0 || img.height == 0 {
            return Err(DataError::ImageShape {
                width: img.width,
                height: img.height,
                channels: img.channels,
                expected: 0,
                found: 0,
            });
        }
        let mut x = match &cfg.crop {
            Some(crop) if shrink == 1 => crop.apply_bytes(img, &mut key.stream(CROP)),
            Some(crop) => {
                let b = crop.sample_box(full.0, full.1, &mut key.stream(CROP));
                resize_box_shrunk(img, b, shrink, crop.size, crop.size)
            }
            None => FloatImage::from_image(img),
        };
        cfg.flip.apply_in_place(&mut x, &mut key.stream(FLIP));
        done(Stage::CropResize);
        cfg.color_jitter.apply_in_place(&mut x, &mut key.stream(JITTER));
        cfg.grayscale.apply_in_place(&mut x, &mut key.stream(GRAY));
        done(Stage::Jitter);
        cfg.blur.apply_in_place(&mut x, &mut key.stream(BLUR));
        done(Stage::Blur);
        let out = cfg.normalize.apply(&x);
        done(Stage::ToTensor);
        out
    }
}

/// The stages of [`Augment::apply`], in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stage {
    /// Drawing the crop box, resizing it (from the 8-bit image), the flip.
    CropResize,
    /// Colour jitter and random grayscale.
    Jitter,
    /// Gaussian blur.
    Blur,
    /// Normalisation into the CHW f32 sample.
    ToTensor,
}

impl Pipeline for Augment {
    fn num_views(&self) -> usize {
        1
    }

    fn view(&self, img: &Image, key: ViewKey) -> DataResult<Chw> {
        self.apply(img, key)
    }

    fn shrink(&self, width: usize, height: usize, key: ViewKey) -> usize {
        Augment::shrink(self, width, height, ViewKey { view: 0, ..key })
    }

    fn view_shrunk(&self, img: &Image, full: (usize, usize), shrink: usize, key: ViewKey) -> DataResult<Chw> {
        self.apply_shrunk(img, full, shrink, key)
    }
}

/// Two augmented views per sample: view 0 from the first pipeline, view 1 from the second
/// (the same configuration for SimCLR; different ones for asymmetric recipes such as BYOL's).
#[derive(Clone, Debug)]
pub struct TwoViews {
    first: Augment,
    second: Augment,
}

impl TwoViews {
    /// Both views from `cfg`.
    pub fn new(cfg: AugmentConfig) -> DataResult<Self> {
        let a = Augment::new(cfg)?;
        Ok(TwoViews { first: a.clone(), second: a })
    }

    /// View 0 from `first`, view 1 from `second`.
    pub fn asymmetric(first: AugmentConfig, second: AugmentConfig) -> DataResult<Self> {
        Ok(TwoViews { first: Augment::new(first)?, second: Augment::new(second)? })
    }

    /// The pipeline of view 0.
    pub fn first(&self) -> &Augment {
        &self.first
    }

    /// The pipeline of view 1.
    pub fn second(&self) -> &Augment {
        &self.second
    }

    /// Both views of sample `index` of `epoch`.
    pub fn apply(&self, img: &Image, seed: u64, epoch: u64, index: u64) -> DataResult<[Chw; 2]> {
        let key = |view| ViewKey { seed, epoch, index, view };
        Ok([self.first.apply(img, key(0))?, self.second.apply(img, key(1))?])
    }
}

impl Pipeline for TwoViews {
    fn num_views(&self) -> usize {
        2
    }

    /// View 0 uses the first pipeline, any other view number the second.
    fn view(&self, img: &Image, key: ViewKey) -> DataResult<Chw> {
        if key.view == 0 {
            self.first.apply(img, key)
        } else {
            self.second.apply(img, key)
        }
    }

    /// The smaller of the two views' factors: one decode serves both.
    fn shrink(&self, width: usize, height: usize, key: ViewKey) -> usize {
        let first = self.first.shrink(width, height, ViewKey { view: 0, ..key });
        first.min(self.second.shrink(width, height, ViewKey { view: 1, ..key }))
    }

    fn view_shrunk(&self, img: &Image, full: (usize, usize), shrink: usize, key: ViewKey) -> DataResult<Chw> {
        if key.view == 0 {
            self.first.apply_shrunk(img, full, shrink, key)
        } else {
            self.second.apply_shrunk(img, full, shrink, key)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 12x10 RGB image with varied content.
    fn picture() -> Image {
        let px = (0..10).flat_map(|y| (0..12).flat_map(move |x| [(x * 20) as u8, (y * 25) as u8, ((x * y) % 256) as u8]));
        Image::new(12, 10, 3, px.collect()).unwrap()
    }

    fn key(index: u64, view: u64) -> ViewKey {
        ViewKey { seed: 3, epoch: 1, index, view }
    }

    #[test]
    fn same_key_same_view_other_keys_differ() {
        let aug = Augment::new(AugmentConfig::simclr(8)).unwrap();
        let img = picture();
        let a = aug.apply(&img, key(5, 0)).unwrap();
        assert_eq!(a, aug.apply(&img, key(5, 0)).unwrap());
        assert_ne!(a, aug.apply(&img, key(5, 1)).unwrap());
        assert_ne!(a, aug.apply(&img, key(6, 0)).unwrap());
        assert_ne!(a, aug.apply(&img, ViewKey { epoch: 2, ..key(5, 0) }).unwrap());
        assert_ne!(a, aug.apply(&img, ViewKey { seed: 4, ..key(5, 0) }).unwrap());
        let pair = TwoViews::new(AugmentConfig::simclr(8)).unwrap();
        let [v0, v1] = pair.apply(&img, 3, 1, 5).unwrap();
        assert_eq!(v0, a);
        assert_eq!(v1, aug.apply(&img, key(5, 1)).unwrap());
        assert_eq!(pair.view(&img, key(5, 1)).unwrap(), v1);
    }

    /// The pipeline as it was written first: the whole image converted to floats, then each
    /// stage on floats.
    fn apply_composed(aug: &Augment, img: &Image, key: ViewKey) -> Chw {
        let cfg = aug.config();
        let mut x = FloatImage::from_image(img);
        if let Some(crop) = &cfg.crop {
            x = crop.apply(&x, &mut key.stream(CROP));
        }
        x = cfg.flip.apply(&x, &mut key.stream(FLIP));
        x = cfg.color_jitter.apply(&x, &mut key.stream(JITTER));
        x = cfg.grayscale.apply(&x, &mut key.stream(GRAY));
        x = cfg.blur.apply(&x, &mut key.stream(BLUR));
        cfg.normalize.apply(&x).unwrap()
    }

    #[test]
    fn views_equal_the_float_first_pipeline_bit_for_bit() {
        // Cropping the bytes first changes no value: the bundled runs' views are what they were.
        let gray = Image::new(29, 31, 1, (0..29 * 31).map(|v| ((v * 13) % 256) as u8).collect()).unwrap();
        let blur = GaussianBlur { kernel: 5, sigma: [0.1, 2.0], p: 0.5 };
        for (img, normalize) in [(picture(), Normalize::default()), (gray, Normalize { mean: vec![0.3], std: vec![0.4] })] {
            for cfg in [AugmentConfig::simclr(8), AugmentConfig { blur: blur.clone(), ..AugmentConfig::simclr(17) }] {
                let aug = Augment::new(AugmentConfig { normalize: normalize.clone(), ..cfg }).unwrap();
                for i in 0..30 {
                    let (got, want) = (aug.apply(&img, key(i, i % 2)).unwrap(), apply_composed(&aug, &img, key(i, i % 2)));
                    assert!(got.data.iter().zip(&want.data).all(|(a, b)| a.to_bits() == b.to_bits()), "view {i}");
                }
            }
        }
    }

    #[test]
    fn one_stage_does_not_shift_the_others() {
        // Turning the blur on changes nothing before it: with an identity-sized blur
        // (sigma tiny) the output is unchanged although the blur stream was drawn.
        let img = picture();
        let plain = Augment::new(AugmentConfig::simclr(8)).unwrap();
        let mut cfg = AugmentConfig::simclr(8);
        cfg.blur = GaussianBlur { kernel: 3, sigma: [1e-3, 1e-3], p: 1.0 };
        let blurred = Augment::new(cfg).unwrap();
        for i in 0..10 {
            let (a, b) = (plain.apply(&img, key(i, 0)).unwrap(), blurred.apply(&img, key(i, 0)).unwrap());
            assert!(a.data.iter().zip(&b.data).all(|(x, y)| (x - y).abs() < 1e-5));
        }
    }

    #[test]
    fn shapes_and_ranges_for_one_and_three_channels() {
        let rgb = picture();
        let gray = Image::new(9, 7, 1, (0..63).map(|v| (v * 4) as u8).collect()).unwrap();
        let unit = Normalize::identity();
        for (img, c) in [(&rgb, 3), (&gray, 1)] {
            let cfg = AugmentConfig {
                blur: GaussianBlur { p: 0.5, ..Default::default() },
                normalize: unit.clone(),
                ..AugmentConfig::simclr(6)
            };
            let aug = Augment::new(cfg).unwrap();
            for i in 0..40 {
                let v = aug.apply(img, key(i, i % 2)).unwrap();
                assert_eq!(v.shape(), (c, 6, 6));
                assert!(v.data.iter().all(|x| (-1e-6..=1.0 + 1e-6).contains(x)), "{:?}", v.data);
            }
        }
        // Without a crop the size is kept; the eval pipeline is the plain normalised image.
        let eval = Augment::new(AugmentConfig::eval(unit)).unwrap();
        let v = eval.apply(&gray, key(0, 0)).unwrap();
        assert_eq!(v.shape(), (1, 7, 9));
        assert_eq!(v.data, FloatImage::from_image(&gray).to_chw().data);
        // CIFAR statistics on a one-channel image: a clear error, not a panic.
        let aug = Augment::new(AugmentConfig::default()).unwrap();
        assert!(matches!(aug.apply(&gray, key(0, 0)), Err(DataError::NormalizeChannels { .. })));
        let empty = Image { width: 0, height: 0, channels: 3, pixels: vec![] };
        assert!(aug.apply(&empty, key(0, 0)).is_err());
    }

    #[test]
    fn config_defaults_yaml_and_unknown_fields() {
        let cfg: AugmentConfig = serde_yaml::from_str("{}").unwrap();
        assert_eq!(cfg, AugmentConfig::default());
        assert_eq!(cfg.crop.as_ref().unwrap().size, 32);
        assert_eq!((cfg.flip.p, cfg.color_jitter.p, cfg.grayscale.p, cfg.blur.p), (0.5, 0.8, 0.2, 0.0));
        let cfg: AugmentConfig =
            serde_yaml::from_str("crop: { size: 28 }\nnormalize: { mean: [0.286], std: [0.353] }\ncolor_jitter: { hue: 0.0 }")
                .unwrap();
        assert_eq!(cfg.crop.unwrap().scale, [0.08, 1.0]);
        assert_eq!((cfg.color_jitter.hue, cfg.color_jitter.brightness), (0.0, 0.4));
        let no_crop: AugmentConfig = serde_yaml::from_str("crop: null").unwrap();
        assert!(no_crop.crop.is_none());
        assert!(serde_yaml::from_str::<AugmentConfig>("flip: { q: 0.5 }").is_err());
        assert!(serde_yaml::from_str::<AugmentConfig>("croop: {}").is_err());
        let bad =
            AugmentConfig { crop: Some(RandomResizedCrop { scale: [0.5, 0.1], ..Default::default() }), ..Default::default() };
        let err = Augment::new(bad).unwrap_err();
        assert!(err.to_string().contains("crop.scale"), "{err}");
    }
}
