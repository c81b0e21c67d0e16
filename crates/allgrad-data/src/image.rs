//! Images as they travel through the crate: [`Image`] (bytes as read, HWC), [`FloatImage`]
//! (values in [0, 1], HWC, what augmentations work on) and [`Chw`] (normalised f32, CHW,
//! one sample of a batch tensor).

use image::ImageEncoder;

use crate::error::{DataError, DataResult};

/// An 8-bit image as stored: `height` rows of `width` pixels of `channels` bytes (1 = gray,
/// 3 = RGB), row-major, channels last (HWC).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Image {
    /// Width in pixels.
    pub width: usize,
    /// Height in pixels.
    pub height: usize,
    /// 1 (grayscale) or 3 (RGB).
    pub channels: usize,
    /// `height * width * channels` bytes, HWC.
    pub pixels: Vec<u8>,
}

/// An image as decoded for its views: `image` is the file's picture decoded at 1/`shrink` of
/// its size `full` (`shrink` 1, 2, 4 or 8; 1: at full size). Pixel `j` of `image` stands for
/// the source pixels `j * shrink..(j + 1) * shrink` in each axis, so a box of the source maps
/// onto `image` by dividing its coordinates by `shrink`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decoded {
    /// The pixels, `ceil(full / shrink)` in each axis.
    pub image: Image,
    /// The source's `(width, height)`.
    pub full: (usize, usize),
    /// The factor it was decoded smaller by.
    pub shrink: usize,
}

impl Decoded {
    /// An image decoded at full size.
    pub fn whole(image: Image) -> Self {
        let full = (image.width, image.height);
        Decoded { image, full, shrink: 1 }
    }
}

impl Image {
    /// An image from HWC bytes; fails unless `channels` is 1 or 3 and `pixels` has
    /// `width * height * channels` bytes.
    pub fn new(width: usize, height: usize, channels: usize, pixels: Vec<u8>) -> DataResult<Self> {
        let expected = width.checked_mul(height).and_then(|n| n.checked_mul(channels));
        if !(channels == 1 || channels == 3) || expected != Some(pixels.len()) {
            return Err(DataError::ImageShape {
                width,
                height,
                channels,
                expected: expected.unwrap_or(usize::MAX),
                found: pixels.len(),
            });
        }
        Ok(Image { width, height, channels, pixels })
    }

    /// The byte of channel `c` of the pixel at column `x`, row `y`.
    pub fn at(&self, x: usize, y: usize, c: usize) -> u8 {
        self.pixels[(y * self.width + x) * self.channels + c]
    }

    /// The image with `channels` channels (1 or 3): gray replicated to RGB, RGB to gray by
    /// the `image` crate's luma (Rec. 709 weights), the one gray conversion of the crate
    /// (decoding to [`crate::ColorMode::Gray`] uses it too); unchanged when it has them.
    pub fn to_channels(self, channels: usize) -> DataResult<Image> {
        match (self.channels, channels) {
            (a, b) if a == b => Ok(self),
            (1, 3) => {
                let pixels = self.pixels.iter().flat_map(|&p| [p; 3]).collect();
                Ok(Image { channels: 3, pixels, ..self })
            }
            (3, 1) => {
                let (width, height) = (self.width, self.height);
                let buf = image::RgbImage::from_raw(width as u32, height as u32, self.pixels).ok_or(DataError::ImageShape {
                    width,
                    height,
                    channels: 3,
                    expected: width * height * 3,
                    found: 0,
                })?;
                Image::new(width, height, 1, image::DynamicImage::ImageRgb8(buf).to_luma8().into_raw())
            }
            (have, _) => Err(DataError::ImageShape {
                width: self.width,
                height: self.height,
                channels,
                expected: self.width * self.height * channels,
                found: self.width * self.height * have,
            }),
        }
    }

    /// The image as a PNG file (lossless: it decodes to these bytes), for writing shards
    /// from data sets held as raw pixels.
    pub fn to_png(&self) -> DataResult<Vec<u8>> {
        let color = if self.channels == 1 { image::ColorType::L8 } else { image::ColorType::Rgb8 };
        let mut out = Vec::new();
        image::codecs::png::PngEncoder::new(&mut out)
            .write_image(&self.pixels, self.width as u32, self.height as u32, color)
            .map_err(|source| DataError::Decode { path: "<png encoder>".into(), source })?;
        Ok(out)
    }
}

/// A float image, values in [0, 1], HWC: the working form of the augmentations.
#[derive(Clone, Debug, PartialEq)]
pub struct FloatImage {
    /// Width in pixels.
    pub width: usize,
    /// Height in pixels.
    pub height: usize,
    /// 1 or 3.
    pub channels: usize,
    /// `height * width * channels` values, HWC.
    pub data: Vec<f32>,
}

impl FloatImage {
    /// Bytes divided by 255 (what torchvision's `ToTensor` does).
    pub fn from_image(img: &Image) -> Self {
        FloatImage {
            width: img.width,
            height: img.height,
            channels: img.channels,
            data: img.pixels.iter().map(|&b| b as f32 / 255.0).collect(),
        }
    }

    /// The value of channel `c` at column `x`, row `y`.
    pub fn at(&self, x: usize, y: usize, c: usize) -> f32 {
        self.data[(y * self.width + x) * self.channels + c]
    }

    /// The same values, channels first (CHW), unnormalised.
    pub fn to_chw(&self) -> Chw {
        let (w, h, c) = (self.width, self.height, self.channels);
        let mut data = vec![0f32; w * h * c];
        for (p, px) in self.data.chunks_exact(c).enumerate() {
            for (k, v) in px.iter().enumerate() {
                data[k * w * h + p] = *v;
            }
        }
        Chw { channels: c, height: h, width: w, data }
    }
}

/// One sample ready for a batch: f32, channels first (CHW).
#[derive(Clone, Debug, PartialEq)]
pub struct Chw {
    /// Channels.
    pub channels: usize,
    /// Height in pixels.
    pub height: usize,
    /// Width in pixels.
    pub width: usize,
    /// `channels * height * width` values, CHW.
    pub data: Vec<f32>,
}

impl Chw {
    /// `(channels, height, width)`.
    pub fn shape(&self) -> (usize, usize, usize) {
        (self.channels, self.height, self.width)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_new_checks_length_and_channels() {
        assert!(Image::new(2, 2, 3, vec![0; 12]).is_ok());
        assert!(matches!(Image::new(2, 2, 3, vec![0; 11]), Err(DataError::ImageShape { .. })));
        assert!(matches!(Image::new(2, 2, 2, vec![0; 8]), Err(DataError::ImageShape { .. })));
        assert!(matches!(Image::new(usize::MAX, 2, 3, vec![]), Err(DataError::ImageShape { .. })));
    }

    #[test]
    fn to_chw_moves_channels_first() {
        // 2x1 RGB: pixel 0 = (1, 2, 3), pixel 1 = (4, 5, 6).
        let f = FloatImage { width: 2, height: 1, channels: 3, data: vec![1., 2., 3., 4., 5., 6.] };
        let chw = f.to_chw();
        assert_eq!(chw.shape(), (3, 1, 2));
        assert_eq!(chw.data, vec![1., 4., 2., 5., 3., 6.]);
    }
}
