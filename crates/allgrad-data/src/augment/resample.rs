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

/// The horizontal pass over rows `rows` (the box's pixels, `c` channels each) into `tmp`
/// (`rows.len()` rows of `t.len()` pixels), one pixel's channels after another: the wide (i64)
/// path, and the i32 path's for a channel count other than 1 to 4 (none of allgrad's images).
fn horizontal_direct<A: Acc>(c: usize, rows: &[&[u8]], t: &Taps, tmp: &mut [u8]) {
    let row_len = t.len() * c;
    for (src, out) in rows.iter().zip(tmp.chunks_exact_mut(row_len.max(1))) {
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
}

/// Writes the `rows.len()` x `width` pixels (`C` bytes each) of `rows` transposed into `dst`
/// (`width` rows of `rows.len()` pixels), 16 source rows at a time so that the writes to a
/// destination row stay together.
#[inline(always)]
fn transpose<const C: usize>(rows: &[&[u8]], width: usize, dst: &mut [u8]) {
    let dst_len = rows.len() * C;
    for (b, block) in rows.chunks(16).enumerate() {
        let r0 = b * 16 * C;
        for x in 0..width {
            let d = &mut dst[x * dst_len + r0..x * dst_len + r0 + block.len() * C];
            for (dp, row) in d.chunks_exact_mut(C).zip(block) {
                let px: [u8; C] = row[x * C..x * C + C].try_into().unwrap_or([0; C]);
                dp.copy_from_slice(&px);
            }
        }
    }
}

/// The horizontal pass in i32 as a vertical one: the source columns the taps read transposed
/// into rows, each output column summed over whole columns at once ([`vertical`], which the
/// compiler vectorises, where summing along a row pixel by pixel does not), and the result
/// transposed back. The same sums of the same products as [`horizontal_direct`].
#[inline(always)]
fn horizontal_by_columns<const C: usize>(rows: &[&[u8]], t: &Taps, tmp: &mut [u8]) {
    let n = rows.len();
    let (Some(x0), Some(x1)) = (t.lo.iter().min(), (0..t.len()).map(|o| t.lo[o] + t.n[o]).max()) else {
        return;
    };
    let (x0, x1) = (*x0, x1);
    let col_len = n * C;
    if col_len == 0 {
        return;
    }
    let shifted: Vec<&[u8]> = rows.iter().map(|r| &r[x0 * C..x1 * C]).collect();
    let mut cols = vec![0u8; (x1 - x0) * col_len];
    transpose::<C>(&shifted, x1 - x0, &mut cols);
    let mut out_t = vec![0u8; t.len() * col_len];
    vertical::<i32>(&cols, col_len, x0, t, &mut out_t);
    let out_rows: Vec<&[u8]> = out_t.chunks_exact(col_len).collect();
    transpose::<C>(&out_rows, n, tmp);
}

#[inline(always)]
fn horizontal_i32_any(c: usize, rows: &[&[u8]], t: &Taps, tmp: &mut [u8]) {
    match c {
        1 => horizontal_by_columns::<1>(rows, t, tmp),
        2 => horizontal_by_columns::<2>(rows, t, tmp),
        3 => horizontal_by_columns::<3>(rows, t, tmp),
        4 => horizontal_by_columns::<4>(rows, t, tmp),
        _ => horizontal_direct::<i32>(c, rows, t, tmp),
    }
}

/// The vertical pass: output row `o` of `t` from the rows of `tmp` (`row_len` bytes each, the
/// first being source row `first`), every byte of a row at once.
#[inline(always)]
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

/// Whether this CPU runs AVX2 (read once).
#[cfg(target_arch = "x86_64")]
fn avx2() -> bool {
    static AVX2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVX2.get_or_init(|| std::arch::is_x86_feature_detected!("avx2"))
}

// The i32 passes are compiled twice: for the target's baseline and, run when the CPU has it,
// for AVX2. Their loops are written for the compiler to vectorise (no intrinsics); x86-64's
// baseline (SSE2) has no multiply of 32-bit lanes, which the sums need, and AVX2 has 8 of them.
// allgrad-nn's `simd_dispatch` does the same for its kernels, but allgrad-data does not depend
// on allgrad-nn (a sibling crate), so the two copies are written out here.

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn horizontal_i32_avx2(c: usize, rows: &[&[u8]], t: &Taps, tmp: &mut [u8]) {
    horizontal_i32_any(c, rows, t, tmp)
}

fn horizontal_i32(c: usize, rows: &[&[u8]], t: &Taps, tmp: &mut [u8], path: ResizePath) {
    #[cfg(target_arch = "x86_64")]
    if path == ResizePath::Auto && avx2() {
        // SAFETY: the CPU has AVX2 (checked at run time just above).
        return unsafe { horizontal_i32_avx2(c, rows, t, tmp) };
    }
    horizontal_i32_any(c, rows, t, tmp)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn vertical_i32_avx2(tmp: &[u8], row_len: usize, first: usize, t: &Taps, out: &mut [u8]) {
    vertical::<i32>(tmp, row_len, first, t, out)
}

fn vertical_i32(tmp: &[u8], row_len: usize, first: usize, t: &Taps, out: &mut [u8], path: ResizePath) {
    #[cfg(target_arch = "x86_64")]
    if path == ResizePath::Auto && avx2() {
        // SAFETY: the CPU has AVX2 (checked at run time just above).
        return unsafe { vertical_i32_avx2(tmp, row_len, first, t, out) };
    }
    vertical::<i32>(tmp, row_len, first, t, out)
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
    resize_part(img, b, (out_width, out_height), filter, keep, ResizePath::Auto)
}

/// Which copy of [`resize_pil`]'s passes runs, for the tests that compare them: `Auto` is what
/// [`resize_pil`] runs (i32 sums, AVX2 when the CPU has it), `Baseline` the i32 copy compiled
/// for the target's baseline, `Wide` the i64 sums (which the filters' taps never need on
/// bytes, see [`Taps::new`]).
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResizePath {
    /// i32 sums, compiled for AVX2 when the CPU has it.
    Auto,
    /// i32 sums, compiled for the target's baseline.
    Baseline,
    /// i64 sums.
    Wide,
}

/// [`resize_pil_part`] through the copy `path`: the same bytes whichever (tested).
#[doc(hidden)]
pub fn resize_pil_part_on(
    img: &Image,
    b: CropBox,
    out_width: usize,
    out_height: usize,
    filter: Resample,
    keep: CropBox,
    path: ResizePath,
) -> Image {
    resize_part(img, b, (out_width, out_height), filter, keep, path)
}

fn resize_part(
    img: &Image,
    b: CropBox,
    (out_width, out_height): (usize, usize),
    filter: Resample,
    keep: CropBox,
    path: ResizePath,
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
    let src_rows: Vec<&[u8]> = (0..rows)
        .map(|r| {
            let start = ((b.y + rows_first + r) * img.width + b.x) * c;
            &img.pixels[start..start + b.width * c]
        })
        .collect();
    let mut tmp = vec![0u8; rows * kw * c];
    if out_width != b.width {
        let t = Taps::new(b.width, out_width, filter, kx);
        if t.fits_i32 && path != ResizePath::Wide {
            horizontal_i32(c, &src_rows, &t, &mut tmp, path);
        } else {
            horizontal_direct::<i64>(c, &src_rows, &t, &mut tmp);
        }
    } else {
        for (src, dst) in src_rows.iter().zip(tmp.chunks_exact_mut((kw * c).max(1))) {
            dst.copy_from_slice(&src[kx.start * c..kx.end * c]);
        }
    }
    let Some(t) = vertical_taps else {
        return Image { width: kw, height: rows, channels: c, pixels: tmp };
    };
    let row_len = kw * c;
    let mut out = vec![0u8; kh * row_len];
    if t.fits_i32 && path != ResizePath::Wide {
        vertical_i32(&tmp, row_len, rows_first, &t, &mut out, path);
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
