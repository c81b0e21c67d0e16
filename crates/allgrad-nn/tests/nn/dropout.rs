//! `dropout_mask` against a plain f64 computation (values and gradients, with and without the
//! residual, f32 and f64, strided inputs, sizes spanning several parallel tasks), no gradient
//! for the mask, Candle's ops off the fast path, and errors that name the shapes.

use allgrad_nn::dropout_mask;
use candle_core::{DType, Tensor, Var};

use crate::common::{err_text, rand_tensor, to_f64_vec};

#[test]
fn values_and_gradients_match_a_plain_computation() {
    for (shape, transposed) in [(vec![7, 10_001], false), (vec![3, 5, 7], true)] {
        for dtype in [DType::F32, DType::F64] {
            for with_residual in [false, true] {
                let x = Var::from_tensor(&rand_tensor(&shape, 1, dtype)).unwrap();
                let r = Var::from_tensor(&rand_tensor(&shape, 2, dtype)).unwrap();
                // A dropout-like mask: 0 or 1/(1-p), and a trainable variable, which must get
                // no gradient.
                let m = Var::from_tensor(
                    &rand_tensor(&shape, 3, dtype).ge(0.0).unwrap().to_dtype(dtype).unwrap().affine(1.25, 0.0).unwrap(),
                )
                .unwrap();
                let view = |t: &Tensor| if transposed { t.transpose(0, 2).unwrap() } else { t.clone() };
                let (xv, rv, mv) = (view(x.as_tensor()), view(r.as_tensor()), view(m.as_tensor()));
                let p = rand_tensor(xv.dims(), 4, dtype);
                let what = format!("{shape:?} transposed={transposed} residual={with_residual} {dtype:?}");

                let y = dropout_mask(&xv, &mv, with_residual.then_some(&rv)).unwrap();
                let grads = (&y * &p).unwrap().sum_all().unwrap().backward().unwrap();
                let (xs, ms, rs, ps) = (to_f64_vec(&xv), to_f64_vec(&mv), to_f64_vec(&rv), to_f64_vec(&p));
                let want_y: Vec<f64> = (0..xs.len()).map(|i| xs[i] * ms[i] + if with_residual { rs[i] } else { 0.0 }).collect();
                let want_dx: Vec<f64> = (0..xs.len()).map(|i| ps[i] * ms[i]).collect();
                // One multiply (and one add) in the dtype: exact against the f64 values rounded once.
                let tol = if dtype == DType::F64 { 1e-15 } else { 1e-6 };
                let close = |a: &[f64], b: &[f64], name: &str| {
                    allgrad_testkit::close::assert_rel(a, b, tol, &format!("{name} {what}"));
                };
                close(&to_f64_vec(&y), &want_y, "y");
                close(&to_f64_vec(&view(grads.get(&x).unwrap())), &want_dx, "dx");
                assert!(grads.get(&m).is_none(), "{what}: the mask got a gradient");
                match grads.get(&r) {
                    Some(dr) => {
                        assert!(with_residual, "{what}: a residual gradient without a residual");
                        close(&to_f64_vec(&view(dr)), &ps, "dr");
                    }
                    None => assert!(!with_residual, "{what}: no residual gradient"),
                }
            }
        }
    }
}

#[test]
fn other_dtypes_fall_back_to_candle() {
    // f16 (bf16 has a CPU kernel of its own, below).
    let x = rand_tensor(&[4, 6], 5, DType::F32).to_dtype(DType::F16).unwrap();
    let m = rand_tensor(&[4, 6], 6, DType::F32).to_dtype(DType::F16).unwrap();
    let r = rand_tensor(&[4, 6], 7, DType::F32).to_dtype(DType::F16).unwrap();
    assert_eq!(to_f64_vec(&dropout_mask(&x, &m, Some(&r)).unwrap()), to_f64_vec(&((&x * &m).unwrap() + &r).unwrap()));
}

#[test]
fn bf16_is_computed_in_f32_and_rounded_once() {
    // The product of two bf16 values is exact in f32, the sum rounds once in f32, and the
    // result once to bf16 (Candle's bf16 ops would round the product to bf16 first).
    let x = rand_tensor(&[4, 6], 5, DType::F32).to_dtype(DType::BF16).unwrap();
    let m = rand_tensor(&[4, 6], 6, DType::F32).to_dtype(DType::BF16).unwrap();
    let r = rand_tensor(&[4, 6], 7, DType::F32).to_dtype(DType::BF16).unwrap();
    let f32_of = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    let want = ((f32_of(&x) * f32_of(&m)).unwrap() + f32_of(&r)).unwrap().to_dtype(DType::BF16).unwrap();
    let got = dropout_mask(&x, &m, Some(&r)).unwrap();
    assert_eq!(got.dtype(), DType::BF16);
    assert_eq!(to_f64_vec(&got), to_f64_vec(&want));
}

#[test]
fn mismatched_inputs_are_errors_naming_them() {
    let x = rand_tensor(&[2, 3], 1, DType::F32);
    let e = err_text(dropout_mask(&x, &rand_tensor(&[3, 2], 2, DType::F32), None));
    assert!(e.contains("dropout_mask") && e.contains("[2, 3]") && e.contains("[3, 2]"), "{e}");
    let e = err_text(dropout_mask(&x, &x, Some(&rand_tensor(&[2, 3], 2, DType::F64))));
    assert!(e.contains("dropout_mask") && e.contains("F32") && e.contains("F64"), "{e}");
}
