//! RandomResizedCrop: a random box of random area and aspect ratio, resized to a square.

use serde::{Deserialize, Serialize};

use crate::error::{DataError, DataResult};
use crate::image::{FloatImage, Image};
use crate::rng::{below, uniform, KeyedRng};

/// Crop a random box and resize it to `size` x `size` (torchvision's `RandomResizedCrop`).
///
/// The box is drawn as torchvision draws it: up to 10 tries of an area fraction uniform in
/// `scale` and an aspect ratio (width / height) log-uniform in `ratio`; the first box that
/// fits gets a uniform position. If none fits, the whole image is cropped to the nearest
/// ratio in `ratio`, centred. The resize is bilinear (a triangle filter, widened when
/// shrinking so that it averages every source pixel, like PIL and torchvision's
/// `antialias=True`), on float values with no rounding to bytes in between.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RandomResizedCrop {
    /// Side of the square output, in pixels (32 for CIFAR).
    pub size: usize,
    /// Range of the box's area as a fraction of the image's area, `[min, max]`, `0 < min <= max`.
    pub scale: [f64; 2],
    /// Range of the box's aspect ratio (width / height), `[min, max]`, `0 < min <= max`.
    pub ratio: [f64; 2],
}

impl Default for RandomResizedCrop {
    fn default() -> Self {
        RandomResizedCrop { size: 32, scale: [0.08, 1.0], ratio: [3.0 / 4.0, 4.0 / 3.0] }
    }
}

/// A box within an image, in pixels: columns `x..x + width`, rows `y..y + height`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CropBox {
    /// First column.
    pub x: usize,
    /// First row.
    pub y: usize,
    /// Width (at least 1).
    pub width: usize,
    /// Height (at least 1).
    pub height: usize,
}

impl RandomResizedCrop {
    /// Checks the ranges and the size.
    pub fn validate(&self) -> DataResult<()> {
        if self.size == 0 {
            return Err(DataError::Config { field: "crop.size", reason: "must be at least 1".into() });
        }
        let [s0, s1] = self.scale;
        if !(s0 > 0.0 && s0 <= s1 && s1.is_finite()) {
            return Err(DataError::Config { field: "crop.scale", reason: format!("needs 0 < min <= max, got [{s0}, {s1}]") });
        }
        let [r0, r1] = self.ratio;
        if !(r0 > 0.0 && r0 <= r1 && r1.is_finite()) {
            return Err(DataError::Config { field: "crop.ratio", reason: format!("needs 0 < min <= max, got [{r0}, {r1}]") });
        }
        Ok(())
    }

    /// Draws the box for an image of `width` x `height` (both at least 1). The box always
    /// lies within the image and is at least 1 x 1.
    pub fn sample_box(&self, width: usize, height: usize, rng: &mut KeyedRng) -> CropBox {
        let area = (width * height) as f64;
        let (log_r0, log_r1) = (self.ratio[0].ln(), self.ratio[1].ln());
        for _ in 0..10 {
            let target = area * uniform(rng, self.scale[0], self.scale[1]);
            let aspect = uniform(rng, log_r0, log_r1).exp();
            let w = (target * aspect).sqrt().round() as usize;
            let h = (target / aspect).sqrt().round() as usize;
            if 0 < w && w <= width && 0 < h && h <= height {
                let y = below(rng, height - h + 1);
                let x = below(rng, width - w + 1);
                return CropBox { x, y, width: w, height: h };
            }
        }
        // Fallback: centre crop at the nearest allowed ratio.
        let in_ratio = width as f64 / height as f64;
        let (w, h) = if in_ratio < self.ratio[0] {
            (width, ((width as f64 / self.ratio[0]).round() as usize).clamp(1, height))
        } else if in_ratio > self.ratio[1] {
            (((height as f64 * self.ratio[1]).round() as usize).clamp(1, width), height)
        } else {
            (width, height)
        };
        CropBox { x: (width - w) / 2, y: (height - h) / 2, width: w, height: h }
    }

    /// Draws a box and resizes it to `size` x `size`.
    pub fn apply(&self, img: &FloatImage, rng: &mut KeyedRng) -> FloatImage {
        let b = self.sample_box(img.width, img.height, rng);
        resize_bilinear(img, b, self.size, self.size)
    }

