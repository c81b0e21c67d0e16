//! Margins on the target logit: ArcFace (additive angular), CosFace (additive cosine) and
//! the combined form `cos(m1·θ + m2) − m3`, all scaled by `s`.
//!
//! # The margin is differentiated
//!
//! insightface's `arcface_torch` applies the angular margin under `torch.no_grad()`: the
//! gradient reaching the cosine of the target class is the gradient of the margined logit,
//! as if the margin were the identity. Here the margin is an ordinary part of the loss: the
//! target cosine `t = cos θ` receives `f'(t)` times the gradient of `f(t)`, the derivative of
//! the function actually applied (tested against finite differences). For CosFace (`m1 = 1`,
//! `m2 = 0`) the two agree (`f' = 1`).
//!
//! # θ + m past π
//!
//! `cos(m1·θ + m2)` stops decreasing in θ once `m1·θ + m2 > π`, so a sample far from its
//! class would be pushed less the further it is. As in the original ArcFace code, beyond that
//! point (`t < cos((π − m2)/m1)`) the logit is `t − m3 − m2·sin(m2)` instead (CosFace-like,
//! slope 1). Cosines are clamped to `[−1, 1]` before the margin (rounding can pass 1), and
//! `sin θ` is floored at [`SIN_FLOOR`] in the slope, whose true value is infinite at `t = ±1`
//! when `m2 ≠ 0`.

use candle_core::{DType, Result, Tensor};
use serde::{Deserialize, Serialize};

use crate::ModelError;

/// Smallest `sin θ` used in the margin's slope (see the module docs).
pub const SIN_FLOOR: f64 = 1e-6;

fn default_s() -> f64 {
    64.0
}
fn default_arc_m() -> f64 {
    0.5
}
fn default_cos_m() -> f64 {
    0.4
}
fn one() -> f64 {
    1.0
}

/// The `head.margin` section.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum MarginConfig {
    /// ArcFace: `s · cos(θ + m)` (defaults s 64, m 0.5).
    Arcface {
        /// Angular margin, in radians.
        #[serde(default = "default_arc_m")]
        m: f64,
        /// Scale of the logits.
        #[serde(default = "default_s")]
        s: f64,
    },
    /// CosFace: `s · (cos θ − m)` (defaults s 64, m 0.4).
    Cosface {
        /// Cosine margin.
        #[serde(default = "default_cos_m")]
        m: f64,
        /// Scale of the logits.
        #[serde(default = "default_s")]
        s: f64,
    },
    /// `s · (cos(m1·θ + m2) − m3)` (insightface's combined margin).
    Combined {
        /// Multiplicative angular margin.
        #[serde(default = "one")]
        m1: f64,
        /// Additive angular margin.
        #[serde(default)]
        m2: f64,
        /// Additive cosine margin.
        #[serde(default)]
        m3: f64,
        /// Scale of the logits.
        #[serde(default = "default_s")]
        s: f64,
    },
}

impl Default for MarginConfig {
    fn default() -> Self {
        MarginConfig::Arcface { m: default_arc_m(), s: default_s() }
    }
}

impl MarginConfig {
    /// The margin as `(m1, m2, m3, s)`.
    pub fn margin(&self) -> Margin {
        match *self {
            MarginConfig::Arcface { m, s } => Margin { m1: 1.0, m2: m, m3: 0.0, s },
            MarginConfig::Cosface { m, s } => Margin { m1: 1.0, m2: 0.0, m3: m, s },
            MarginConfig::Combined { m1, m2, m3, s } => Margin { m1, m2, m3, s },
        }
    }
}

/// `f(t) = cos(m1·acos t + m2) − m3` with the handling of the module docs; logits are
/// `s · f(t)` for the target class and `s · t` for the others.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Margin {
    /// Multiplicative angular margin.
    pub m1: f64,
    /// Additive angular margin.
    pub m2: f64,
    /// Additive cosine margin.
    pub m3: f64,
    /// Scale.
    pub s: f64,
}

