//! `exp` and `erf` over f32 slices, written so that the compiler vectorises them.
//!
//! The standard library's `f32::exp` is a call into the C library per element, and Candle's
//! `erf` (the `libm` crate's) is a branchy scalar routine: in a BERT training step the GELU's
//! erf alone took about a sixth of the CPU time. These are straight-line formulas of IEEE
//! operations (no table, no branch, no fused multiply-add) that LLVM vectorises: with AVX-512 or
//! AVX2 on CPUs that have them (detected at run time, `crate::simd`), with SSE2 otherwise. Every
//! path performs the same operations in the same order, so results do not depend on the CPU. Hand-written because no
//! crate in this project's dependencies offers vectorised `exp`/`erf`.
//!
//! - `exp`: Cody–Waite reduction `x = n·ln2 + r`, `|r| ≤ ln2/2`, then Cephes' degree-6
//!   polynomial for `e^r` (S. L. Moshier), scaled by `2^n` through the exponent bits. Inputs
//!   above 88 are clamped to 88 (the result stays finite), inputs below -87 give 0 (the exact
//!   value is below 1.7e-38, subnormal from -87.3 on), so a softmax over masked scores gives
//!   those exactly 0; NaN stays NaN. Relative error a few units in the last place (the tests
//!   bound it).
//! - `erf`, odd in `x`: for `|x| < 0.84` its Taylor series `2/√π · Σ (−1)^n x^(2n+1)/(n!(2n+1))`
//!   to `n = 9` (truncation below 1e-9); beyond, Abramowitz & Stegun 7.1.26 (C. Hastings,
//!   1955), `1 − t·P(t)·e^(−x²)` with `t = 1/(1 + p|x|)`, whose bound is 1.5e-7. Both are
//!   evaluated and one is selected, so the loop has no branch. Absolute error in f32 arithmetic
//!   at most 2.4e-7 (the tests bound it by 3e-7; A&S alone near 0 reaches 5.3e-7, as its
//!   `1 − …` cancels).

use std::mem::MaybeUninit;

/// Clamp bounds keeping `2^n` a normal f32 exponent.
const EXP_LO: f32 = -87.0;
const EXP_HI: f32 = 88.0;
/// `1.5·2^23`: adding it rounds a float below `2^22` to an integer held in the low bits.
const ROUND: f32 = 12_582_912.0;
const LOG2E: f32 = std::f32::consts::LOG2_E;
// The constants below keep their published digits (rounded to f32 by the compiler).
/// `ln 2` split so that `n·LN2_HI` is exact for the `n` in range.
const LN2_HI: f32 = 355.0 / 512.0;
#[allow(clippy::excessive_precision)]
const LN2_LO: f32 = -2.121_944_40e-4;
/// Cephes `expf` polynomial coefficients.
#[allow(clippy::excessive_precision)]
const EXP_P: [f32; 6] =
    [1.987_569_150_0e-4, 1.398_199_950_7e-3, 8.333_451_907_3e-3, 4.166_579_589_4e-2, 1.666_666_545_9e-1, 5.000_000_120_1e-1];
/// Abramowitz & Stegun 7.1.26.
#[allow(clippy::excessive_precision)]
const ERF_P: f32 = 0.327_591_1;
#[allow(clippy::excessive_precision)]
const ERF_A: [f32; 5] = [0.254_829_592, -0.284_496_736, 1.421_413_741, -1.453_152_027, 1.061_405_429];
/// Below this `|x|` the Taylor series is used.
const ERF_TAYLOR_MAX: f32 = 0.84;
/// `2/√π · (−1)^n / (n!·(2n+1))`, n = 0..=9.
#[allow(clippy::excessive_precision)]
const ERF_TAYLOR: [f32; 10] = [
    std::f32::consts::FRAC_2_SQRT_PI,
    -0.376_126_389_031_837_54,
    0.112_837_916_709_551_26,
    -0.026_866_170_645_131_252,
    0.005_223_977_625_442_188,
    -0.000_854_832_702_345_085_2,
    0.000_120_553_329_817_896_64,
    -1.492_565_035_840_625e-5,
    1.646_211_436_588_924_6e-6,
    -1.636_584_469_123_492_4e-7,
];

#[inline(always)]
fn exp_one(x: f32) -> f32 {
    // Below the clamp the exact value is under 1.7e-38 (subnormal from -87.3): flush it to 0
    // (a select the compiler vectorises). `clamp` keeps NaN a NaN, and so does the flush (`NaN < EXP_LO` is false).
    let flush = x < EXP_LO;
    let x = x.clamp(EXP_LO, EXP_HI);
    let shifted = x * LOG2E + ROUND;
    let n = shifted - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let [p0, p1, p2, p3, p4, p5] = EXP_P;
    let poly = (((((p0 * r + p1) * r + p2) * r + p3) * r + p4) * r + p5) * (r * r) + r + 1.0;
    // The low bits of `shifted` hold n + 2^22 (mod 2^23); subtracting the bits of ROUND
    // itself leaves n as a two's-complement integer.
    let n_int = shifted.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
    // n is in [-126, 127] after the clamp, so n + 127 never overflows; `wrapping_add` says so
    // to the compiler: a checked add (debug builds, tests) is a possible panic that keeps
    // LLVM from vectorising the loop, which then runs scalar. The release code is the same.
    let y = poly * f32::from_bits((n_int.wrapping_add(127) as u32) << 23);
    if flush {
        0.0
    } else {
        y
    }
}

