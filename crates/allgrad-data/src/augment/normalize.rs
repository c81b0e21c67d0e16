//! Per-channel normalisation into a CHW float sample.

use serde::{Deserialize, Serialize};

use crate::error::{DataError, DataResult};
use crate::image::{Chw, FloatImage};

/// `(x - mean[c]) / std[c]` per channel, on values in [0, 1], giving the CHW f32 sample
/// (torchvision's `ToTensor` then `Normalize`). One value in `mean`/`std` applies to every
/// channel; otherwise give one per channel. The defaults are the CIFAR-10 training-set
/// statistics; for Fashion-MNIST (one channel) use mean `[0.2860]`, std `[0.3530]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Normalize {
    /// Mean of each channel, in [0, 1] units.
    pub mean: Vec<f32>,
    /// Standard deviation of each channel, > 0.
    pub std: Vec<f32>,
}

impl Default for Normalize {
    fn default() -> Self {
        Normalize { mean: vec![0.4914, 0.4822, 0.4465], std: vec![0.2470, 0.2435, 0.2616] }
    }
}

impl Normalize {
    /// No change: mean 0, std 1.
    pub fn identity() -> Self {
        Normalize { mean: vec![0.0], std: vec![1.0] }
    }

    /// Checks that `mean` and `std` have the same, non-zero length and that every std is
    /// positive and finite.
    pub fn validate(&self) -> DataResult<()> {
        if self.mean.is_empty() || self.mean.len() != self.std.len() {
            return Err(DataError::Config {
                field: "normalize",
                reason: format!(
                    "mean has {} values and std {}; give the same number (1 or one per channel)",
                    self.mean.len(),
                    self.std.len()
                ),
            });
        }
        if let Some(s) = self.std.iter().find(|s| !(**s > 0.0 && s.is_finite())) {
            return Err(DataError::Config {
                field: "normalize.std",
                reason: format!("every std must be > 0 and finite, got {s}"),
            });
        }
        if let Some(m) = self.mean.iter().find(|m| !m.is_finite()) {
            return Err(DataError::Config { field: "normalize.mean", reason: format!("every mean must be finite, got {m}") });
        }
        Ok(())
    }

    /// The normalised CHW sample.
    pub fn apply(&self, img: &FloatImage) -> DataResult<Chw> {
        let stats = self.mean.len();
        if stats != 1 && stats != img.channels {
            return Err(DataError::NormalizeChannels { stats, channels: img.channels });
        }
        // Straight into channels-first order: one pass over the pixels per channel.
        let (w, h, c) = (img.width, img.height, img.channels);
        let plane = w * h;
        let mut data = vec![0f32; plane * c];
        for (ch, out) in data.chunks_exact_mut(plane.max(1)).enumerate().take(c) {
            let k = if stats == 1 { 0 } else { ch };
            let (m, s) = (self.mean[k], self.std[k]);
            for (o, px) in out.iter_mut().zip(img.data.chunks_exact(c)) {
                *o = (px[ch] - m) / s;
            }
        }
        Ok(Chw { channels: c, height: h, width: w, data })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalisation_numerics() {
        // 2x1 RGB: pixels (0, 0.5, 1) and (1, 0.25, 0).
        let img = FloatImage { width: 2, height: 1, channels: 3, data: vec![0.0, 0.5, 1.0, 1.0, 0.25, 0.0] };
        let n = Normalize { mean: vec![0.5, 0.25, 0.0], std: vec![0.5, 0.25, 2.0] };
        let chw = n.apply(&img).unwrap();
        assert_eq!(chw.shape(), (3, 1, 2));
        assert_eq!(chw.data, vec![-1.0, 1.0, 1.0, 0.0, 0.5, 0.0]);
        let one = Normalize { mean: vec![0.5], std: vec![0.5] };
        assert_eq!(one.apply(&img).unwrap().data, vec![-1.0, 1.0, 0.0, -0.5, 1.0, -1.0]);
        let gray = FloatImage { width: 1, height: 1, channels: 1, data: vec![0.5] };
        assert!(matches!(n.apply(&gray), Err(DataError::NormalizeChannels { stats: 3, channels: 1 })));
        assert_eq!(Normalize::identity().apply(&gray).unwrap().data, vec![0.5]);
        assert!(Normalize { mean: vec![0.5], std: vec![0.0] }.validate().is_err());
        assert!(Normalize { mean: vec![0.5, 0.5], std: vec![1.0] }.validate().is_err());
        assert!(Normalize::default().validate().is_ok());
    }
}
