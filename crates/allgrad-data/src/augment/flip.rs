//! Random horizontal flip.

use serde::{Deserialize, Serialize};

use crate::error::{DataError, DataResult};
use crate::image::FloatImage;
use crate::rng::{bernoulli, KeyedRng};

/// Mirror the image left-right with probability `p`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RandomHorizontalFlip {
    /// Probability of flipping, in [0, 1].
    pub p: f64,
}

impl Default for RandomHorizontalFlip {
    fn default() -> Self {
        RandomHorizontalFlip { p: 0.5 }
    }
}

impl RandomHorizontalFlip {
    /// Checks `p`.
    pub fn validate(&self) -> DataResult<()> {
        check_probability("flip.p", self.p)
    }

    /// Flips with probability `p` (one draw from `rng`).
    pub fn apply(&self, img: &FloatImage, rng: &mut KeyedRng) -> FloatImage {
        let mut out = img.clone();
        self.apply_in_place(&mut out, rng);
        out
    }

    /// [`RandomHorizontalFlip::apply`] in place.
    pub fn apply_in_place(&self, img: &mut FloatImage, rng: &mut KeyedRng) {
        if bernoulli(rng, self.p) {
            let c = img.channels;
            for row in img.data.chunks_exact_mut(img.width * c) {
                let w = row.len() / c;
                for x in 0..w / 2 {
                    for k in 0..c {
                        row.swap(x * c + k, (w - 1 - x) * c + k);
                    }
                }
            }
        }
    }
}

/// The image mirrored left-right: column x goes to column width - 1 - x.
pub fn hflip(img: &FloatImage) -> FloatImage {
    let c = img.channels;
    let mut data = Vec::with_capacity(img.data.len());
    for row in img.data.chunks_exact(img.width * c) {
        for px in row.chunks_exact(c).rev() {
            data.extend_from_slice(px);
        }
    }
    FloatImage { data, ..*img }
}

pub(crate) fn check_probability(field: &'static str, p: f64) -> DataResult<()> {
    if (0.0..=1.0).contains(&p) {
        Ok(())
    } else {
        Err(DataError::Config { field, reason: format!("a probability must be in [0, 1], got {p}") })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::stream;

    #[test]
    fn flip_mirrors_a_hand_made_image() {
        // 3x2 RGB, pixel (x, y) = (x, y, 7).
        let data = (0..2).flat_map(|y| (0..3).flat_map(move |x| [x as f32, y as f32, 7.0])).collect();
        let img = FloatImage { width: 3, height: 2, channels: 3, data };
        let f = hflip(&img);
        #[rustfmt::skip]
        let expect = vec![2., 0., 7., 1., 0., 7., 0., 0., 7.,
                          2., 1., 7., 1., 1., 7., 0., 1., 7.];
        assert_eq!(f.data, expect);
        assert_eq!(hflip(&f), img);
        let always = RandomHorizontalFlip { p: 1.0 };
        let never = RandomHorizontalFlip { p: 0.0 };
        assert_eq!(always.apply(&img, &mut stream(&[0])), f);
        assert_eq!(never.apply(&img, &mut stream(&[0])), img);
        assert!(RandomHorizontalFlip { p: 1.5 }.validate().is_err());
    }
}
