//! Random Gaussian blur.

use serde::{Deserialize, Serialize};

use super::flip::check_probability;
use crate::error::{DataError, DataResult};
use crate::image::FloatImage;
use crate::rng::{bernoulli, uniform, KeyedRng};

/// With probability `p`, blur with a Gaussian of standard deviation uniform in `sigma`
/// (torchvision's `RandomApply([GaussianBlur(kernel, sigma)], p)`): a separable
/// `kernel` x `kernel` filter, borders mirrored (reflect, edge pixel not repeated).
///
/// The SimCLR recipe blurs ImageNet images (p = 0.5, kernel about 10% of the image side) but
/// not CIFAR images, hence the default p = 0.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GaussianBlur {
    /// Kernel side in pixels, odd and at least 1.
    pub kernel: usize,
    /// Range of the standard deviation in pixels, `[min, max]`, `0 < min <= max`.
    pub sigma: [f64; 2],
    /// Probability of blurring, in [0, 1].
    pub p: f64,
}

impl Default for GaussianBlur {
    fn default() -> Self {
        GaussianBlur { kernel: 3, sigma: [0.1, 2.0], p: 0.0 }
    }
}

impl GaussianBlur {
    /// Checks the kernel, the sigma range and `p`.
    pub fn validate(&self) -> DataResult<()> {
        if self.kernel == 0 || self.kernel.is_multiple_of(2) {
            return Err(DataError::Config {
                field: "blur.kernel",
                reason: format!("must be odd and positive, got {}", self.kernel),
            });
        }
        let [s0, s1] = self.sigma;
        if !(s0 > 0.0 && s0 <= s1 && s1.is_finite()) {
            return Err(DataError::Config { field: "blur.sigma", reason: format!("needs 0 < min <= max, got [{s0}, {s1}]") });
        }
        check_probability("blur.p", self.p)
    }

    /// Blurs with probability `p` (the apply draw, then the sigma draw).
    pub fn apply(&self, img: &FloatImage, rng: &mut KeyedRng) -> FloatImage {
        let mut out = img.clone();
        self.apply_in_place(&mut out, rng);
        out
    }

    /// [`GaussianBlur::apply`] in place.
    pub fn apply_in_place(&self, img: &mut FloatImage, rng: &mut KeyedRng) {
        if !bernoulli(rng, self.p) {
            return;
        }
        let sigma = uniform(rng, self.sigma[0], self.sigma[1]);
        img.data = gaussian_blur(img, self.kernel, sigma).data;
    }
}

/// The normalised 1-D Gaussian of `kernel` taps (odd) and standard deviation `sigma`.
pub fn gaussian_kernel(kernel: usize, sigma: f64) -> Vec<f32> {
    let half = (kernel as f64 - 1.0) / 2.0;
    let raw: Vec<f64> = (0..kernel).map(|i| (-0.5 * ((i as f64 - half) / sigma).powi(2)).exp()).collect();
    let sum: f64 = raw.iter().sum();
    raw.iter().map(|v| (v / sum) as f32).collect()
}

/// Blurs with a separable Gaussian (`kernel` taps, odd), mirroring at the borders.
///
/// Each pass runs over whole rows: a row (or, for the vertical pass, the list of rows) is
/// mirrored once into a padded copy, then every tap adds `weight x shifted row` to the
/// output row, so the inner loop is a contiguous multiply-add the compiler vectorises. Each
/// output value still sums its taps in order from the first, as [`gaussian_blur_composed`]
/// does: the values are the same, bit for bit.
pub fn gaussian_blur(img: &FloatImage, kernel: usize, sigma: f64) -> FloatImage {
    let k = gaussian_kernel(kernel, sigma);
    let r = (kernel / 2) as isize;
    let (w, h, c) = (img.width, img.height, img.channels);
    let row_len = w * c;
    // Horizontal pass.
    let mut tmp = vec![-0.0f32; img.data.len()];
    let mut padded = vec![0f32; (w + kernel - 1) * c];
    for (src, out) in img.data.chunks_exact(row_len).zip(tmp.chunks_exact_mut(row_len)) {
        for (j, px) in padded.chunks_exact_mut(c).enumerate() {
            let x = reflect(j as isize - r, w);
            px.copy_from_slice(&src[x * c..(x + 1) * c]);
        }
        for (i, kv) in k.iter().enumerate() {
            for (o, v) in out.iter_mut().zip(&padded[i * c..i * c + row_len]) {
                *o += kv * v;
            }
        }
    }
    // Vertical pass.
    let mut data = vec![-0.0f32; img.data.len()];
    for (y, out) in data.chunks_exact_mut(row_len).enumerate() {
        for (i, kv) in k.iter().enumerate() {
            let row = reflect(y as isize + i as isize - r, h);
            for (o, v) in out.iter_mut().zip(&tmp[row * row_len..(row + 1) * row_len]) {
                *o += kv * v;
            }
        }
    }
    FloatImage { data, ..*img }
}

