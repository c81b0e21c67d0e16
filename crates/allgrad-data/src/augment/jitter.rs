//! Colour jitter (brightness, contrast, saturation, hue in random order) and random
//! grayscale, with the arithmetic of torchvision's tensor functions on values in [0, 1].

use serde::{Deserialize, Serialize};

use super::flip::check_probability;
use crate::error::{DataError, DataResult};
use crate::image::FloatImage;
use crate::rng::{bernoulli, shuffle, uniform, KeyedRng};

/// With probability `p`, change brightness, contrast, saturation and hue by random factors,
/// in a random order (torchvision's `RandomApply([ColorJitter(b, c, s, h)], p)`).
///
/// Factors are uniform in `[max(0, 1 - b), 1 + b]` (likewise `c`, `s`) and the hue shift in
/// `[-h, h]`; a zero strength leaves its operation out. After the apply-or-not draw, the
/// order is drawn first, then the four factors, as torchvision does. Every operation clamps
/// to [0, 1].
///
/// On a one-channel image saturation and hue are no-ops (as in torchvision): only brightness
/// and contrast change it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ColorJitter {
    /// Brightness strength `b` >= 0: the image is multiplied by a factor in `[max(0, 1-b), 1+b]`.
    pub brightness: f64,
    /// Contrast strength `c` >= 0: the image is blended with its mean gray level by a factor
    /// in `[max(0, 1-c), 1+c]`.
    pub contrast: f64,
    /// Saturation strength `s` >= 0: the image is blended with its grayscale version by a
    /// factor in `[max(0, 1-s), 1+s]`.
    pub saturation: f64,
    /// Hue strength `h` in [0, 0.5]: the hue is rotated by a fraction of a turn in `[-h, h]`.
    pub hue: f64,
    /// Probability of applying the jitter at all, in [0, 1].
    pub p: f64,
}

impl Default for ColorJitter {
    fn default() -> Self {
        ColorJitter { brightness: 0.4, contrast: 0.4, saturation: 0.4, hue: 0.1, p: 0.8 }
    }
}

impl ColorJitter {
    /// Checks the strengths and `p`.
    pub fn validate(&self) -> DataResult<()> {
        for (field, v) in [
            ("color_jitter.brightness", self.brightness),
            ("color_jitter.contrast", self.contrast),
            ("color_jitter.saturation", self.saturation),
        ] {
            if !(v >= 0.0 && v.is_finite()) {
                return Err(DataError::Config { field, reason: format!("must be a finite value >= 0, got {v}") });
            }
        }
        if !(0.0..=0.5).contains(&self.hue) {
            return Err(DataError::Config {
                field: "color_jitter.hue",
                reason: format!("must be in [0, 0.5], got {}", self.hue),
            });
        }
        check_probability("color_jitter.p", self.p)
    }

    /// Applies the jitter with probability `p`.
    pub fn apply(&self, img: &FloatImage, rng: &mut KeyedRng) -> FloatImage {
        let mut out = img.clone();
        self.apply_in_place(&mut out, rng);
        out
    }

    /// [`ColorJitter::apply`] in place (the same draws and values, no copy).
    pub fn apply_in_place(&self, img: &mut FloatImage, rng: &mut KeyedRng) {
        if !bernoulli(rng, self.p) {
            return;
        }
        let mut order = [0usize, 1, 2, 3];
        shuffle(rng, &mut order);
        let factor = |rng: &mut KeyedRng, s: f64| (s > 0.0).then(|| uniform(rng, (1.0 - s).max(0.0), 1.0 + s) as f32);
        let b = factor(rng, self.brightness);
        let c = factor(rng, self.contrast);
        let s = factor(rng, self.saturation);
        let h = (self.hue > 0.0).then(|| uniform(rng, -self.hue, self.hue) as f32);
        for op in order {
            match (op, b, c, s, h) {
                (0, Some(f), ..) => brightness_in_place(img, f),
                (1, _, Some(f), ..) => contrast_in_place(img, f),
                (2, _, _, Some(f), _) => saturation_in_place(img, f),
                (3, .., Some(f)) => hue_in_place(img, f),
                _ => {}
            }
        }
    }
}

/// Convert to grayscale with probability `p`, keeping the channel count (three equal
/// channels for RGB; a no-op on one channel), as torchvision's `RandomGrayscale`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RandomGrayscale {
    /// Probability of converting, in [0, 1].
    pub p: f64,
}

impl Default for RandomGrayscale {
    fn default() -> Self {
        RandomGrayscale { p: 0.2 }
    }
}

impl RandomGrayscale {
    /// Checks `p`.
    pub fn validate(&self) -> DataResult<()> {
        check_probability("grayscale.p", self.p)
    }

    /// Converts with probability `p` (one draw from `rng`).
    pub fn apply(&self, img: &FloatImage, rng: &mut KeyedRng) -> FloatImage {
        let mut out = img.clone();
        self.apply_in_place(&mut out, rng);
        out
    }

