//! softmax_last_dim / log_softmax_last_dim against Candle's (forward; gradients against
//! Candle's differentiable compositions) and central finite differences in f64.

use allgrad_nn::{log_softmax_last_dim, softmax_last_dim};
use candle_core::{DType, Device, Result, Tensor, Var, D};

use crate::common::*;

type Op = fn(&Tensor) -> Result<Tensor>;

fn candle_softmax(x: &Tensor) -> Result<Tensor> {
    candle_nn::ops::softmax(x, D::Minus1)
}
fn candle_log_softmax(x: &Tensor) -> Result<Tensor> {
    candle_nn::ops::log_softmax(x, D::Minus1)
}

const PAIRS: [(&str, Op, Op); 2] =
    [("softmax", softmax_last_dim, candle_softmax), ("log_softmax", log_softmax_last_dim, candle_log_softmax)];
const SHAPES: [&[usize]; 4] = [&[3, 7], &[2, 3, 5], &[9], &[4, 1]];

fn grad(op: Op, x: &Tensor, r: &Tensor) -> Tensor {
    let xv = Var::from_tensor(x).unwrap();
    let s = (op(&xv).unwrap() * r).unwrap().sum_all().unwrap().backward().unwrap();
    s.get(&xv).unwrap().clone()
}

#[test]
fn forward_and_gradients_match_candle() {
    for (name, ours, theirs) in PAIRS {
        for (i, shape) in SHAPES.iter().enumerate() {
            for dtype in [DType::F32, DType::F64] {
                let x = (rand_tensor(shape, i as u64, dtype) * 4.0).unwrap();
                let r = rand_tensor(shape, 50 + i as u64, dtype);
                let what = format!("{name} {shape:?} {dtype:?}");
                assert_close(&ours(&x).unwrap(), &theirs(&x).unwrap(), tol(dtype), &format!("forward {what}"));
                assert_close(&grad(ours, &x, &r), &grad(theirs, &x, &r), tol(dtype), &format!("gradient {what}"));
            }
        }
    }
    // Candle's fused softmax_last_dim (no backward) agrees on the forward.
    let x = rand_tensor(&[5, 11], 3, DType::F32);
    assert_close(&softmax_last_dim(&x).unwrap(), &candle_nn::ops::softmax_last_dim(&x).unwrap(), 1e-6, "fused");
}

#[test]
fn gradients_match_finite_differences_f64() {
    for (name, ours, _) in PAIRS {
        for (i, shape) in SHAPES.iter().enumerate() {
            let x = (rand_tensor(shape, i as u64, DType::F64) * 4.0).unwrap();
            let r = rand_tensor(shape, 50 + i as u64, DType::F64);
            let f = |t: &Tensor| (ours(t)? * &r)?.sum_all();
            // Central differences at h = 1e-6: the loss's rounding over 2h and an h² term;
            // measured up to 2.0e-9 of the gradient's norm.
            assert_close(&grad(ours, &x, &r), &fd_grad(&f, &x, 1e-6), 1e-8, &format!("{name} {shape:?}"));
        }
    }
}

#[test]
fn candle_softmax_last_dim_drops_gradients_and_ours_keeps_them() {
    let xv = Var::from_tensor(&rand_tensor(&[2, 5], 1, DType::F32)).unwrap();
    assert!(!candle_nn::ops::softmax_last_dim(&xv).unwrap().track_op(), "Candle now tracks it; revisit");
    assert!(softmax_last_dim(&xv).unwrap().track_op());
}

#[test]
fn stable_for_huge_logits_and_masked_rows() {
    let x = Tensor::new(&[[1000.0f32, 0.0, -1000.0], [3e4, 3e4, 3e4]], &Device::Cpu).unwrap();
    let p = to_f64_vec(&softmax_last_dim(&x).unwrap());
    assert_eq!(p[..3], [1.0, 0.0, 0.0]);
    assert!(p[3..].iter().all(|v| (v - 1.0 / 3.0).abs() < 1e-7), "{p:?}");
    let lp = to_f64_vec(&log_softmax_last_dim(&x).unwrap());
    assert_eq!(lp[..3], [0.0, -1000.0, -2000.0]);
    // A fully masked row gives zeros (softmax) / -inf (log-softmax), not NaN.
    let m = Tensor::new(&[[f32::NEG_INFINITY; 3]], &Device::Cpu).unwrap();
    assert_eq!(to_f64_vec(&softmax_last_dim(&m).unwrap()), vec![0.0; 3]);
    assert!(to_f64_vec(&log_softmax_last_dim(&m).unwrap()).iter().all(|v| *v == f64::NEG_INFINITY));
}

#[test]
fn non_contiguous_input() {
    let x = rand_tensor(&[6, 4, 3], 4, DType::F64).transpose(0, 2).unwrap();
    let r = rand_tensor(&[3, 4, 6], 5, DType::F64);
    let xc = x.contiguous().unwrap();
    for (name, ours, _) in PAIRS {
        assert_close(&ours(&x).unwrap(), &ours(&xc).unwrap(), 0.0, name);
        assert_close(&grad(ours, &x, &r), &grad(ours, &xc, &r), 0.0, name);
    }
}

#[test]
fn scalar_input_is_an_error() {
    let e = err_text(softmax_last_dim(&Tensor::new(1.0f32, &Device::Cpu).unwrap()));
    assert!(e.contains("scalar"), "{e}");
    // f16 takes Candle's composition and keeps its dtype.
    let x = rand_tensor(&[2, 5], 1, DType::F16);
    assert_eq!(softmax_last_dim(&x).unwrap().dtype(), DType::F16);
}