impl Margin {
    /// Checks the values: `s > 0`, `m1 > 0`, `0 ≤ m2 < π`, `m3` finite.
    pub fn validate(&self) -> std::result::Result<(), ModelError> {
        let bad = |key: &'static str, value: f64, expected: &'static str| ModelError::HeadValue { key, value, expected };
        if !(self.s.is_finite() && self.s > 0.0) {
            return Err(bad("margin.s", self.s, "a positive number"));
        }
        if !(self.m1.is_finite() && self.m1 > 0.0) {
            return Err(bad("margin.m1", self.m1, "a positive number"));
        }
        if !(self.m2.is_finite() && (0.0..std::f64::consts::PI).contains(&self.m2)) {
            return Err(bad("margin.m2 (or m)", self.m2, "in [0, π)"));
        }
        if !self.m3.is_finite() {
            return Err(bad("margin.m3 (or m)", self.m3, "finite"));
        }
        Ok(())
    }

    /// Whether `f` is `t − m3` (no angular part): no arccosine is needed.
    fn is_cosine_only(&self) -> bool {
        self.m1 == 1.0 && self.m2 == 0.0
    }

    /// `f(t)` and `f'(t)` of a cosine (clamped to `[−1, 1]` first).
    pub fn value_and_slope(&self, t: f64) -> (f64, f64) {
        let t = t.clamp(-1.0, 1.0);
        if self.is_cosine_only() {
            return (t - self.m3, 1.0);
        }
        let theta = t.acos();
        let u = self.m1 * theta + self.m2;
        if u > std::f64::consts::PI {
            return (t - self.m3 - self.m2 * self.m2.sin(), 1.0);
        }
        let sin_theta = (1.0 - t * t).max(0.0).sqrt().max(SIN_FLOOR);
        (u.cos() - self.m3, self.m1 * u.sin() / sin_theta)
    }

    /// `f` applied to every element of `t` (any shape), differentiable: the result carries
    /// `f(t)` and passes `f'(t)` times its gradient back to `t`. Computed in f64 on the host;
    /// on a device (and the CPU's device path) with tensor ops in `t`'s dtype, without reading
    /// `t`, for CosFace and ArcFace (`m1 = 1`); the combined form with `m1 ≠ 1` needs an
    /// arccosine, which Candle has no op for, and reads `t`.
    pub fn apply(&self, t: &Tensor) -> Result<Tensor> {
        if self.m1 == 1.0 && allgrad_nn::transfer::takes_device_path(t.device()) {
            return self.apply_on_device(t);
        }
        let t0 = t.detach();
        let values = t0.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
        let (f, slope): (Vec<f64>, Vec<f64>) = values.iter().map(|v| self.value_and_slope(*v)).unzip();
        let as_t = |v: Vec<f64>| Tensor::from_vec(v, t.shape(), t.device())?.to_dtype(t.dtype());
        // f(t0) + f'(t0)·(t − t0): the value is f(t0) exactly (t − t0 is 0), the gradient f'(t0).
        as_t(f)? + (as_t(slope)? * (t - &t0)?)?
    }

