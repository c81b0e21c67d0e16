//! Relative error, defined once for the tests of every crate.
//!
//! Two measures, each stated where it is used:
//!
//! - [`rel_err`], norm-wise: `‖got − want‖₂ / ‖want‖₂`. The measure for whole tensors computed
//!   two ways (a kernel against its reference, W ranks against one): rounding makes an
//!   element's error proportional to the magnitudes of the terms that were summed into it, not
//!   to the element, so an element that cancels to nearly zero carries an error far above its
//!   own size while the tensor as a whole is right to the last bits.
//! - [`elem_rel_err`], element-wise: `max_i |got_i − want_i| / max(|want_i|, floor)`. The
//!   measure where each element is a correctly rounded value of its own (a collective's sum
//!   of exact inputs, a closed-form value), or where every element matters on its own scale.
//!
//! - [`rel_err_floor`], norm-wise with an explicit floor on `‖want‖₂`: for a tensor that may be
//!   zero by construction (a parameter whose gradient is zero holds only rounding noise, which
//!   differs between any two runs), where the floor says how large a tensor must be to be
//!   measured relatively.
//!
//! None has a floor of 1, which would make a "relative" tolerance absolute for values below
//! one (a gradient of size 1e-3 checked "at 1e-10" would be checked at 1e-7 relative).
//! NaN anywhere gives an infinite error.
//!
//! With `ALLGRAD_TEST_ERRORS=1` every check through [`assert_rel`], [`assert_rel_floor`],
//! [`assert_elem_rel`] or [`report`] prints `ERROR <test>: <what>: <error> (tolerance <tol>)` to
//! stderr: the measured errors behind the tolerances' comments
//! (`cargo test ... 2>&1 | grep '^ERROR'`).

/// `‖got − want‖₂ / ‖want‖₂` over all elements: 0 when they are equal (both zero included),
/// infinite when `want` is all zeros and `got` is not, or when either holds a NaN.
///
/// # Panics
/// When the lengths differ.
pub fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "rel_err: {} elements against {}", got.len(), want.len());
    if got.iter().chain(want).any(|x| x.is_nan()) {
        return f64::INFINITY;
    }
    // Scaled by the largest magnitude, so that squares neither underflow nor overflow.
    let scale = got.iter().zip(want).fold(0.0f64, |m, (g, w)| m.max((g - w).abs()).max(w.abs()));
    if got == want {
        return 0.0;
    }
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (g, w) in got.iter().zip(want) {
        let (d, w) = ((g - w) / scale, w / scale);
        diff += d * d;
        norm += w * w;
    }
    if norm == 0.0 {
        f64::INFINITY
    } else {
        (diff / norm).sqrt()
    }
}

/// `‖got − want‖₂ / max(‖want‖₂, floor)`: [`rel_err`] for tensors above `floor` in norm, the
/// absolute error divided by `floor` below it. NaN anywhere gives an infinite error.
///
/// # Panics
/// When the lengths differ.
pub fn rel_err_floor(got: &[f64], want: &[f64], floor: f64) -> f64 {
    assert_eq!(got.len(), want.len(), "rel_err_floor: {} elements against {}", got.len(), want.len());
    if got.iter().chain(want).any(|x| x.is_nan()) {
        return f64::INFINITY;
    }
    let norm = |v: &mut dyn Iterator<Item = f64>| v.map(|x| x * x).sum::<f64>().sqrt();
    let diff = norm(&mut got.iter().zip(want).map(|(g, w)| g - w));
    let size = norm(&mut want.iter().copied()).max(floor);
    if diff == 0.0 {
        0.0
    } else {
        diff / size
    }
}

/// The largest `|got_i − want_i| / max(|want_i|, floor)` and its index (0 for empty input).
/// `floor` is the smallest magnitude an element is measured against: `f64::MIN_POSITIVE`
/// makes an exact zero demand an exact zero. NaN anywhere gives an infinite error.
///
/// # Panics
/// When the lengths differ.
pub fn elem_rel_err(got: &[f64], want: &[f64], floor: f64) -> (f64, usize) {
    assert_eq!(got.len(), want.len(), "elem_rel_err: {} elements against {}", got.len(), want.len());
    let mut worst = (0.0f64, 0usize);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let e = if g.is_nan() || w.is_nan() {
            f64::INFINITY
        } else if g == w {
            0.0
        } else {
            (g - w).abs() / w.abs().max(floor)
        };
        if e > worst.0 {
            worst = (e, i);
        }
    }
    worst
}

