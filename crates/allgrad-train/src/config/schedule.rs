//! Learning-rate schedules, evaluated per optimizer step.

use serde::{Deserialize, Serialize};

/// The `schedule` section: linear warmup, then cosine or linear decay (or constant).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ScheduleConfig {
    /// Steps of linear warmup from 0 to the peak learning rate.
    pub warmup_steps: usize,
    /// What follows the warmup.
    pub decay: Decay,
    /// Learning rate at the end, as a fraction of the peak.
    pub final_fraction: f64,
    /// Scale the optimizer's `lr` by global_batch / 256 (the SimCLR / BarlowTwins rule).
    pub scale_by_batch: bool,
}

/// The decay after warmup.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Decay {
    /// Half a cosine from the peak to `final_fraction` of it.
    Cosine,
    /// A straight line from the peak to `final_fraction` of it (BERT's and SimCSE's).
    Linear,
    /// Keep the peak.
    Constant,
}

impl Default for ScheduleConfig {
    fn default() -> Self {
        ScheduleConfig { warmup_steps: 0, decay: Decay::Cosine, final_fraction: 0.0, scale_by_batch: false }
    }
}

impl ScheduleConfig {
    /// The learning rate at `step` (0-based) of `total` steps, for a base rate `lr` and a
    /// global batch of `global_batch`.
    pub fn lr(&self, lr: f64, step: usize, total: usize, global_batch: usize) -> f64 {
        let peak = if self.scale_by_batch { lr * global_batch as f64 / 256.0 } else { lr };
        if step < self.warmup_steps {
            return peak * (step + 1) as f64 / self.warmup_steps as f64;
        }
        let span = total.saturating_sub(self.warmup_steps).max(1);
        let t = ((step - self.warmup_steps) as f64 / span as f64).min(1.0);
        let low = peak * self.final_fraction;
        match self.decay {
            Decay::Constant => peak,
            Decay::Cosine => low + (peak - low) * 0.5 * (1.0 + (std::f64::consts::PI * t).cos()),
            Decay::Linear => peak - (peak - low) * t,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine() {
        let s = ScheduleConfig { warmup_steps: 4, decay: Decay::Cosine, final_fraction: 0.1, scale_by_batch: true };
        assert_eq!(s.lr(1.0, 0, 14, 512), 0.5);
        assert_eq!(s.lr(1.0, 3, 14, 512), 2.0);
        assert!((s.lr(1.0, 4, 14, 512) - 2.0).abs() < 1e-12);
        assert!((s.lr(1.0, 9, 14, 512) - (0.2 + 1.8 * 0.5)).abs() < 1e-12);
        assert!((s.lr(1.0, 14, 14, 512) - 0.2).abs() < 1e-12);
    }

    #[test]
    fn warmup_then_linear() {
        // Peak 2 after 2 warmup steps; 10 steps of decay to 0: steps 2, 7, 12 give 2, 1, 0.
        let s = ScheduleConfig { warmup_steps: 2, decay: Decay::Linear, final_fraction: 0.0, scale_by_batch: false };
        assert_eq!(s.lr(2.0, 0, 12, 64), 1.0);
        assert_eq!(s.lr(2.0, 2, 12, 64), 2.0);
        assert!((s.lr(2.0, 7, 12, 64) - 1.0).abs() < 1e-12);
        assert!((s.lr(2.0, 9, 12, 64) - 0.6).abs() < 1e-12);
        assert!(s.lr(2.0, 12, 12, 64).abs() < 1e-12);
    }
}
