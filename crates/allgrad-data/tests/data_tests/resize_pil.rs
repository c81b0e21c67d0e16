//! `resize_pil` (Pillow's resize, two fixed-point passes over interleaved pixels) against the
//! implementation it replaced, kept here as the reference: a per-channel loop summing in i64,
//! itself tested against Pillow's values (the unit tests in `augment/resample.rs`, and
//! allgrad-models' `clip_preprocess` against `transformers` on Pillow-decoded pixels). Every
//! byte must be equal, on random images of odd sizes, both filters, boxes anywhere in the image
//! at scales that are not whole numbers, up and down, and sides that keep their length; and
//! through each copy of the passes (AVX2 where the CPU has it, the baseline build, i64 sums).

use allgrad_data::augment::{resize_pil, resize_pil_part, resize_pil_part_on, ResizePath};
use allgrad_data::{CropBox, Image, Resample};

mod reference {
    //! The previous `resize_pil`, unchanged: one channel at a time, taps as a `Vec` per output,
    //! i64 sums.
    use allgrad_data::{CropBox, Image, Resample};

    const PRECISION_BITS: u32 = 32 - 8 - 2;

    fn support(f: Resample) -> f64 {
        match f {
            Resample::Bilinear => 1.0,
            Resample::Bicubic => 2.0,
        }
    }