/// Prints the measured error `e` of check `what` against `tol` when `ALLGRAD_TEST_ERRORS=1`.
pub fn report(what: &str, e: f64, tol: f64) {
    if std::env::var("ALLGRAD_TEST_ERRORS").is_ok_and(|v| v.trim() == "1") {
        use std::io::Write;
        let line = format!("ERROR {}: {what}: {e:.3e} (tolerance {tol:.0e})\n", crate::current_test());
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }
}

/// Fails with `what`, the error and the tolerance when [`rel_err`] exceeds `tol`.
pub fn assert_rel(got: &[f64], want: &[f64], tol: f64, what: &str) {
    let e = rel_err(got, want);
    report(what, e, tol);
    assert!(e <= tol, "{what}: relative error (norm-wise) {e:e} > {tol:e}");
}

/// Fails with `what`, the error, the tolerance and the floor when [`rel_err_floor`] exceeds
/// `tol`.
pub fn assert_rel_floor(got: &[f64], want: &[f64], tol: f64, floor: f64, what: &str) {
    let e = rel_err_floor(got, want, floor);
    report(what, e, tol);
    assert!(e <= tol, "{what}: relative error (norm-wise, floor {floor:e}) {e:e} > {tol:e}");
}

/// Fails with `what`, the element, the error and the tolerance when [`elem_rel_err`] exceeds
/// `tol`.
pub fn assert_elem_rel(got: &[f64], want: &[f64], tol: f64, floor: f64, what: &str) {
    let (e, i) = elem_rel_err(got, want, floor);
    report(what, e, tol);
    assert!(
        e <= tol,
        "{what}: element {i} is {}, expected {} (relative error {e:e} > {tol:e}, floor {floor:e})",
        got[i],
        want[i]
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_values_are_measured_relative_to_themselves() {
        // An error of 1e-9 on a value of 1e-3 is 1e-6 relative, whatever the floor of old.
        assert!((rel_err(&[1e-3 + 1e-9], &[1e-3]) - 1e-6).abs() < 1e-12);
        assert!((elem_rel_err(&[1e-3 + 1e-9, 5.0], &[1e-3, 5.0], 1e-300).0 - 1e-6).abs() < 1e-12);
        assert_eq!(elem_rel_err(&[1e-3 + 1e-9, 5.0], &[1e-3, 5.0], 1e-300).1, 0);
    }

    #[test]
    fn norm_wise_error_weighs_every_element() {
        // A change of 5e-8 in one element of a vector of norm 5: 1e-8 relative.
        let e = rel_err(&[3.0, 4.0 + 5e-8], &[3.0, 4.0]);
        assert!((e - 1e-8).abs() < 1e-15, "{e}");
    }

    #[test]
    fn zeros_and_nans() {
        assert_eq!(rel_err(&[0.0, 0.0], &[0.0, 0.0]), 0.0);
        assert_eq!(rel_err(&[1e-300], &[0.0]), f64::INFINITY);
        assert_eq!(rel_err(&[f64::NAN], &[1.0]), f64::INFINITY);
        assert_eq!(elem_rel_err(&[1.0, f64::NAN], &[1.0, 1.0], 1e-300), (f64::INFINITY, 1));
        assert_eq!(elem_rel_err(&[0.0], &[0.0], f64::MIN_POSITIVE).0, 0.0);
        assert!(elem_rel_err(&[1e-30], &[0.0], f64::MIN_POSITIVE).0 > 1e250);
        assert_eq!(elem_rel_err(&[], &[], 1.0), (0.0, 0));
        assert_eq!(rel_err_floor(&[f64::NAN], &[1.0], 1.0), f64::INFINITY);
    }

    #[test]
    fn the_floor_applies_only_below_it() {
        // Above the floor: the plain norm-wise error.
        assert!((rel_err_floor(&[3.0, 4.0 + 5e-8], &[3.0, 4.0], 1e-3) - 1e-8).abs() < 1e-15);
        // Noise of 1e-17 in a tensor that is zero by construction, against a floor of 1e-3.
        assert!((rel_err_floor(&[1e-17, 0.0], &[-1e-17, 0.0], 1e-3) - 2e-14).abs() < 1e-20);
        assert_eq!(rel_err_floor(&[0.0], &[0.0], 1e-3), 0.0);
    }
}
