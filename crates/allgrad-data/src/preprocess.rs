//! [`Preprocess`]: an image model's own preprocessing, as `transformers`' image processors
//! (`CLIPImageProcessor`) and OpenCLIP's image transforms do it: a shortest-side resize, a
//! centre crop and the per-channel normalisation for evaluation; for training, OpenCLIP's
//! `RandomResizedCrop` (a random box of 90-100% of the image by default) resized to the crop
//! size. Resizing is Pillow's ([`resize_pil`]): a pretrained model sees the pixels it was
//! trained and evaluated on.

use crate::augment::{
    centre_box, resize_pil, resize_pil_part, shortest_side, CropBox, Normalize, Pipeline, RandomResizedCrop, Resample, ViewKey,
};
use crate::error::{DataError, DataResult};
use crate::image::{Chw, FloatImage, Image};
use crate::rng::stream;

/// The stream tag of the random crop: the same as [`crate::Augment`]'s crop stage, so a view's
/// box is drawn from `stream(&[seed, epoch, index, view, 1])` in both.
const CROP: u64 = 1;

/// An image model's preprocessing; one view per sample. See the module docs.
#[derive(Clone, Debug, PartialEq)]
pub struct Preprocess {
    /// Channels of the output, 1 or 3: images are converted first ([`Image::to_channels`]).
    pub channels: usize,
    /// Resize so that the shorter side has this many pixels (`None`: no resize).
    pub shortest_edge: Option<usize>,
    /// Then the centre `[height, width]` (`None`: no crop; the image must then have the
    /// model's size already). Also the output size of the random crop.
    pub crop: Option<[usize; 2]>,
    /// The resampling filter of both resizes.
    pub resample: Resample,
    /// Values scaled to [0, 1] (bytes / 255), then `(x - mean) / std` per channel.
    pub normalize: Normalize,
    /// Training views: a random box with its area a fraction of the image's in this range and
    /// an aspect ratio in [3/4, 4/3] (torchvision's draw, keyed by the view), resized to
    /// `crop`, in place of the resize and the centre crop. `None`: the evaluation view.
    pub random_crop: Option<[f64; 2]>,
}

impl Preprocess {
    /// Checks the sizes, the channels and the normalisation.
    pub fn validate(&self) -> DataResult<()> {
        let bad = |field, reason: String| Err(DataError::Config { field, reason });
        if !(self.channels == 1 || self.channels == 3) {
            return bad("preprocess.channels", format!("must be 1 or 3, got {}", self.channels));
        }
        if self.shortest_edge == Some(0) || self.crop.is_some_and(|[h, w]| h == 0 || w == 0) {
            return bad("preprocess", "the resize and crop sizes must be at least 1".into());
        }
        if self.random_crop.is_some() && self.crop.is_none() {
            return bad("preprocess.random_crop", "needs a crop size (its output size)".into());
        }
        if let Some(scale) = self.random_crop {
            let [h, w] = self.crop.unwrap_or([1, 1]);
            self.box_draw(scale, w, h).validate()?;
        }
        self.normalize.validate()?;
        let stats = self.normalize.mean.len();
        if stats != 1 && stats != self.channels {
            return Err(DataError::NormalizeChannels { stats, channels: self.channels });
        }
        Ok(())
    }

    /// The evaluation view's preprocessing of this one (no random crop).
    pub fn eval(&self) -> Preprocess {
        Preprocess { random_crop: None, ..self.clone() }
    }

    fn box_draw(&self, scale: [f64; 2], width: usize, height: usize) -> RandomResizedCrop {
        RandomResizedCrop { size: width.max(height), scale, ratio: [3.0 / 4.0, 4.0 / 3.0] }
    }

    /// The 8-bit image after the resize and crop (before normalisation).
    pub fn resized(&self, img: &Image, key: ViewKey) -> DataResult<Image> {
        if img.width == 0 || img.height == 0 {
            return Err(DataError::ImageShape {
                width: img.width,
                height: img.height,
                channels: img.channels,
                expected: 0,
                found: 0,
            });
        }
        let whole = |i: &Image| CropBox { x: 0, y: 0, width: i.width, height: i.height };
        if let (Some(scale), Some([h, w])) = (self.random_crop, self.crop) {
            let mut rng = stream(&[key.seed, key.epoch, key.index, key.view, CROP]);
            let b = self.box_draw(scale, w, h).sample_box(img.width, img.height, &mut rng);
            return Ok(resize_pil(img, b, w, h, self.resample));
        }
        // The shortest-side resize then the centre crop, in one step when both are asked for:
        // only the crop's part of the resized image is computed (the same bytes).
        let (width, height) = match self.shortest_edge {
            Some(s) => shortest_side(img.width, img.height, s),
            None => (img.width, img.height),
        };
        let Some([h, w]) = self.crop else {
            return Ok(match self.shortest_edge {
                Some(_) => resize_pil(img, whole(img), width, height, self.resample),
                None => img.clone(),
            });
        };
        let b = centre_box(width, height, w, h).ok_or_else(|| DataError::Config {
            field: "preprocess.crop",
            reason: format!(
                "a centre crop of {w}x{h} from an image of {width}x{height} (resize its shortest side to at least the crop first)"
            ),
        })?;
        Ok(resize_pil_part(img, whole(img), width, height, self.resample, b))
    }