    /// Draws a box of the 8-bit `img` and resizes it to `size` x `size`: the values of
    /// [`RandomResizedCrop::apply`] on the image converted to floats, bit for bit, without
    /// converting the image (see [`resize_box`]).
    pub fn apply_bytes(&self, img: &Image, rng: &mut KeyedRng) -> FloatImage {
        let b = self.sample_box(img.width, img.height, rng);
        resize_box(img, b, self.size, self.size)
    }
}

/// Resizes the box `b` of the 8-bit `img` to `out_width` x `out_height` with the filter of
/// [`resize_bilinear`], reading bytes: the result equals `resize_bilinear` on
/// [`FloatImage::from_image`] of `img` bit for bit (each byte becomes `byte / 255` through a
/// table, and every sum runs over the same terms in the same order), but only the box's
/// pixels are read and nothing of the source is converted. Pixels outside the box cost
/// nothing, so an ImageNet-sized image costs what its crop costs.
///
/// Written here rather than taken from a resizing crate: the point is these exact values
/// (the bundled runs' views stay what they were; fast_image_resize rounds to 8 bits between
/// its passes, PIL's arithmetic, which would change every view by up to 1/255).
pub fn resize_box(img: &Image, b: CropBox, out_width: usize, out_height: usize) -> FloatImage {
    let wx = Taps::new(b.x, b.width, out_width);
    let wy = Taps::new(b.y, b.height, out_height);
    resize_taps(img, &wx, &wy, b.y, b.height, out_width, out_height)
}

/// The box `b` of a source image resized to `out_width` x `out_height` as [`resize_box`]
/// does, from `img`, that source decoded at 1/`shrink` of its size (pixel `j` of `img`
/// standing for source pixels `j * shrink..(j + 1) * shrink`): the box maps onto `img`
/// exactly, with fractional edges (`b.x / shrink`, ...), and the filter is the same triangle,
/// widened by the shrink factor left (`b.width / shrink / out_width`), over `img`'s pixels
/// that the mapped box touches. What a view of a scaled decode is; with `shrink` 1 it is
/// [`resize_box`] up to float rounding.
pub fn resize_box_shrunk(img: &Image, b: CropBox, shrink: usize, out_width: usize, out_height: usize) -> FloatImage {
    let s = shrink.max(1) as f64;
    let wx = Taps::from_filter(filter_at(b.x as f64 / s, b.width as f64 / s, out_width, img.width));
    let wy = Taps::from_filter(filter_at(b.y as f64 / s, b.height as f64 / s, out_height, img.height));
    let first = wy.starts.iter().copied().min().unwrap_or(0);
    let last = wy.starts.iter().zip(wy.offsets.windows(2)).map(|(s, o)| s + o[1] - o[0]).max().unwrap_or(first);
    resize_taps(img, &wx, &wy, first, last - first, out_width, out_height)
}

/// The largest factor `s` in {8, 4, 2} with the box `width` x `height` at least `s` times the
/// output `out_width` x `out_height` in both axes (so a decode at 1/`s` still has a source
/// pixel per output pixel), else 1: the rule of Pillow's `draft` and FFCV.
pub fn shrink_for(width: usize, height: usize, out_width: usize, out_height: usize) -> usize {
    [8, 4, 2].into_iter().find(|&s| width >= s * out_width && height >= s * out_height).unwrap_or(1)
}

