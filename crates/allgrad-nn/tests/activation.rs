//! `relu` and `add_relu` against a plain f64 computation (values and gradients, f32 and f64,
//! contiguous and strided inputs, sizes spanning several parallel tasks), the derivative 0 at
//! 0, the fallback for other dtypes, and errors that name the shapes.

mod common;

use allgrad_nn::{add_relu, relu};
use candle_core::{DType, Device, Tensor, Var};
use common::{err_text, rand_tensor, to_f64_vec};

/// Values and the gradient of `Σ relu(·)·r` computed elementwise in f64.
fn reference(s: &[f64], r: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let y = s.iter().map(|v| v.max(0.0)).collect();
    let g = s.iter().zip(r).map(|(v, r)| if *v > 0.0 { *r } else { 0.0 }).collect();
    (y, g)
}

fn exact(a: &[f64], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(x == y, "{what}: element {i}: {x} vs {y}");
    }
}

#[test]
fn relu_and_add_relu_match_a_plain_computation_exactly() {
    // 70_001 elements: several parallel tasks and a ragged last one.
    for (shape, transposed) in [(vec![7, 10_001], false), (vec![3, 5, 7], true), (vec![1], false)] {
        for dtype in [DType::F32, DType::F64] {
            let a = Var::from_tensor(&rand_tensor(&shape, 1, dtype)).unwrap();
            let b = Var::from_tensor(&rand_tensor(&shape, 2, dtype)).unwrap();
            let view = |t: &Tensor| if transposed { t.transpose(0, 2).unwrap() } else { t.clone() };
            let (av, bv) = (view(a.as_tensor()), view(b.as_tensor()));
            let r = rand_tensor(av.dims(), 3, dtype);
            let what = format!("{shape:?} transposed={transposed} {dtype:?}");

            // relu(a)
            let y = relu(&av).unwrap();
            let grads = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
            let (want_y, want_g) = reference(&to_f64_vec(&av), &to_f64_vec(&r));
            exact(&to_f64_vec(&y), &want_y, &format!("relu {what}"));
            exact(&to_f64_vec(&view(grads.get(&a).unwrap())), &want_g, &format!("relu grad {what}"));

            // relu(a + b): the sum is formed in the tensors' dtype, as the op does.
            let y = add_relu(&av, &bv).unwrap();
            let grads = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
            let sum = to_f64_vec(&(&av + &bv).unwrap());
            let (want_y, want_g) = reference(&sum, &to_f64_vec(&r));
            exact(&to_f64_vec(&y), &want_y, &format!("add_relu {what}"));
            exact(&to_f64_vec(&view(grads.get(&a).unwrap())), &want_g, &format!("add_relu grad a {what}"));
            exact(&to_f64_vec(&view(grads.get(&b).unwrap())), &want_g, &format!("add_relu grad b {what}"));
        }
    }
}

#[test]
fn the_derivative_at_zero_is_zero() {
    let x = Var::from_tensor(&Tensor::new(&[-1f32, 0.0, 2.0], &Device::Cpu).unwrap()).unwrap();
    let g = relu(x.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(g.get(&x).unwrap().to_vec1::<f32>().unwrap(), [0.0, 0.0, 1.0]);
    let z = Tensor::new(&[0f32, 0.0], &Device::Cpu).unwrap();
    let g = add_relu(x.as_tensor().narrow(0, 1, 2).unwrap().as_ref(), &z).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(g.get(&x).unwrap().to_vec1::<f32>().unwrap(), [0.0, 0.0, 1.0]);
}

#[test]
fn other_dtypes_fall_back_to_candle() {
    let x = rand_tensor(&[4, 6], 5, DType::F32).to_dtype(DType::BF16).unwrap();
    let y = rand_tensor(&[4, 6], 6, DType::F32).to_dtype(DType::BF16).unwrap();
    assert_eq!(to_f64_vec(&relu(&x).unwrap()), to_f64_vec(&x.relu().unwrap()));
    assert_eq!(to_f64_vec(&add_relu(&x, &y).unwrap()), to_f64_vec(&(&x + &y).unwrap().relu().unwrap()));
}

#[test]
fn mismatched_inputs_are_errors_naming_them() {
    let a = rand_tensor(&[2, 3], 1, DType::F32);
    let e = err_text(add_relu(&a, &rand_tensor(&[3, 2], 2, DType::F32)));
    assert!(e.contains("add_relu") && e.contains("[2, 3]") && e.contains("[3, 2]"), "{e}");
    let e = err_text(add_relu(&a, &rand_tensor(&[2, 3], 2, DType::F64)));
    assert!(e.contains("add_relu") && e.contains("F32") && e.contains("F64"), "{e}");
}