    /// The view named by `key`: converted to the channels, resized and cropped, normalised.
    pub fn apply(&self, img: &Image, key: ViewKey) -> DataResult<Chw> {
        let out = if img.channels == self.channels {
            self.resized(img, key)?
        } else {
            self.resized(&img.clone().to_channels(self.channels)?, key)?
        };
        self.normalize.apply(&FloatImage::from_image(&out))
    }
}

impl Pipeline for Preprocess {
    fn num_views(&self) -> usize {
        1
    }

    fn view(&self, img: &Image, key: ViewKey) -> DataResult<Chw> {
        self.apply(img, key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn clip(random_crop: Option<[f64; 2]>) -> Preprocess {
        Preprocess {
            channels: 3,
            shortest_edge: Some(8),
            crop: Some([8, 8]),
            resample: Resample::Bicubic,
            normalize: Normalize { mean: vec![0.5], std: vec![0.25] },
            random_crop,
        }
    }

    fn picture(w: usize, h: usize, c: usize) -> Image {
        Image::new(w, h, c, (0..w * h * c).map(|i| ((i * 29 + i / 11) % 256) as u8).collect()).unwrap()
    }

    fn key(index: u64) -> ViewKey {
        ViewKey { seed: 1, epoch: 0, index, view: 0 }
    }

    #[test]
    fn evaluation_is_resize_then_centre_crop_and_training_draws_by_key() {
        let img = picture(30, 12, 3);
        let eval = clip(None);
        // Shortest side 12 -> 8: 20x8, then the centre 8x8 (columns 6..14).
        let resized = resize_pil(&img, CropBox { x: 0, y: 0, width: 30, height: 12 }, 20, 8, Resample::Bicubic);
        let want = resize_pil(&resized, CropBox { x: 6, y: 0, width: 8, height: 8 }, 8, 8, Resample::Bicubic);
        assert_eq!(eval.resized(&img, key(0)).unwrap(), want);
        let v = eval.apply(&img, key(0)).unwrap();
        assert_eq!(v.shape(), (3, 8, 8));
        assert_eq!(v.data[0], (want.pixels[0] as f32 / 255.0 - 0.5) / 0.25);
        // Training: the same for the same key, another box for another sample (an image where
        // boxes of the drawn area and ratio fit, not the centre crop of the fallback).
        let train = clip(Some([0.5, 1.0]));
        let big = picture(40, 36, 3);
        assert_eq!(train.apply(&big, key(3)).unwrap(), train.apply(&big, key(3)).unwrap());
        assert_ne!(train.apply(&big, key(3)).unwrap(), train.apply(&big, key(4)).unwrap());
        assert_eq!(train.eval(), eval);
        // Gray in, three channels out.
        assert_eq!(eval.apply(&picture(9, 9, 1), key(0)).unwrap().shape(), (3, 8, 8));
    }

    #[test]
    fn bad_settings_and_images_are_errors() {
        assert!(clip(None).validate().is_ok());
        assert!(Preprocess { channels: 2, ..clip(None) }.validate().is_err());
        assert!(Preprocess { crop: None, ..clip(Some([0.9, 1.0])) }.validate().is_err());
        assert!(clip(Some([0.9, 0.5])).validate().is_err());
        let three = Normalize { mean: vec![0.5; 3], std: vec![0.5; 3] };
        assert!(Preprocess { channels: 1, normalize: three, ..clip(None) }.validate().is_err());
        // A crop larger than the resized image.
        let err = Preprocess { shortest_edge: None, ..clip(None) }.apply(&picture(5, 20, 3), key(0)).unwrap_err();
        assert!(err.to_string().contains("centre crop of 8x8 from an image of 5x20"), "{err}");
    }
}