#[inline(always)]
fn erf_one(x: f32) -> f32 {
    erf_and_gauss(x).0
}

/// `(erf(x), e^(−x²))`: the exponential that erf's tail needs, returned beside it.
#[inline(always)]
fn erf_and_gauss(x: f32) -> (f32, f32) {
    let (a, s) = (x.abs(), x * x);
    let series = ERF_TAYLOR.iter().rev().fold(0.0, |q, &c| q * s + c) * a;
    let t = 1.0 / (1.0 + ERF_P * a);
    let [a1, a2, a3, a4, a5] = ERF_A;
    let poly = ((((a5 * t + a4) * t + a3) * t + a2) * t + a1) * t;
    let gauss = exp_one(-s);
    let tail = 1.0 - poly * gauss;
    ((if a < ERF_TAYLOR_MAX { series } else { tail }).copysign(x), gauss)
}

/// `x/2 · (1 + erf(x/√2))`.
#[inline(always)]
fn gelu_one(x: f32) -> f32 {
    0.5 * x * (1.0 + erf_one(x * std::f32::consts::FRAC_1_SQRT_2))
}

/// `GELU'(x) = (1 + erf(x/√2))/2 + x·φ(x)` with the normal density `φ(x) = e^(−x²/2)/√(2π)`,
/// whose exponential is erf's own `e^(−u²)` at `u = x/√2`: one exponential per element.
#[inline(always)]
fn gelu_grad_one(x: f32) -> f32 {
    let inv_sqrt_2pi = (1.0 / (2.0 * std::f64::consts::PI).sqrt()) as f32;
    let (erf, gauss) = erf_and_gauss(x * std::f32::consts::FRAC_1_SQRT_2);
    0.5 * (1.0 + erf) + x * gauss * inv_sqrt_2pi
}

/// `o[i] = GELU(x[i])` at `level`, one pass (`o` written, never read).
pub(crate) fn gelu_at(level: crate::simd::SimdPlan, o: &mut [MaybeUninit<f32>], xs: &[f32]) {
    crate::simd::dispatch!(
        level,
        fn each(o: &mut [MaybeUninit<f32>], xs: &[f32]) {
            o.iter_mut().zip(xs).for_each(|(o, &x)| {
                o.write(gelu_one(x));
            });
        }
    )
}

/// `o[i] = g[i] · GELU'(x[i])` at `level`, one pass (`o` written, never read).
pub(crate) fn gelu_grad_at(level: crate::simd::SimdPlan, o: &mut [MaybeUninit<f32>], xs: &[f32], gs: &[f32]) {
    crate::simd::dispatch!(
        level,
        fn each(o: &mut [MaybeUninit<f32>], xs: &[f32], gs: &[f32]) {
            o.iter_mut().zip(xs.iter().zip(gs)).for_each(|(o, (&x, &g))| {
                o.write(g * gelu_grad_one(x));
            });
        }
    )
}