/// Resizes with the taps `wx` (columns) and `wy` (rows, reading rows `row0..row0 + rows` of
/// `img`), bytes to floats.
fn resize_taps(img: &Image, wx: &Taps, wy: &Taps, row0: usize, rows: usize, out_width: usize, out_height: usize) -> FloatImage {
    let c = img.channels;
    let lut = byte_values();
    let row_len = out_width * c;
    // Horizontal pass over the box's rows: box height x out_width.
    let mut tmp = vec![0f32; rows * row_len];
    for (row, out) in tmp.chunks_exact_mut(row_len).enumerate() {
        let src = &img.pixels[(row0 + row) * img.width * c..(row0 + row + 1) * img.width * c];
        if c == 3 {
            for (ox, px) in out.chunks_exact_mut(3).enumerate() {
                let (start, ws) = wx.get(ox);
                let (mut a0, mut a1, mut a2) = (-0.0f32, -0.0f32, -0.0f32);
                for (w, s) in ws.iter().zip(src[start * 3..].chunks_exact(3)) {
                    a0 += w * lut[s[0] as usize];
                    a1 += w * lut[s[1] as usize];
                    a2 += w * lut[s[2] as usize];
                }
                px.copy_from_slice(&[a0, a1, a2]);
            }
        } else {
            for (ox, px) in out.chunks_exact_mut(c).enumerate() {
                let (start, ws) = wx.get(ox);
                for (k, v) in px.iter_mut().enumerate() {
                    let mut a = -0.0f32;
                    for (i, w) in ws.iter().enumerate() {
                        a += w * lut[src[(start + i) * c + k] as usize];
                    }
                    *v = a;
                }
            }
        }
    }
    // Vertical pass, a whole output row at a time (the same per-value order of terms).
    let mut data = vec![-0.0f32; out_height * row_len];
    for (oy, out) in data.chunks_exact_mut(row_len).enumerate() {
        let (start, ws) = wy.get(oy);
        for (i, w) in ws.iter().enumerate() {
            let r = start - row0 + i;
            for (o, t) in out.iter_mut().zip(&tmp[r * row_len..(r + 1) * row_len]) {
                *o += w * t;
            }
        }
    }
    FloatImage { width: out_width, height: out_height, channels: c, data }
}

/// `byte / 255` for every byte, as [`FloatImage::from_image`] computes it.
fn byte_values() -> &'static [f32; 256] {
    static TABLE: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|b| b as f32 / 255.0))
}

/// The weights of [`filter`] in one flat array: output `o` reads source pixels
/// `starts[o]..starts[o] + lens[o]`.
struct Taps {
    starts: Vec<usize>,
    offsets: Vec<usize>,
    weights: Vec<f32>,
}

impl Taps {
    fn new(offset: usize, len: usize, out: usize) -> Self {
        let (mut starts, mut offsets, mut weights) = (Vec::with_capacity(out), Vec::with_capacity(out + 1), Vec::new());
        offsets.push(0);
        for (start, ws) in filter(offset, len, out) {
            starts.push(start);
            weights.extend_from_slice(&ws);
            offsets.push(weights.len());
        }
        Taps { starts, offsets, weights }
    }

    fn from_filter(taps: Vec<(usize, Vec<f32>)>) -> Self {
        let (mut starts, mut offsets, mut weights) = (Vec::with_capacity(taps.len()), vec![0], Vec::new());
        for (start, ws) in taps {
            starts.push(start);
            weights.extend_from_slice(&ws);
            offsets.push(weights.len());
        }
        Taps { starts, offsets, weights }
    }

    fn get(&self, o: usize) -> (usize, &[f32]) {
        (self.starts[o], &self.weights[self.offsets[o]..self.offsets[o + 1]])
    }
}

/// Resizes the box `b` of `img` to `out_width` x `out_height`, bilinearly (triangle filter
/// over pixel centres, widened by the shrink factor when shrinking; samples outside the box
/// are not used, weights at the border are renormalised).
pub fn resize_bilinear(img: &FloatImage, b: CropBox, out_width: usize, out_height: usize) -> FloatImage {
    let c = img.channels;
    let wx = filter(b.x, b.width, out_width);
    let wy = filter(b.y, b.height, out_height);
    // Horizontal pass over the box's rows: box height x out_width.
    let mut tmp = vec![0f32; b.height * out_width * c];
    for row in 0..b.height {
        let src = &img.data[(b.y + row) * img.width * c..(b.y + row + 1) * img.width * c];
        for (ox, (start, ws)) in wx.iter().enumerate() {
            for k in 0..c {
                let v: f32 = ws.iter().enumerate().map(|(i, w)| w * src[(start + i) * c + k]).sum();
                tmp[(row * out_width + ox) * c + k] = v;
            }
        }
    }
    // Vertical pass: out_height x out_width.
    let mut data = vec![0f32; out_height * out_width * c];
    for (oy, (start, ws)) in wy.iter().enumerate() {
        for ox in 0..out_width {
            for k in 0..c {
                let v: f32 = ws.iter().enumerate().map(|(i, w)| w * tmp[((start - b.y + i) * out_width + ox) * c + k]).sum();
                data[(oy * out_width + ox) * c + k] = v;
            }
        }
    }
    FloatImage { width: out_width, height: out_height, channels: c, data }
}