    fn weight(f: Resample, x: f64) -> f64 {
        let x = x.abs();
        match f {
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

    fn taps(len: usize, out: usize, filter: Resample) -> Vec<(usize, Vec<i32>)> {
        let scale = len as f64 / out as f64;
        let filterscale = scale.max(1.0);
        let support = support(filter) * filterscale;
        (0..out)
            .map(|o| {
                let centre = (o as f64 + 0.5) * scale;
                let lo = ((centre - support + 0.5) as i64).max(0) as usize;
                let hi = (((centre + support + 0.5) as i64).max(0) as usize).min(len);
                let ss = 1.0 / filterscale;
                let raw: Vec<f64> = (lo..hi).map(|i| weight(filter, (i as f64 - centre + 0.5) * ss)).collect();
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

    fn clip8(acc: i64) -> u8 {
        (acc >> PRECISION_BITS).clamp(0, 255) as u8
    }

    pub fn resize_pil(img: &Image, b: CropBox, out_width: usize, out_height: usize, filter: Resample) -> Image {
        let c = img.channels;
        let half = 1i64 << (PRECISION_BITS - 1);
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
}

/// A small deterministic generator (xorshift64*), so that a failure names a case that reruns.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }
}

/// Random bytes, with runs of 0 and 255 so that the cubic's overshoot is clipped at both ends.
fn random_image(rng: &mut Rng, width: usize, height: usize, channels: usize) -> Image {
    let pixels = (0..width * height * channels)
        .map(|_| match rng.next() % 8 {
            0 => 0,
            1 => 255,
            _ => (rng.next() >> 24) as u8,
        })
        .collect();
    Image::new(width, height, channels, pixels).unwrap()
}

/// A box inside the image (any offset; its sides are then resized by factors that are seldom
/// whole numbers) and an output size: smaller, larger, the same, or 1, per side.
fn random_case(rng: &mut Rng, img: &Image) -> (CropBox, usize, usize) {
    let width = rng.range(1, img.width);
    let height = rng.range(1, img.height);
    let b = CropBox { x: rng.range(0, img.width - width), y: rng.range(0, img.height - height), width, height };
    let mut side = |len: usize| match rng.next() % 6 {
        0 => len,
        1 => 1,
        2 => rng.range(1, len.max(1)),
        3 => rng.range(len, 3 * len + 7),
        _ => rng.range(1, 2 * len + 3),
    };
    let (w, h) = (side(width), side(height));
    (b, w, h)
}

fn crop(img: &Image, b: CropBox) -> Image {
    let c = img.channels;
    let mut pixels = Vec::with_capacity(b.width * b.height * c);
    for y in b.y..b.y + b.height {
        pixels.extend_from_slice(&img.pixels[(y * img.width + b.x) * c..(y * img.width + b.x + b.width) * c]);
    }
    Image { width: b.width, height: b.height, channels: c, pixels }
}

const FILTERS: [Resample; 2] = [Resample::Bilinear, Resample::Bicubic];

#[test]
fn resize_pil_equals_the_previous_implementation_byte_for_byte() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut cases = 0;
    for channels in [1, 3] {
        // Odd sizes, a single row and a single column among them, and a photograph's size.
        for (w, h) in [(1, 1), (1, 17), (23, 1), (7, 5), (31, 29), (61, 97), (127, 45), (500, 375)] {
            let img = random_image(&mut rng, w, h, channels);
            let rounds = if w * h > 100_000 { 3 } else { 40 };
            for _ in 0..rounds {
                let (b, ow, oh) = random_case(&mut rng, &img);
                for f in FILTERS {
                    let want = reference::resize_pil(&img, b, ow, oh, f);
                    let got = resize_pil(&img, b, ow, oh, f);
                    assert_eq!((got.width, got.height, got.channels), (want.width, want.height, want.channels));
                    let diff = got.pixels.iter().zip(&want.pixels).filter(|(a, b)| a != b).count();
                    assert_eq!(diff, 0, "{diff} bytes differ: {w}x{h}x{channels}, box {b:?} to {ow}x{oh}, {f:?}");
                    for path in [ResizePath::Baseline, ResizePath::Wide] {
                        let all = CropBox { x: 0, y: 0, width: ow, height: oh };
                        assert_eq!(
                            resize_pil_part_on(&img, b, ow, oh, f, all, path),
                            want,
                            "{path:?}: {w}x{h}x{channels}, box {b:?} to {ow}x{oh}, {f:?}"
                        );
                    }
                    cases += 1;
                }
            }
        }
    }
    // The CLIP evaluation view's resize of a 500x375 photograph, and its 224 crop.
    let img = random_image(&mut rng, 500, 375, 3);
    let all = CropBox { x: 0, y: 0, width: 500, height: 375 };
    for f in FILTERS {
        assert_eq!(resize_pil(&img, all, 298, 224, f), reference::resize_pil(&img, all, 298, 224, f), "{f:?}");
    }
    assert!(cases > 1000, "{cases} cases");
}

#[test]
fn a_part_of_the_output_equals_that_crop_of_the_whole_output() {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    for channels in [1, 3] {
        for (w, h) in [(9, 13), (64, 41), (333, 250)] {
            let img = random_image(&mut rng, w, h, channels);
            for _ in 0..30 {
                let (b, ow, oh) = random_case(&mut rng, &img);
                let kw = rng.range(1, ow);
                let kh = rng.range(1, oh);
                let keep = CropBox { x: rng.range(0, ow - kw), y: rng.range(0, oh - kh), width: kw, height: kh };
                for f in FILTERS {
                    let want = crop(&reference::resize_pil(&img, b, ow, oh, f), keep);
                    assert_eq!(
                        resize_pil_part(&img, b, ow, oh, f, keep),
                        want,
                        "{w}x{h}x{channels}, box {b:?} to {ow}x{oh}, part {keep:?}, {f:?}"
                    );
                    for path in [ResizePath::Baseline, ResizePath::Wide] {
                        assert_eq!(resize_pil_part_on(&img, b, ow, oh, f, keep, path), want, "{path:?}: part {keep:?}");
                    }
                }
            }
        }
    }
    // The evaluation view: shortest side to 224, the centre 224x224.
    let img = random_image(&mut rng, 500, 375, 3);
    let all = CropBox { x: 0, y: 0, width: 500, height: 375 };
    let keep = CropBox { x: 37, y: 0, width: 224, height: 224 };
    let want = crop(&reference::resize_pil(&img, all, 298, 224, Resample::Bicubic), keep);
    assert_eq!(resize_pil_part(&img, all, 298, 224, Resample::Bicubic, keep), want);
}

/// Relative speed only (no assertion): the previous implementation and this one on the
/// evaluation view's resize of a 500x375 RGB image (shortest side to 224, then the centre 224
/// crop), on one thread. Run alone, with optimisations:
/// `cargo test --release --workspace --test data_tests resize_pil::timing -- --ignored --nocapture`.
#[test]
#[ignore = "a timing printout; run alone on an idle machine"]
fn timing_of_the_evaluation_resize() {
    use std::time::Instant;
    let mut rng = Rng(7);
    let img = random_image(&mut rng, 500, 375, 3);
    let all = CropBox { x: 0, y: 0, width: 500, height: 375 };
    let keep = CropBox { x: 37, y: 0, width: 224, height: 224 };
    let n = 50;
    let time = |label: &str, f: &dyn Fn() -> Image| {
        let first = f();
        let start = Instant::now();
        for _ in 0..n {
            std::hint::black_box(f());
        }
        let ms = start.elapsed().as_secs_f64() * 1e3 / n as f64;
        println!("{label}: {ms:.3} ms per 500x375 image");
        first
    };
    let old = time("previous resize_pil (whole 298x224), then crop", &|| {
        crop(&reference::resize_pil(&img, all, 298, 224, Resample::Bicubic), keep)
    });
    let whole =
        time("resize_pil (whole 298x224), then crop", &|| crop(&resize_pil(&img, all, 298, 224, Resample::Bicubic), keep));
    let part = time("resize_pil_part (the 224x224 crop only)", &|| resize_pil_part(&img, all, 298, 224, Resample::Bicubic, keep));
    assert_eq!(whole, old);
    assert_eq!(part, old);
}

/// The evaluation view of [`Preprocess`] (shortest side, then the centre crop, now one resize
/// of the crop's part) against the reference's resize then crop, on landscape, portrait and
/// square images, square and oblong crops, a shortest side equal to the crop and larger, and
/// no resize (the crop of the image itself); a crop larger than the resized image is still the
/// error naming `preprocess.crop`.
#[test]
fn the_evaluation_view_equals_the_resize_then_the_centre_crop() {
    use allgrad_data::augment::{centre_box, shortest_side, Normalize};
    use allgrad_data::{Preprocess, ViewKey};
    let mut rng = Rng(11);
    let key = ViewKey { seed: 0, epoch: 0, index: 0, view: 0 };
    for (w, h) in [(500, 375), (375, 500), (97, 97), (64, 33), (31, 80)] {
        for channels in [1, 3] {
            let img = random_image(&mut rng, w, h, channels);
            for (shortest_edge, crop) in [(Some(24), [24, 24]), (Some(30), [24, 24]), (Some(29), [20, 27]), (None, [17, 23])] {
                for resample in FILTERS {
                    let p = Preprocess {
                        channels,
                        shortest_edge,
                        crop: Some(crop),
                        resample,
                        normalize: Normalize { mean: vec![0.5], std: vec![0.25] },
                        random_crop: None,
                    };
                    let resized = match shortest_edge {
                        Some(s) => {
                            let (rw, rh) = shortest_side(w, h, s);
                            reference::resize_pil(&img, CropBox { x: 0, y: 0, width: w, height: h }, rw, rh, resample)
                        }
                        None => img.clone(),
                    };
                    let [ch, cw] = crop;
                    let b = centre_box(resized.width, resized.height, cw, ch).unwrap();
                    let want = reference::resize_pil(&resized, b, cw, ch, resample);
                    assert_eq!(
                        p.resized(&img, key).unwrap(),
                        want,
                        "{w}x{h}x{channels}, {shortest_edge:?}, {crop:?}, {resample:?}"
                    );
                }
            }
        }
    }
    let p = Preprocess {
        channels: 3,
        shortest_edge: Some(16),
        crop: Some([20, 20]),
        resample: Resample::Bicubic,
        normalize: Normalize { mean: vec![0.5], std: vec![0.25] },
        random_crop: None,
    };
    let err = p.resized(&random_image(&mut rng, 40, 30, 3), key).unwrap_err().to_string();
    assert!(err.contains("preprocess.crop") && err.contains("21x16"), "{err}");
}
