//! The `optim` section: which optimizer (SGD, LARS, AdamW) with its hyperparameters, and
//! their checks (the optimizer itself: `crate::optim`).

use serde::{Deserialize, Serialize};

/// The `optim` section.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum OptimConfig {
    /// Stochastic gradient descent.
    Sgd {
        /// Peak learning rate (see the schedule for warmup, decay and batch scaling).
        lr: f64,
        /// Momentum (0 disables it).
        #[serde(default)]
        momentum: f64,
        /// Nesterov momentum.
        #[serde(default)]
        nesterov: bool,
        /// L2 weight decay added to the gradient.
        #[serde(default)]
        weight_decay: f64,
    },
    /// Layer-wise adaptive rate scaling (as used by SimCLR and BarlowTwins): each weight's
    /// update is scaled by `trust_coefficient * |w| / |g + wd w|`.
    Lars {
        /// Peak learning rate.
        lr: f64,
        /// Momentum.
        #[serde(default = "default_momentum")]
        momentum: f64,
        /// Weight decay (not applied to excluded parameters).
        #[serde(default)]
        weight_decay: f64,
        /// The trust coefficient (eta).
        #[serde(default = "default_trust")]
        trust_coefficient: f64,
        /// Exclude biases and normalisation parameters (every 1-D parameter) from adaptation
        /// and weight decay. Kept for older configs: `false` has the effect of
        /// `param_groups.exclude_1d: false` on a LARS run (the two must both be true to exclude).
        #[serde(default = "yes")]
        exclude_1d: bool,
    },
    /// Adam with decoupled weight decay.
    Adamw {
        /// Peak learning rate.
        lr: f64,
        /// First-moment decay.
        #[serde(default = "default_beta1")]
        beta1: f64,
        /// Second-moment decay.
        #[serde(default = "default_beta2")]
        beta2: f64,
        /// Denominator guard.
        #[serde(default = "default_eps")]
        eps: f64,
        /// Decoupled weight decay.
        #[serde(default = "default_adamw_wd")]
        weight_decay: f64,
    },
}

fn default_momentum() -> f64 {
    0.9
}
fn default_trust() -> f64 {
    0.001
}
fn yes() -> bool {
    true
}
fn default_beta1() -> f64 {
    0.9
}
fn default_beta2() -> f64 {
    0.999
}
fn default_eps() -> f64 {
    1e-8
}
fn default_adamw_wd() -> f64 {
    0.01
}

impl Default for OptimConfig {
    fn default() -> Self {
        OptimConfig::Sgd { lr: 0.1, momentum: 0.9, nesterov: false, weight_decay: 0.0 }
    }
}

impl OptimConfig {
    /// The configured peak learning rate.
    pub fn lr(&self) -> f64 {
        match self {
            OptimConfig::Sgd { lr, .. } | OptimConfig::Lars { lr, .. } | OptimConfig::Adamw { lr, .. } => *lr,
        }
    }

    /// The configured weight decay (the default rule's: see the `param_groups` section).
    pub fn weight_decay(&self) -> f64 {
        match self {
            OptimConfig::Sgd { weight_decay, .. }
            | OptimConfig::Lars { weight_decay, .. }
            | OptimConfig::Adamw { weight_decay, .. } => *weight_decay,
        }
    }

    /// This config with weight decay `wd` (a parameter group's).
    pub fn with_weight_decay(&self, wd: f64) -> OptimConfig {
        let mut c = self.clone();
        match &mut c {
            OptimConfig::Sgd { weight_decay, .. }
            | OptimConfig::Lars { weight_decay, .. }
            | OptimConfig::Adamw { weight_decay, .. } => *weight_decay = wd,
        }
        c
    }

    /// Checks the values; the message names the key.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let lr = self.lr();
        if !(lr.is_finite() && lr > 0.0) {
            return Err(format!("optim.lr must be a positive number, got {lr}"));
        }
        let check = |name: &str, v: f64, lo: f64, hi: f64| {
            if v.is_finite() && v >= lo && v < hi {
                Ok(())
            } else {
                Err(format!("optim.{name} must be in [{lo}, {hi}), got {v}"))
            }
        };
        match self {
            OptimConfig::Sgd { momentum, weight_decay, .. } => {
                check("momentum", *momentum, 0.0, 1.0)?;
                check("weight_decay", *weight_decay, 0.0, f64::INFINITY)
            }
            OptimConfig::Lars { momentum, weight_decay, trust_coefficient, .. } => {
                check("momentum", *momentum, 0.0, 1.0)?;
                check("weight_decay", *weight_decay, 0.0, f64::INFINITY)?;
                check("trust_coefficient", *trust_coefficient, f64::MIN_POSITIVE, f64::INFINITY)
            }
            OptimConfig::Adamw { beta1, beta2, eps, weight_decay, .. } => {
                check("beta1", *beta1, 0.0, 1.0)?;
                check("beta2", *beta2, 0.0, 1.0)?;
                check("eps", *eps, f64::MIN_POSITIVE, f64::INFINITY)?;
                check("weight_decay", *weight_decay, 0.0, f64::INFINITY)
            }
        }
    }
}