    /// [`RandomGrayscale::apply`] in place.
    pub fn apply_in_place(&self, img: &mut FloatImage, rng: &mut KeyedRng) {
        if bernoulli(rng, self.p) && img.channels == 3 {
            for px in img.data.chunks_exact_mut(3) {
                px.fill(gray_of(px));
            }
        }
    }
}

/// Luma weights of torchvision's `rgb_to_grayscale` (ITU-R 601-2).
const LUMA: [f32; 3] = [0.2989, 0.587, 0.114];

fn gray_of(px: &[f32]) -> f32 {
    LUMA[0] * px[0] + LUMA[1] * px[1] + LUMA[2] * px[2]
}

/// The grayscale image with the same channel count: each RGB pixel becomes three copies of
/// 0.2989 R + 0.587 G + 0.114 B; one channel is returned unchanged.
pub fn grayscale(img: &FloatImage) -> FloatImage {
    if img.channels == 1 {
        return img.clone();
    }
    let data = img.data.chunks_exact(3).flat_map(|px| [gray_of(px); 3]).collect();
    FloatImage { data, ..*img }
}

/// `clamp(ratio * a + (1 - ratio) * b, 0, 1)`, torchvision's `_blend`.
fn blend(a: f32, b: f32, ratio: f32) -> f32 {
    (ratio * a + (1.0 - ratio) * b).clamp(0.0, 1.0)
}

/// Multiplies every value by `factor`, clamped to [0, 1].
pub fn adjust_brightness(img: &FloatImage, factor: f32) -> FloatImage {
    let mut out = img.clone();
    brightness_in_place(&mut out, factor);
    out
}

fn brightness_in_place(img: &mut FloatImage, factor: f32) {
    for v in &mut img.data {
        *v = blend(*v, 0.0, factor);
    }
}

/// Blends with the image's mean gray level (the mean of its grayscale version; the plain
/// mean for one channel) by `factor`, clamped to [0, 1].
pub fn adjust_contrast(img: &FloatImage, factor: f32) -> FloatImage {
    let mut out = img.clone();
    contrast_in_place(&mut out, factor);
    out
}

fn contrast_in_place(img: &mut FloatImage, factor: f32) {
    let mean = if img.channels == 3 {
        img.data.chunks_exact(3).map(|px| gray_of(px) as f64).sum::<f64>() / (img.data.len() / 3).max(1) as f64
    } else {
        img.data.iter().map(|&v| v as f64).sum::<f64>() / img.data.len().max(1) as f64
    } as f32;
    for v in &mut img.data {
        *v = blend(*v, mean, factor);
    }
}

/// Blends each pixel with its gray level by `factor` (0 gives grayscale, 1 the image),
/// clamped to [0, 1]. A no-op on one channel.
pub fn adjust_saturation(img: &FloatImage, factor: f32) -> FloatImage {
    let mut out = img.clone();
    saturation_in_place(&mut out, factor);
    out
}

fn saturation_in_place(img: &mut FloatImage, factor: f32) {
    if img.channels == 1 {
        return;
    }
    for px in img.data.chunks_exact_mut(3) {
        let g = gray_of(px);
        for v in px {
            *v = blend(*v, g, factor);
        }
    }
}

/// Rotates the hue by `shift` turns (in [-0.5, 0.5]) through HSV. A no-op on one channel.
pub fn adjust_hue(img: &FloatImage, shift: f32) -> FloatImage {
    let mut out = img.clone();
    hue_in_place(&mut out, shift);
    out
}

fn hue_in_place(img: &mut FloatImage, shift: f32) {
    if img.channels == 1 {
        return;
    }
    for px in img.data.chunks_exact_mut(3) {
        let [h, s, v] = rgb_to_hsv([px[0], px[1], px[2]]);
        px.copy_from_slice(&hsv_to_rgb([wrap_turn(h + shift), s, v]));
    }
}

/// `x.rem_euclid(1.0)`, bit for bit, without the library's `fmod` for the values a hue takes
/// here ([-1, 2)): there `x % 1.0` is exact, `x - 1.0` for x in [1, 2) and `x` in (-1, 1).
fn wrap_turn(x: f32) -> f32 {
    if (1.0..2.0).contains(&x) {
        x - 1.0
    } else if x > -1.0 && x < 1.0 {
        if x < 0.0 {
            x + 1.0
        } else {
            x
        }
    } else {
        x.rem_euclid(1.0)
    }
}

/// RGB in [0, 1] to HSV, hue in turns [0, 1) (torchvision's `_rgb2hsv`).
pub fn rgb_to_hsv([r, g, b]: [f32; 3]) -> [f32; 3] {
    let maxc = r.max(g).max(b);
    let minc = r.min(g).min(b);
    let eqc = maxc == minc;
    let cr = maxc - minc;
    let s = cr / if eqc { 1.0 } else { maxc };
    let div = if eqc { 1.0 } else { cr };
    let (rc, gc, bc) = ((maxc - r) / div, (maxc - g) / div, (maxc - b) / div);
    let h = if maxc == r {
        bc - gc
    } else if maxc == g {
        2.0 + rc - bc
    } else {
        4.0 + gc - rc
    };
    [wrap_turn(h / 6.0 + 1.0), s, maxc]
}