/// For each output pixel, the first source index and the normalised weights of the source
/// pixels `start..start + weights.len()`, all within `offset..offset + len`.
fn filter(offset: usize, len: usize, out: usize) -> Vec<(usize, Vec<f32>)> {
    let scale = len as f64 / out as f64;
    let support = scale.max(1.0);
    (0..out)
        .map(|o| {
            let centre = (o as f64 + 0.5) * scale; // in box coordinates
            let lo = ((centre - support).floor().max(0.0)) as usize;
            let hi = ((centre + support).ceil() as usize).min(len);
            let raw: Vec<f64> = (lo..hi).map(|i| (1.0 - ((i as f64 + 0.5 - centre) / support).abs()).max(0.0)).collect();
            let sum: f64 = raw.iter().sum();
            (offset + lo, raw.iter().map(|w| (w / sum) as f32).collect())
        })
        .collect()
}

/// [`filter`] for a box with fractional edges, `x0..x0 + len` in source pixels (pixel `i`
/// spans `i..i + 1`, its centre at `i + 0.5`): output `o` is centred at `x0 + (o + 0.5) *
/// len / out`, and reads the pixels within the filter's support that the box touches
/// (`floor(x0)..ceil(x0 + len)`, clipped to `0..limit`).
fn filter_at(x0: f64, len: f64, out: usize, limit: usize) -> Vec<(usize, Vec<f32>)> {
    let scale = len / out as f64;
    let support = scale.max(1.0);
    let (first, end) = ((x0.floor() as usize).min(limit.saturating_sub(1)), ((x0 + len).ceil() as usize).min(limit));
    (0..out)
        .map(|o| {
            let centre = x0 + (o as f64 + 0.5) * scale;
            let lo = ((centre - support).floor().max(0.0) as usize).max(first);
            let hi = ((centre + support).ceil() as usize).min(end).max(lo + 1);
            let raw: Vec<f64> = (lo..hi).map(|i| (1.0 - ((i as f64 + 0.5 - centre) / support).abs()).max(0.0)).collect();
            let sum: f64 = raw.iter().sum();
            // A tap set whose weights all vanish (possible only at a box edge thinner than a
            // pixel): the nearest pixel.
            let ws = if sum > 0.0 { raw.iter().map(|w| (w / sum) as f32).collect() } else { vec![1.0; raw.len().min(1)] };
            (lo, ws)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::stream;

    fn ramp(w: usize, h: usize) -> FloatImage {
        let data = (0..h).flat_map(|y| (0..w).map(move |x| (x + 10 * y) as f32)).collect();
        FloatImage { width: w, height: h, channels: 1, data }
    }

    #[test]
    fn boxes_lie_within_the_image() {
        let crop = RandomResizedCrop::default();
        for (w, h) in [(32, 32), (28, 28), (1, 1), (1, 50), (50, 1), (7, 3), (300, 20)] {
            for i in 0..300 {
                let b = crop.sample_box(w, h, &mut stream(&[1, 0, i, 0]));
                assert!(b.width >= 1 && b.height >= 1, "{b:?}");
                assert!(b.x + b.width <= w && b.y + b.height <= h, "{b:?} in {w}x{h}");
            }
        }
        // Area within the scale range when the box fits (a large image, so rounding is small).
        let crop = RandomResizedCrop { scale: [0.25, 0.5], ..Default::default() };
        for i in 0..200 {
            let b = crop.sample_box(1000, 1000, &mut stream(&[2, i]));
            let frac = (b.width * b.height) as f64 / 1e6;
            let ratio = b.width as f64 / b.height as f64;
            assert!((0.24..=0.51).contains(&frac) && (0.74..=1.34).contains(&ratio), "{b:?}");
        }
    }

    #[test]
    fn impossible_ranges_fall_back_to_a_centre_crop() {
        // Ratio 1 only, on a 10x4 image, scale 1: never fits; centre crop 4x4.
        let crop = RandomResizedCrop { size: 4, scale: [1.0, 1.0], ratio: [1.0, 1.0] };
        let b = crop.sample_box(10, 4, &mut stream(&[0]));
        assert_eq!(b, CropBox { x: 3, y: 0, width: 4, height: 4 });
    }

    #[test]
    fn resize_identity_halving_and_doubling() {
        let img = ramp(4, 4);
        let full = CropBox { x: 0, y: 0, width: 4, height: 4 };
        assert_eq!(resize_bilinear(&img, full, 4, 4).data, img.data);
        // Expected values from PIL (`Image.resize(..., BILINEAR)` on a mode "F" image), which
        // torchvision's resized_crop calls after cropping:
        //   ramp(4, 4).resize((2, 2))                          -> [7.857143, 9.428572, 23.571428, 25.142857]
        //   [0, 1].resize((4, 1))                              -> [0, 0.25, 0.75, 1]
        //   ramp(7, 5).crop((1, 1, 6, 4)).resize((3, 4))       -> below
        let close = |a: &[f32], b: &[f32]| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-4);
        let half = resize_bilinear(&img, full, 2, 2);
        assert!(close(&half.data, &[7.857143, 9.428572, 23.571428, 25.142857]), "{:?}", half.data);
        let row = FloatImage { width: 2, height: 1, channels: 1, data: vec![0.0, 1.0] };
        let up = resize_bilinear(&row, CropBox { x: 0, y: 0, width: 2, height: 1 }, 4, 1);
        assert!(close(&up.data, &[0.0, 0.25, 0.75, 1.0]), "{:?}", up.data);
        let boxed = resize_bilinear(&ramp(7, 5), CropBox { x: 1, y: 1, width: 5, height: 3 }, 3, 4);
        #[rustfmt::skip]
        let pil = [11.428572, 13.0, 14.571428, 17.678572, 19.25, 20.821428,
                   25.178572, 26.75, 28.321428, 31.428572, 33.0, 34.57143];
        assert!(close(&boxed.data, &pil), "{:?}", boxed.data);
        // A box uses only its own pixels.
        let b = resize_bilinear(&img, CropBox { x: 1, y: 2, width: 2, height: 1 }, 2, 1);
        assert_eq!(b.data, vec![21.0, 22.0]);
    }

    /// An 8-bit image with varied content.
    fn bytes(w: usize, h: usize, c: usize) -> Image {
        let px = (0..w * h * c).map(|i| ((i * 37 + (i / 7) * 11) % 256) as u8).collect();
        Image::new(w, h, c, px).unwrap()
    }

    #[test]
    fn resize_box_from_bytes_equals_the_float_resize_bit_for_bit() {
        // Shrinking, enlarging, mixed, one pixel, the whole image; RGB and gray.
        for c in [1, 3] {
            let img = bytes(37, 23, c);
            let float = FloatImage::from_image(&img);
            let boxes = [
                (CropBox { x: 0, y: 0, width: 37, height: 23 }, 11, 7),
                (CropBox { x: 3, y: 5, width: 9, height: 4 }, 20, 20),
                (CropBox { x: 10, y: 1, width: 27, height: 5 }, 6, 13),
                (CropBox { x: 36, y: 22, width: 1, height: 1 }, 3, 2),
                (CropBox { x: 2, y: 2, width: 30, height: 20 }, 30, 20),
            ];
            for (b, ow, oh) in boxes {
                let want = resize_bilinear(&float, b, ow, oh);
                let got = resize_box(&img, b, ow, oh);
                assert_eq!((got.width, got.height, got.channels), (ow, oh, c));
                let same = want.data.iter().zip(&got.data).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{b:?} -> {ow}x{oh}, {c} channel(s)");
            }
        }
        // Through the crop's own draw.
        let crop = RandomResizedCrop { size: 16, ..Default::default() };
        let img = bytes(50, 31, 3);
        for i in 0..20 {
            let a = crop.apply(&FloatImage::from_image(&img), &mut stream(&[4, i]));
            assert_eq!(a, crop.apply_bytes(&img, &mut stream(&[4, i])));
        }
    }
}
