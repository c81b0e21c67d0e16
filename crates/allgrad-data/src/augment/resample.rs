//! Resizing 8-bit images with Pillow's convolution arithmetic (`Image.resize` with
//! `BILINEAR` or `BICUBIC`): what `transformers`' CLIP image processor and OpenCLIP's
//! torchvision transforms on PIL images compute, so that a pretrained model sees the pixels
//! it was trained and evaluated on.
//!
//! Written here rather than taken from a crate: the point is Pillow's exact values (its
//! filter support, its rounding of the filter's taps to 22-bit fixed point, the horizontal
//! pass rounded to bytes before the vertical one, reading only the rows the vertical pass
//! needs); the `image` crate's resize filters in floats and passes vertically first, which
//! moves about a third of the bytes of a downscaled photograph by one. On the same decoded
//! pixels the result is Pillow's, byte for byte (tested against `transformers`).

use serde::{Deserialize, Serialize};

use super::crop::CropBox;
use crate::image::Image;

/// Pillow's fixed point: the taps are integers in units of 2^-22.
const PRECISION_BITS: u32 = 32 - 8 - 2;

/// A resampling filter, as Pillow names and numbers them (`PIL.Image.Resampling`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Resample {
    /// The triangle filter (Pillow's `BILINEAR`, 2): support 1, widened when shrinking.
    Bilinear,
    /// Keys' cubic convolution with a = -0.5 (Pillow's `BICUBIC`, 3): support 2, widened when
    /// shrinking. What CLIP's preprocessing uses.
    #[default]
    Bicubic,
}

impl Resample {
    /// The filter of Pillow's number (`resample` in a `preprocessor_config.json`): 2 and 3;
    /// `Err` with the filter's name for the others (nearest 0, Lanczos 1, box 4, Hamming 5)
    /// or "unknown".
    pub fn from_pil(code: i64) -> Result<Self, String> {
        match code {
            2 => Ok(Resample::Bilinear),
            3 => Ok(Resample::Bicubic),
            0 => Err("0 (nearest)".into()),
            1 => Err("1 (Lanczos)".into()),
            4 => Err("4 (box)".into()),
            5 => Err("5 (Hamming)".into()),
            n => Err(format!("{n} (unknown)")),
        }
    }

    /// Pillow's number of the filter.
    pub fn pil_code(self) -> i64 {
        match self {
            Resample::Bilinear => 2,
            Resample::Bicubic => 3,
        }
    }

    fn support(self) -> f64 {
        match self {
            Resample::Bilinear => 1.0,
            Resample::Bicubic => 2.0,
        }
    }

    fn weight(self, x: f64) -> f64 {
        let x = x.abs();
        match self {
            Resample::Bilinear => (1.0 - x).max(0.0),
            Resample::Bicubic => {
                const A: f64 = -0.5;
                if x < 1.0 {
                    ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    (((x - 5.0) * x + 8.0) * x - 4.0) * A
                } else {
                    0.0
                }
            }
        }
    }
}

/// For each output pixel, the first source pixel and the fixed-point taps over the source
/// pixels that follow it (Pillow's `precompute_coeffs` and `normalize_coeffs_8bpc`, the source
/// being `0..len`).
fn taps(len: usize, out: usize, filter: Resample) -> Vec<(usize, Vec<i32>)> {
    let scale = len as f64 / out as f64;
    let filterscale = scale.max(1.0);
    let support = filter.support() * filterscale;
    (0..out)
        .map(|o| {
            let centre = (o as f64 + 0.5) * scale;
            // Pillow rounds by adding 0.5 and truncating toward zero, then clips.
            let lo = ((centre - support + 0.5) as i64).max(0) as usize;
            let hi = (((centre + support + 0.5) as i64).max(0) as usize).min(len);
            let ss = 1.0 / filterscale;
            let raw: Vec<f64> = (lo..hi).map(|i| filter.weight((i as f64 - centre + 0.5) * ss)).collect();
            let sum: f64 = raw.iter().sum();
            let fixed = raw
                .iter()
                .map(|w| {
                    let w = if sum != 0.0 { w / sum } else { *w };
                    let v = w * (1u32 << PRECISION_BITS) as f64;
                    (if v < 0.0 { v - 0.5 } else { v + 0.5 }) as i32
                })
                .collect();
            (lo, fixed)
        })
        .collect()
}