/// HSV (hue in turns) to RGB (torchvision's `_hsv2rgb`).
pub fn hsv_to_rgb([h, s, v]: [f32; 3]) -> [f32; 3] {
    let i = (h * 6.0).floor();
    let f = h * 6.0 - i;
    let i = (i as i64).rem_euclid(6);
    let p = (v * (1.0 - s)).clamp(0.0, 1.0);
    let q = (v * (1.0 - s * f)).clamp(0.0, 1.0);
    let t = (v * (1.0 - s * (1.0 - f))).clamp(0.0, 1.0);
    match i {
        0 => [v, t, p],
        1 => [q, v, p],
        2 => [p, v, t],
        3 => [p, q, v],
        4 => [t, p, v],
        _ => [v, p, q],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::stream;

    fn rgb(data: Vec<f32>) -> FloatImage {
        FloatImage { width: data.len() / 3, height: 1, channels: 3, data }
    }

    fn close(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-5)
    }

    #[test]
    fn brightness_contrast_saturation_numerics() {
        let img = rgb(vec![0.2, 0.4, 0.6, 1.0, 0.5, 0.0]);
        assert!(close(&adjust_brightness(&img, 1.5).data, &[0.3, 0.6, 0.9, 1.0, 0.75, 0.0]));
        // Mean gray: (0.2989*0.2 + 0.587*0.4 + 0.114*0.6 + 0.2989*1 + 0.587*0.5) / 2 = 0.47769.
        let m = 0.47769_f32;
        let c = adjust_contrast(&img, 0.5);
        let expect: Vec<f32> = img.data.iter().map(|v| 0.5 * v + 0.5 * m).collect();
        assert!(close(&c.data, &expect), "{:?}", c.data);
        let s0 = adjust_saturation(&img, 0.0);
        assert!(close(&s0.data, &grayscale(&img).data));
        assert!(close(&adjust_saturation(&img, 1.0).data, &img.data));
        // One channel: contrast uses the plain mean; saturation and hue change nothing.
        let g = FloatImage { width: 2, height: 1, channels: 1, data: vec![0.2, 0.6] };
        assert!(close(&adjust_contrast(&g, 0.0).data, &[0.4, 0.4]));
        assert_eq!(adjust_saturation(&g, 0.0), g);
        assert_eq!(adjust_hue(&g, 0.3), g);
        assert_eq!(grayscale(&g), g);
    }

    #[test]
    fn hue_rotates_and_hsv_round_trips() {
        // Red rotated by a third of a turn is green, by two thirds blue.
        let red = rgb(vec![1.0, 0.0, 0.0]);
        assert!(close(&adjust_hue(&red, 1.0 / 3.0).data, &[0.0, 1.0, 0.0]));
        assert!(close(&adjust_hue(&red, -1.0 / 3.0).data, &[0.0, 0.0, 1.0]));
        let mut r = stream(&[5]);
        for _ in 0..200 {
            let px = [uniform(&mut r, 0.0, 1.0) as f32, uniform(&mut r, 0.0, 1.0) as f32, uniform(&mut r, 0.0, 1.0) as f32];
            assert!(close(&hsv_to_rgb(rgb_to_hsv(px)), &px), "{px:?}");
        }
        // Gray has no hue: unchanged by any rotation.
        let gray = rgb(vec![0.3, 0.3, 0.3]);
        assert!(close(&adjust_hue(&gray, 0.25).data, &gray.data));
    }

    #[test]
    fn wrap_turn_is_rem_euclid_bit_for_bit() {
        let mut r = stream(&[9]);
        let mut xs: Vec<f32> = (0..20000).map(|_| uniform(&mut r, -3.0, 3.0) as f32).collect();
        xs.extend([-2.0, -1.0, -0.0, 0.0, 1.0, 2.0, -1e-9, 1.0 - f32::EPSILON, 2.0 - f32::EPSILON, -1.0 + 1e-7]);
        xs.extend([f32::MIN_POSITIVE, -f32::MIN_POSITIVE, 1.5, -0.5]);
        for x in xs {
            assert_eq!(wrap_turn(x).to_bits(), x.rem_euclid(1.0).to_bits(), "{x}");
        }
    }

    #[test]
    fn jitter_respects_p_and_range() {
        let img = rgb((0..30).map(|i| i as f32 / 30.0).collect());
        let never = ColorJitter { p: 0.0, ..Default::default() };
        assert_eq!(never.apply(&img, &mut stream(&[1])), img);
        let always = ColorJitter { p: 1.0, ..Default::default() };
        let mut changed = 0;
        for i in 0..50 {
            let out = always.apply(&img, &mut stream(&[i]));
            assert!(out.data.iter().all(|v| (0.0..=1.0).contains(v)));
            changed += (out != img) as usize;
        }
        assert_eq!(changed, 50);
        assert!(ColorJitter { hue: 0.6, ..Default::default() }.validate().is_err());
        assert!(ColorJitter { brightness: -0.1, ..Default::default() }.validate().is_err());
        assert!(RandomGrayscale { p: -0.1 }.validate().is_err());
    }
}