/// [`gaussian_blur`] written one output value at a time: the reference it is tested against.
pub fn gaussian_blur_composed(img: &FloatImage, kernel: usize, sigma: f64) -> FloatImage {
    let k = gaussian_kernel(kernel, sigma);
    let r = (kernel / 2) as isize;
    let (w, h, c) = (img.width, img.height, img.channels);
    let mut tmp = vec![0f32; img.data.len()];
    for y in 0..h {
        for x in 0..w {
            for ch in 0..c {
                let v: f32 = k
                    .iter()
                    .enumerate()
                    .map(|(i, kv)| kv * img.data[(y * w + reflect(x as isize + i as isize - r, w)) * c + ch])
                    .sum();
                tmp[(y * w + x) * c + ch] = v;
            }
        }
    }
    let mut data = vec![0f32; img.data.len()];
    for y in 0..h {
        for x in 0..w {
            for ch in 0..c {
                let v: f32 = k
                    .iter()
                    .enumerate()
                    .map(|(i, kv)| kv * tmp[(reflect(y as isize + i as isize - r, h) * w + x) * c + ch])
                    .sum();
                data[(y * w + x) * c + ch] = v;
            }
        }
    }
    FloatImage { data, ..*img }
}

/// Index `i` mirrored into `0..n` without repeating the edge (… 2 1 | 0 1 2 … n-1 | n-2 …),
/// for any `i`, also when the kernel is wider than the image.
fn reflect(i: isize, n: usize) -> usize {
    if n == 1 {
        return 0;
    }
    let period = 2 * (n as isize - 1);
    let m = i.rem_euclid(period);
    (if m >= n as isize { period - m } else { m }) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_and_reflection() {
        let k = gaussian_kernel(3, 1.0);
        // exp(-0.5) / (1 + 2 exp(-0.5)) = 0.274068619, 1 / (1 + 2 exp(-0.5)) = 0.451862762.
        assert!((k[0] - 0.274_068_6).abs() < 1e-6 && (k[1] - 0.451_862_76).abs() < 1e-6 && k[0] == k[2], "{k:?}");
        let idx: Vec<usize> = (-3..6).map(|i| reflect(i, 3)).collect();
        assert_eq!(idx, [1, 2, 1, 0, 1, 2, 1, 0, 1]);
        assert_eq!(reflect(-7, 1), 0);
    }

    #[test]
    fn row_blur_equals_the_composed_blur_bit_for_bit() {
        // Values of both signs (the sums' first term decides the sign of a zero), kernels
        // narrower and wider than the image, one and three channels.
        for (w, h, c) in [(13, 9, 3), (5, 17, 1), (2, 3, 3), (1, 1, 1)] {
            let data = (0..w * h * c).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 0.4).max(-0.0)).collect();
            let img = FloatImage { width: w, height: h, channels: c, data };
            for (kernel, sigma) in [(3, 0.7), (5, 1.3), (23, 2.0), (9, 0.1)] {
                let (a, b) = (gaussian_blur(&img, kernel, sigma), gaussian_blur_composed(&img, kernel, sigma));
                assert!(a.data.iter().zip(&b.data).all(|(x, y)| x.to_bits() == y.to_bits()), "{w}x{h}x{c}, {kernel} taps");
            }
        }
    }

    #[test]
    fn blur_keeps_constants_and_mass_and_spreads_a_point() {
        let flat = FloatImage { width: 5, height: 4, channels: 3, data: vec![0.7; 60] };
        assert!(gaussian_blur(&flat, 5, 1.3).data.iter().all(|v| (v - 0.7).abs() < 1e-6));
        // A centred point on a 5x5 image with a 3-tap kernel stays inside: sum preserved,
        // value = outer product of the kernel.
        let mut data = vec![0f32; 25];
        data[12] = 1.0;
        let point = FloatImage { width: 5, height: 5, channels: 1, data };
        let b = gaussian_blur(&point, 3, 1.0);
        let k = gaussian_kernel(3, 1.0);
        assert!((b.data.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!((b.at(2, 2, 0) - k[1] * k[1]).abs() < 1e-6 && (b.at(1, 2, 0) - k[0] * k[1]).abs() < 1e-6);
        // A kernel wider than the image does not panic.
        let tiny = FloatImage { width: 2, height: 1, channels: 1, data: vec![0.0, 1.0] };
        assert_eq!(gaussian_blur(&tiny, 9, 2.0).data.len(), 2);
        assert!(GaussianBlur { kernel: 4, ..Default::default() }.validate().is_err());
        assert!(GaussianBlur { sigma: [0.0, 1.0], ..Default::default() }.validate().is_err());
    }
}