    /// [`Margin::apply`] for `m1 = 1` with tensor ops: `f(t) = t·cos m2 − sinθ·sin m2 − m3`
    /// (`sinθ = √(1 − t²)`) where `θ + m2 ≤ π` (`t ≥ −cos m2`), `t − m3 − m2·sin m2` beyond;
    /// the slope `sin(θ + m2) / max(sinθ, SIN_FLOOR)` (1 beyond), as the host computes them. Every
    /// constant is made on the device from `t` (`0·t + c`), never uploaded.
    fn apply_on_device(&self, t: &Tensor) -> Result<Tensor> {
        let t0 = t.detach();
        if self.is_cosine_only() {
            return t.affine(1.0, -self.m3);
        }
        let (cos_m, sin_m) = (self.m2.cos(), self.m2.sin());
        let constant = |c: f64| t0.affine(0.0, c);
        let sin_theta = t0.sqr()?.affine(-1.0, 1.0)?.relu()?.sqrt()?;
        let value = (t0.affine(cos_m, -self.m3)? - sin_theta.affine(sin_m, 0.0)?)?;
        let floored = (sin_theta.affine(1.0, -SIN_FLOOR)?.relu()? + constant(SIN_FLOOR)?)?;
        let slope = (sin_theta.affine(cos_m, 0.0)? + t0.affine(sin_m, 0.0)?)?.div(&floored)?;
        let beyond = t0.lt(&constant(-cos_m)?)?;
        let value = beyond.where_cond(&t0.affine(1.0, -self.m3 - self.m2 * sin_m)?, &value)?;
        let slope = beyond.where_cond(&constant(1.0)?, &slope)?;
        // f(t0) + f'(t0)·(t − t0), as on the host.
        value + (slope * (t - &t0)?)?
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn arcface_cosface_and_combined_values_follow_their_formulas() {
        let arc = MarginConfig::default().margin();
        let t = 0.6f64;
        assert!((arc.value_and_slope(t).0 - (t.acos() + 0.5).cos()).abs() < 1e-15);
        let cos = MarginConfig::Cosface { m: 0.4, s: 64.0 }.margin();
        assert_eq!(cos.value_and_slope(t), (t - 0.4, 1.0));
        let comb = MarginConfig::Combined { m1: 1.2, m2: 0.3, m3: 0.1, s: 30.0 }.margin();
        assert!((comb.value_and_slope(t).0 - ((1.2 * t.acos() + 0.3).cos() - 0.1)).abs() < 1e-15);
        // Past π: θ = acos(−0.95) ≈ 2.82 rad, θ + 0.5 > π.
        let far = -0.95;
        assert_eq!(arc.value_and_slope(far), (far - 0.5 * 0.5f64.sin(), 1.0));
        // Clamped above 1: rounding past 1 gives the value at 1.
        assert_eq!(arc.value_and_slope(1.0 + 1e-12).0, arc.value_and_slope(1.0).0);
        assert!(arc.validate().is_ok());
        assert!(Margin { s: 0.0, ..arc }.validate().is_err());
        assert!(Margin { m2: 4.0, ..arc }.validate().is_err());
    }

    #[test]
    fn slope_and_autograd_match_central_differences() {
        let h = 1e-6;
        for m in [
            MarginConfig::default().margin(),
            MarginConfig::Combined { m1: 1.3, m2: 0.2, m3: 0.15, s: 64.0 }.margin(),
            MarginConfig::Cosface { m: 0.35, s: 64.0 }.margin(),
        ] {
            let ts = [-0.9, -0.5, 0.0, 0.3, 0.7, 0.95];
            let x = Var::from_vec(ts.to_vec(), ts.len(), &Device::Cpu).unwrap();
            let y = m.apply(x.as_tensor()).unwrap();
            // Weighted sum so every element has its own upstream gradient.
            let w = Tensor::new(&[1.0f64, -2.0, 0.5, 3.0, -1.5, 2.5], &Device::Cpu).unwrap();
            let g = (y * &w).unwrap().sum_all().unwrap().backward().unwrap();
            let got = g.get(&x).unwrap().to_vec1::<f64>().unwrap();
            let wv = w.to_vec1::<f64>().unwrap();
            let slopes: Vec<f64> = got.iter().zip(&wv).map(|(g, w)| g / w).collect();
            let fd: Vec<f64> = ts.iter().map(|t| (m.value_and_slope(t + h).0 - m.value_and_slope(t - h).0) / (2.0 * h)).collect();
            allgrad_testkit::close::assert_rel(&slopes, &fd, 1e-6, &format!("{m:?}: slopes vs central differences"));
        }
    }
}