/// Pillow's `clip8`: the accumulator (with its half added) back to a byte.
fn clip8(acc: i64) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Resizes the box `b` of `img` to `out_width` x `out_height` with `filter`, in Pillow's
/// arithmetic: `img.crop(b).resize((out_width, out_height), filter)` (what torchvision's
/// `resized_crop` and `transformers`' resize do on PIL images), byte for byte. A side that
/// keeps its length is not filtered (Pillow skips that pass).
pub fn resize_pil(img: &Image, b: CropBox, out_width: usize, out_height: usize, filter: Resample) -> Image {
    let c = img.channels;
    let half = 1i64 << (PRECISION_BITS - 1);
    // Horizontal pass over the rows the vertical pass reads, to bytes.
    let (rows_first, rows, vertical) = if out_height != b.height {
        let t = taps(b.height, out_height, filter);
        let first = t[0].0;
        let last = t.last().map_or(first, |(lo, w)| lo + w.len());
        (first, last - first, Some(t))
    } else {
        (0, b.height, None)
    };
    let (tmp, tmp_width) = if out_width != b.width {
        let t = taps(b.width, out_width, filter);
        let mut tmp = vec![0u8; rows * out_width * c];
        for r in 0..rows {
            let y = b.y + rows_first + r;
            let src = &img.pixels[(y * img.width + b.x) * c..(y * img.width + b.x + b.width) * c];
            let out = &mut tmp[r * out_width * c..(r + 1) * out_width * c];
            for (ox, (lo, ws)) in t.iter().enumerate() {
                for k in 0..c {
                    let mut acc = half;
                    for (i, w) in ws.iter().enumerate() {
                        acc += src[(lo + i) * c + k] as i64 * *w as i64;
                    }
                    out[ox * c + k] = clip8(acc);
                }
            }
        }
        (tmp, out_width)
    } else {
        let mut tmp = Vec::with_capacity(rows * b.width * c);
        for r in 0..rows {
            let y = b.y + rows_first + r;
            tmp.extend_from_slice(&img.pixels[(y * img.width + b.x) * c..(y * img.width + b.x + b.width) * c]);
        }
        (tmp, b.width)
    };
    let Some(t) = vertical else {
        return Image { width: tmp_width, height: rows, channels: c, pixels: tmp };
    };
    let row_len = tmp_width * c;
    let mut out = vec![0u8; out_height * row_len];
    let mut acc = vec![0i64; row_len];
    for (oy, (lo, ws)) in t.iter().enumerate() {
        acc.iter_mut().for_each(|a| *a = half);
        for (i, w) in ws.iter().enumerate() {
            let r = lo - rows_first + i;
            for (a, p) in acc.iter_mut().zip(&tmp[r * row_len..(r + 1) * row_len]) {
                *a += *p as i64 * *w as i64;
            }
        }
        for (o, a) in out[oy * row_len..(oy + 1) * row_len].iter_mut().zip(&acc) {
            *o = clip8(*a);
        }
    }
    Image { width: tmp_width, height: out_height, channels: c, pixels: out }
}

/// The size a shortest-side resize gives a `width` x `height` image: the shorter side becomes
/// `shortest`, the longer `floor(shortest * long / short)` (torchvision's `Resize(int)` and
/// `transformers`' `shortest_edge`).
pub fn shortest_side(width: usize, height: usize, shortest: usize) -> (usize, usize) {
    let long_of = |short: usize, long: usize| ((shortest as f64 * long as f64 / short as f64) as usize).max(1);
    if width <= height {
        (shortest, long_of(width, height))
    } else {
        (long_of(height, width), shortest)
    }
}

/// The centre `width` x `height` box of an image of `img_width` x `img_height` (top-left at
/// `floor((img - crop) / 2)`), when the image is at least that large.
pub fn centre_box(img_width: usize, img_height: usize, width: usize, height: usize) -> Option<CropBox> {
    (width <= img_width && height <= img_height).then(|| CropBox {
        x: (img_width - width) / 2,
        y: (img_height - height) / 2,
        width,
        height,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(w: usize, h: usize, c: usize) -> Image {
        Image::new(w, h, c, (0..w * h * c).map(|i| ((i * 53 + i / 5) % 256) as u8).collect()).unwrap()
    }

    #[test]
    fn the_same_size_is_a_copy_and_a_constant_stays_constant() {
        let img = image(13, 9, 3);
        let all = CropBox { x: 0, y: 0, width: 13, height: 9 };
        assert_eq!(resize_pil(&img, all, 13, 9, Resample::Bicubic), img);
        let flat = Image::new(40, 30, 1, vec![77; 1200]).unwrap();
        for f in [Resample::Bilinear, Resample::Bicubic] {
            let out = resize_pil(&flat, CropBox { x: 3, y: 2, width: 31, height: 27 }, 11, 17, f);
            assert!(out.pixels.iter().all(|&p| p == 77), "{f:?}");
        }
    }

    #[test]
    fn pillow_values_on_a_small_ramp() {
        // Pillow 13.0: Image.fromarray(np.array([[0, 64, 128, 255]], np.uint8)).resize((2, 1), BICUBIC)
        // -> [[35, 183]]; .resize((7, 1), BICUBIC) -> [[0, 17, 59, 92, 136, 219, 255]];
        // .resize((2, 1), BILINEAR) -> [[46, 173]].
        let row = Image::new(4, 1, 1, vec![0, 64, 128, 255]).unwrap();
        let b = CropBox { x: 0, y: 0, width: 4, height: 1 };
        assert_eq!(resize_pil(&row, b, 2, 1, Resample::Bicubic).pixels, vec![35, 183]);
        assert_eq!(resize_pil(&row, b, 7, 1, Resample::Bicubic).pixels, vec![0, 17, 59, 92, 136, 219, 255]);
        assert_eq!(resize_pil(&row, b, 2, 1, Resample::Bilinear).pixels, vec![46, 173]);
    }

    #[test]
    fn sizes_and_codes() {
        assert_eq!(shortest_side(640, 427, 224), (335, 224));
        assert_eq!(shortest_side(100, 300, 64), (64, 192));
        assert_eq!(shortest_side(5, 5, 8), (8, 8));
        assert_eq!(centre_box(10, 7, 4, 4), Some(CropBox { x: 3, y: 1, width: 4, height: 4 }));
        assert_eq!(centre_box(3, 7, 4, 4), None);
        assert_eq!(Resample::from_pil(3), Ok(Resample::Bicubic));
        assert_eq!(Resample::from_pil(Resample::Bilinear.pil_code()), Ok(Resample::Bilinear));
        assert_eq!(Resample::from_pil(1), Err("1 (Lanczos)".into()));
        assert_eq!(Resample::from_pil(9), Err("9 (unknown)".into()));
    }
}
