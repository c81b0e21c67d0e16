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

/// One axis's taps laid out flat for the passes: output `o` (counted from the first output
/// kept) reads `n[o]` source pixels from `lo[o]` with the taps `coeffs[o * ksize..][..n[o]]`.
/// Built once per call and reused by every row (the horizontal pass) or column (the vertical).
struct Taps {
    lo: Vec<usize>,
    n: Vec<usize>,
    ksize: usize,
    coeffs: Vec<i32>,
    /// Whether Pillow's 32-bit accumulator holds every sum of these taps over bytes (see
    /// [`Taps::new`]); when not, the passes sum in i64 (the same values, as long as Pillow's
    /// own `int` sum does not overflow).
    fits_i32: bool,
}

impl Taps {
    /// The taps of `taps(len, out, filter)` for the outputs `keep`.
    ///
    /// The i32 bound: an accumulator starts at `1 << (PRECISION_BITS - 1)` and adds
    /// `p * w` with `0 <= p <= 255`, so every partial sum lies within
    /// `half + 255 * (sum of the negative taps) ..= half + 255 * (sum of the positive taps)`.
    /// The taps are normalised to sum to `1 << PRECISION_BITS` (2^22), so for the triangle
    /// filter (no negative taps) the largest sum is about `2^21 + 255 * 2^22 < 2^31`; Keys'
    /// cubic has negative lobes, and rather than rely on an analytic bound for every scale and
    /// clipped edge, the bound is checked here on the actual taps, exactly in i64.
    fn new(len: usize, out: usize, filter: Resample, keep: std::ops::Range<usize>) -> Taps {
        let all = taps(len, out, filter);
        let kept = &all[keep];
        let ksize = kept.iter().map(|(_, w)| w.len()).max().unwrap_or(0);
        let mut coeffs = vec![0i32; kept.len() * ksize];
        let (mut pos_max, mut neg_min) = (0i64, 0i64);
        for (o, (_, w)) in kept.iter().enumerate() {
            coeffs[o * ksize..o * ksize + w.len()].copy_from_slice(w);
            pos_max = pos_max.max(w.iter().filter(|&&x| x > 0).map(|&x| x as i64).sum());
            neg_min = neg_min.min(w.iter().filter(|&&x| x < 0).map(|&x| x as i64).sum());
        }
        let half = 1i64 << (PRECISION_BITS - 1);
        let fits_i32 = half + 255 * pos_max <= i32::MAX as i64 && half + 255 * neg_min >= i32::MIN as i64;
        Taps {
            lo: kept.iter().map(|(lo, _)| *lo).collect(),
            n: kept.iter().map(|(_, w)| w.len()).collect(),
            ksize,
            coeffs,
            fits_i32,
        }
    }

    fn len(&self) -> usize {
        self.lo.len()
    }

    /// The first source pixel and the taps of output `o`.
    #[inline(always)]
    fn get(&self, o: usize) -> (usize, &[i32]) {
        let start = o * self.ksize;
        (self.lo[o], &self.coeffs[start..start + self.n[o]])
    }
}

/// A fixed-point accumulator: i32 (Pillow's own) when [`Taps::fits_i32`], else i64.
trait Acc: Copy {
    const HALF: Self;
    fn mac(self, p: u8, w: i32) -> Self;
    /// Pillow's `clip8`: the accumulator (with its half added) back to a byte.
    fn byte(self) -> u8;
}

impl Acc for i32 {
    const HALF: i32 = 1 << (PRECISION_BITS - 1);
    #[inline(always)]
    fn mac(self, p: u8, w: i32) -> i32 {
        self + p as i32 * w
    }
    #[inline(always)]
    fn byte(self) -> u8 {
        (self >> PRECISION_BITS).clamp(0, 255) as u8
    }
}

impl Acc for i64 {
    const HALF: i64 = 1 << (PRECISION_BITS - 1);
    #[inline(always)]
    fn mac(self, p: u8, w: i32) -> i64 {
        self + p as i64 * w as i64
    }
    #[inline(always)]
    fn byte(self) -> u8 {
        (self >> PRECISION_BITS).clamp(0, 255) as u8
    }
}

/// The horizontal pass over one row `src` (the box's pixels, `C` channels each) into `out`
/// (`t.len()` pixels): all channels of a pixel summed together, no bounds check in the tap loop.
#[inline(always)]
fn horizontal_row<const C: usize, A: Acc>(src: &[u8], t: &Taps, out: &mut [u8]) {
    for (o, px) in out.chunks_exact_mut(C).enumerate() {
        let (lo, ws) = t.get(o);
        let mut acc = [A::HALF; C];
        for (p, &w) in src[lo * C..(lo + ws.len()) * C].chunks_exact(C).zip(ws) {
            for k in 0..C {
                acc[k] = acc[k].mac(p[k], w);
            }
        }
        for k in 0..C {
            px[k] = acc[k].byte();
        }
    }
}

/// [`horizontal_row`] for any number of channels (not 1 to 4: none of allgrad's images).
fn horizontal_row_any<A: Acc>(c: usize, src: &[u8], t: &Taps, out: &mut [u8]) {
    for (o, px) in out.chunks_exact_mut(c).enumerate() {
        let (lo, ws) = t.get(o);
        for (k, q) in px.iter_mut().enumerate() {
            let mut acc = A::HALF;
            for (i, &w) in ws.iter().enumerate() {
                acc = acc.mac(src[(lo + i) * c + k], w);
            }
            *q = acc.byte();
        }
    }
}