macro_rules! dispatched {
    ($(#[$doc:meta])* $name:ident, $at:ident, $one:ident) => {
        $(#[$doc])*
        pub fn $name(xs: &mut [f32]) {
            $at(crate::simd::active(), xs)
        }

        /// The same at a given level (the caller's [`crate::simd::simd_level`]).
        #[doc(hidden)]
        pub fn $at(level: crate::simd::SimdPlan, xs: &mut [f32]) {
            crate::simd::dispatch!(level, fn each(xs: &mut [f32]) {
                xs.iter_mut().for_each(|v| *v = $one(*v));
            })
        }
    };
}

dispatched!(
    /// `v ← e^v` for every element.
    exp_in_place,
    exp_at,
    exp_one
);
// The kernels use erf inside the GELU's passes; this slice form is the tests'.
#[cfg(test)]
dispatched!(
    /// `v ← erf(v)` for every element.
    erf_in_place,
    erf_at,
    erf_one
);

#[cfg(test)]
mod tests {
    use super::*;

    /// 400,001 points on [lo, hi].
    fn grid(lo: f64, hi: f64) -> Vec<f32> {
        (0..=400_000).map(|i| (lo + (hi - lo) * i as f64 / 400_000.0) as f32).collect()
    }

    #[test]
    fn exp_is_within_a_few_ulps_of_the_f64_exponential() {
        let xs = grid(-87.0, 88.0);
        let mut ys = xs.clone();
        exp_in_place(&mut ys);
        let worst = xs.iter().zip(&ys).map(|(&x, &y)| ((y as f64) / (x as f64).exp() - 1.0).abs()).fold(0.0, f64::max);
        // 2^-23 = 1.19e-7 is one unit in the last place at the top of a binade.
        assert!(worst < 3.0e-7, "exp: worst relative error {worst:e}");
        // Beyond the clamp: 0 below (where the exact value is at most 1.7e-38), no overflow
        // above, NaN stays NaN; just above the lower bound, a normal number.
        let mut edge = [-1000.0f32, -87.5, 1000.0, f32::NAN, 0.0, -86.9];
        exp_in_place(&mut edge);
        let [low, below, high, nan, one, normal] = edge;
        assert!(low == 0.0 && below == 0.0 && high.is_finite() && nan.is_nan() && one == 1.0, "{edge:?}");
        assert!(normal.is_normal() && ((normal as f64) / f64::from(-86.9f32).exp() - 1.0).abs() < 3e-7, "{edge:?}");
    }

    #[test]
    fn erf_is_within_its_published_bound_of_the_exact_function() {
        let xs = grid(-6.0, 6.0);
        let mut ys = xs.clone();
        erf_in_place(&mut ys);
        let worst =
            xs.iter().zip(&ys).map(|(&x, &y)| (y as f64 - candle_core::cpu::erf::erf_f64(x as f64)).abs()).fold(0.0, f64::max);
        // Measured 2.4e-7 (A&S's 1.5e-7 bound plus f32 evaluation); one f32 unit at 1 is 1.2e-7.
        assert!(worst < 3e-7, "erf: worst absolute error {worst:e}");
        // Near 0 the series keeps the error relative: erf(x) ≈ 1.128·x.
        let small = grid(-0.01, 0.01);
        let mut ys = small.clone();
        erf_in_place(&mut ys);
        for (&x, &y) in small.iter().zip(&ys) {
            let want = candle_core::cpu::erf::erf_f64(x as f64);
            assert!((y as f64 - want).abs() <= 3e-7 * want.abs(), "erf at {x}: {y} vs {want}");
        }
        let mut odd = [0.5f32, -0.5, f32::NAN, f32::INFINITY, f32::NEG_INFINITY];
        erf_in_place(&mut odd);
        assert!(odd[0] == -odd[1] && odd[2].is_nan() && odd[3] == 1.0 && odd[4] == -1.0, "{odd:?}");
    }

    #[test]
    fn every_simd_path_agrees_with_the_scalar_formula_bit_for_bit() {
        use crate::simd::SimdLevel;
        let xs = grid(-10.0, 10.0);
        let cpu = SimdLevel::detected();
        for lv in [SimdLevel::Baseline, SimdLevel::Avx2, SimdLevel::Avx512].into_iter().filter(|&l| l <= cpu) {
            let level = crate::simd::SimdPlan::on_this_thread(lv);
            let (mut v, mut e) = (xs.clone(), xs.clone());
            erf_at(level, &mut v);
            exp_at(level, &mut e);
            for (i, &x) in xs.iter().enumerate() {
                assert_eq!(v[i].to_bits(), erf_one(x).to_bits(), "erf at {x}, {level:?}");
                assert_eq!(e[i].to_bits(), exp_one(x).to_bits(), "exp at {x}, {level:?}");
            }
            let gs: Vec<f32> = xs.iter().map(|&x| 0.25 - x / 7.0).collect();
            let (mut y, mut d) = (vec![MaybeUninit::uninit(); xs.len()], vec![MaybeUninit::uninit(); xs.len()]);
            gelu_at(level, &mut y, &xs);
            gelu_grad_at(level, &mut d, &xs, &gs);
            for (i, &x) in xs.iter().enumerate() {
                // SAFETY: both passes write every element.
                let (y, d) = unsafe { (y[i].assume_init(), d[i].assume_init()) };
                assert_eq!(y.to_bits(), gelu_one(x).to_bits(), "gelu at {x}, {level:?}");
                assert_eq!(d.to_bits(), (gs[i] * gelu_grad_one(x)).to_bits(), "gelu' at {x}, {level:?}");
            }
        }
    }

    #[test]
    fn gelu_and_its_derivative_are_within_a_few_units_of_the_f64_formulas() {
        let xs = grid(-12.0, 12.0);
        let c = 1.0 / (2.0 * std::f64::consts::PI).sqrt();
        let (mut worst_y, mut worst_d) = (0f64, 0f64);
        for &x in &xs {
            let w = x as f64;
            let erf = candle_core::cpu::erf::erf_f64(w * std::f64::consts::FRAC_1_SQRT_2);
            let (want_y, want_d) = (0.5 * w * (1.0 + erf), 0.5 * (1.0 + erf) + w * (-0.5 * w * w).exp() * c);
            // Absolute error against the scale of the terms (|x|/2 for the value, 1 + |x|φ for
            // the derivative): erf's 2.4e-7 bound times that scale, plus f32 rounding.
            worst_y = worst_y.max((gelu_one(x) as f64 - want_y).abs() / (0.5 * w.abs()).max(1e-30));
            worst_d = worst_d.max((gelu_grad_one(x) as f64 - want_d).abs());
        }
        assert!(worst_y < 5e-7, "gelu: worst error relative to |x|/2 {worst_y:e}");
        assert!(worst_d < 3e-7, "gelu': worst absolute error {worst_d:e}");
    }
}