fn horizontal<A: Acc>(c: usize, rows: &mut dyn Iterator<Item = &[u8]>, t: &Taps, tmp: &mut [u8]) {
    let row_len = t.len() * c;
    for (src, out) in rows.zip(tmp.chunks_exact_mut(row_len.max(1))) {
        match c {
            1 => horizontal_row::<1, A>(src, t, out),
            2 => horizontal_row::<2, A>(src, t, out),
            3 => horizontal_row::<3, A>(src, t, out),
            4 => horizontal_row::<4, A>(src, t, out),
            _ => horizontal_row_any::<A>(c, src, t, out),
        }
    }
}

/// The vertical pass: output row `o` of `t` from the rows of `tmp` (`row_len` bytes each, the
/// first being source row `first`), every byte of a row at once.
fn vertical<A: Acc>(tmp: &[u8], row_len: usize, first: usize, t: &Taps, out: &mut [u8]) {
    let mut acc = vec![A::HALF; row_len];
    for (o, dst) in out.chunks_exact_mut(row_len.max(1)).enumerate() {
        let (lo, ws) = t.get(o);
        acc.fill(A::HALF);
        let rows = &tmp[(lo - first) * row_len..(lo - first + ws.len()) * row_len];
        for (row, &w) in rows.chunks_exact(row_len).zip(ws) {
            for (a, &p) in acc.iter_mut().zip(row) {
                *a = a.mac(p, w);
            }
        }
        for (d, a) in dst.iter_mut().zip(&acc) {
            *d = a.byte();
        }
    }
}

/// Resizes the box `b` of `img` to `out_width` x `out_height` with `filter`, in Pillow's
/// arithmetic: `img.crop(b).resize((out_width, out_height), filter)` (what torchvision's
/// `resized_crop` and `transformers`' resize do on PIL images), byte for byte. A side that
/// keeps its length is not filtered (Pillow skips that pass).
pub fn resize_pil(img: &Image, b: CropBox, out_width: usize, out_height: usize, filter: Resample) -> Image {
    let all = CropBox { x: 0, y: 0, width: out_width, height: out_height };
    resize_pil_part(img, b, out_width, out_height, filter, all)
}

/// The part `keep` of [`resize_pil`]'s output, computed alone: the same bytes as cropping
/// `keep` out of `resize_pil(img, b, out_width, out_height, filter)` (each output byte depends
/// only on its own taps), without the work for the rest (torchvision's `Resize` then
/// `CenterCrop` in one step). `keep` is clipped to the output.
///
/// Pillow's two passes (its `ImagingResample`): the horizontal pass, rounded to bytes, over the
/// source rows the kept output rows read, then the vertical pass; taps in 22-bit fixed point
/// computed once per axis, all channels of a pixel at once.
pub fn resize_pil_part(img: &Image, b: CropBox, out_width: usize, out_height: usize, filter: Resample, keep: CropBox) -> Image {
    resize_part(img, b, (out_width, out_height), filter, keep, false)
}

/// [`resize_pil_part`] summing in i64 whatever the taps: for tests of the wide accumulator,
/// which the filters' taps never need on bytes (see [`Taps::new`]).
#[doc(hidden)]
pub fn resize_pil_part_i64(
    img: &Image,
    b: CropBox,
    out_width: usize,
    out_height: usize,
    filter: Resample,
    keep: CropBox,
) -> Image {
    resize_part(img, b, (out_width, out_height), filter, keep, true)
}

fn resize_part(
    img: &Image,
    b: CropBox,
    (out_width, out_height): (usize, usize),
    filter: Resample,
    keep: CropBox,
    wide: bool,
) -> Image {
    let c = img.channels;
    let kx = keep.x.min(out_width)..(keep.x + keep.width).min(out_width);
    let ky = keep.y.min(out_height)..(keep.y + keep.height).min(out_height);
    let (kw, kh) = (kx.len(), ky.len());
    // The source rows (within the box) the vertical pass reads.
    let (rows_first, rows, vertical_taps) = if out_height != b.height {
        let t = Taps::new(b.height, out_height, filter, ky.clone());
        let first = t.lo.iter().copied().min().unwrap_or(0);
        let last = (0..t.len()).map(|o| t.lo[o] + t.n[o]).max().unwrap_or(first);
        (first, last - first, Some(t))
    } else {
        (ky.start, kh, None)
    };
    let mut src_rows = (0..rows).map(|r| {
        let start = ((b.y + rows_first + r) * img.width + b.x) * c;
        &img.pixels[start..start + b.width * c]
    });
    let mut tmp = vec![0u8; rows * kw * c];
    if out_width != b.width {
        let t = Taps::new(b.width, out_width, filter, kx);
        if t.fits_i32 && !wide {
            horizontal::<i32>(c, &mut src_rows, &t, &mut tmp);
        } else {
            horizontal::<i64>(c, &mut src_rows, &t, &mut tmp);
        }
    } else {
        for (src, dst) in src_rows.zip(tmp.chunks_exact_mut((kw * c).max(1))) {
            dst.copy_from_slice(&src[kx.start * c..kx.end * c]);
        }
    }
    let Some(t) = vertical_taps else {
        return Image { width: kw, height: rows, channels: c, pixels: tmp };
    };
    let row_len = kw * c;
    let mut out = vec![0u8; kh * row_len];
    if t.fits_i32 && !wide {
        vertical::<i32>(&tmp, row_len, rows_first, &t, &mut out);
    } else {
        vertical::<i64>(&tmp, row_len, rows_first, &t, &mut out);
    }
    Image { width: kw, height: kh, channels: c, pixels: out }
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
