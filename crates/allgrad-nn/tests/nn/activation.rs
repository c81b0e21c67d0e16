//! `relu`, `add_relu` and `gelu_erf` against a plain f64 computation (values and gradients,
//! f32 and f64, contiguous and strided inputs, sizes spanning several parallel tasks), the ReLU
//! derivative 0 at 0, GELU at tabulated normal-CDF values and against finite differences, the
//! fallback for other dtypes, and errors that name the shapes; `prelu` (PyTorch's per-channel
//! `nn.PReLU`) against the same plain computation, values and both gradients, in f64.

use allgrad_nn::{add_relu, prelu, relu};
use candle_core::{DType, Device, Tensor, Var};

use crate::common::{self, err_text, rand_tensor, to_f64_vec};

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
    // f16 (bf16 has CPU kernels of its own: autocast.rs).
    let x = rand_tensor(&[4, 6], 5, DType::F32).to_dtype(DType::F16).unwrap();
    let y = rand_tensor(&[4, 6], 6, DType::F32).to_dtype(DType::F16).unwrap();
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

/// `x/2 · (1 + erf(x/√2))` and its derivative `Φ(x) + x φ(x)`, with Φ from Candle's f64 erf.
fn gelu_reference(x: f64) -> (f64, f64) {
    let cdf = 0.5 * (1.0 + candle_core::cpu::erf::erf_f64(x / std::f64::consts::SQRT_2));
    let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
    (x * cdf, cdf + x * pdf)
}

#[test]
fn gelu_matches_known_values_a_plain_computation_and_finite_differences() {
    use allgrad_nn::gelu_erf;
    // Φ(1) = 0.8413447460685429 and Φ(-2) = 0.022750131948179195 (standard normal CDF tables).
    let x = Tensor::new(&[1f64, -2.0, 0.0], &Device::Cpu).unwrap();
    let y = to_f64_vec(&gelu_erf(&x).unwrap());
    for (got, want) in y.iter().zip([0.8413447460685429, -2.0 * 0.022750131948179195, 0.0]) {
        assert!((got - want).abs() < 1e-15, "gelu known value: {got} vs {want}");
    }
    // 70_001 elements in [-4, 4): several parallel tasks; f32, f64, contiguous and strided.
    for (shape, transposed) in [(vec![7, 10_001], false), (vec![3, 5, 7], true)] {
        for dtype in [DType::F32, DType::F64] {
            let a = Var::from_tensor(&(rand_tensor(&shape, 1, dtype) * 4.0).unwrap()).unwrap();
            let av = if transposed { a.as_tensor().transpose(0, 2).unwrap() } else { a.as_tensor().clone() };
            let r = rand_tensor(av.dims(), 3, dtype);
            let y = gelu_erf(&av).unwrap();
            let grads = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
            let g = grads.get(&a).unwrap();
            let g = if transposed { g.transpose(0, 2).unwrap() } else { g.clone() };
            // Each value against its own size, except where x/2 + x/2·erf(x/√2) cancels (x < 0):
            // there against |x|/2, the size of the cancelling terms (and for the derivative
            // Φ + xφ, against 1/2 + |x|φ(x)).
            let tol = if dtype == DType::F64 { 1e-14 } else { 1e-6 };
            for (i, ((x, r), (y, g))) in
                to_f64_vec(&av).iter().zip(to_f64_vec(&r)).zip(to_f64_vec(&y).into_iter().zip(to_f64_vec(&g))).enumerate()
            {
                let (want_y, want_d) = gelu_reference(*x);
                let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
                let y_scale = want_y.abs().max(x.abs() / 2.0);
                let d_scale = r.abs() * want_d.abs().max(0.5 + x.abs() * pdf);
                assert!((y - want_y).abs() <= tol * y_scale, "{shape:?} {dtype:?} y[{i}] at {x}: {y} vs {want_y}");
                assert!((g - r * want_d).abs() <= tol * d_scale, "{shape:?} {dtype:?} grad[{i}] at {x}: {g} vs {}", r * want_d);
            }
        }
    }
    // The backward against central differences of the op itself (f64).
    let x = (rand_tensor(&[40], 7, DType::F64) * 3.0).unwrap();
    let p = rand_tensor(&[40], 8, DType::F64);
    let f = |t: &Tensor| (gelu_erf(t)? * &p)?.sum_all();
    let v = Var::from_tensor(&x).unwrap();
    let grads = f(v.as_tensor()).unwrap().backward().unwrap();
    // Central differences at h = 1e-6: the loss's rounding over 2h and an h² term; measured
    // 2.9e-10 of the gradient's norm.
    common::assert_close(grads.get(&v).unwrap(), &common::fd_grad(&f, &x, 1e-6), 1e-9, "gelu grad vs finite differences");
}

#[test]
fn gelu_falls_back_to_candles_erf_for_other_dtypes() {
    let x = (rand_tensor(&[4, 6], 5, DType::F32) * 3.0).unwrap();
    let want = to_f64_vec(&allgrad_nn::gelu_erf(&x).unwrap());
    // f16 (bf16 has a CPU kernel of its own: autocast.rs).
    let got = to_f64_vec(&allgrad_nn::gelu_erf(&x.to_dtype(DType::F16).unwrap()).unwrap());
    // GELU = x/2 + x/2·erf(x/√2): two terms of size |x|/2 that cancel for negative x, each
    // rounded in f16 (11 significant bits, unit roundoff 2⁻¹¹ ≈ 4.9e-4) after x itself was:
    // a few unit roundoffs of max(|gelu(x)|, |x|/2).
    for ((g, w), x) in got.iter().zip(&want).zip(to_f64_vec(&x)) {
        let scale = w.abs().max(x.abs() / 2.0);
        assert!((g - w).abs() <= 5e-3 * scale, "f16 gelu({x}) = {g} vs f32 {w}");
    }
}

#[test]
fn prelu_matches_a_plain_per_channel_computation_and_its_gradients() {
    // [N, C, H, W] and [N, C]: the slope of channel c applies to dim 1.
    for shape in [vec![2, 3, 4, 5], vec![6, 3]] {
        let (c, inner): (usize, usize) = (shape[1], shape[2..].iter().product());
        let x = Var::from_tensor(&rand_tensor(&shape, 11, DType::F64)).unwrap();
        let a = Var::from_tensor(&(rand_tensor(&[c], 12, DType::F64) * 0.5).unwrap()).unwrap();
        let r = rand_tensor(&shape, 13, DType::F64);
        let y = prelu(x.as_tensor(), a.as_tensor()).unwrap();
        let grads = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
        let (xs, av, rs) = (to_f64_vec(x.as_tensor()), to_f64_vec(a.as_tensor()), to_f64_vec(&r));
        let ch = |i: usize| (i / inner) % c;
        let want_y: Vec<f64> = xs.iter().enumerate().map(|(i, v)| if *v > 0.0 { *v } else { av[ch(i)] * v }).collect();
        let want_gx: Vec<f64> = xs.iter().enumerate().map(|(i, v)| if *v > 0.0 { rs[i] } else { av[ch(i)] * rs[i] }).collect();
        let mut want_ga = vec![0.0; c];
        for (i, v) in xs.iter().enumerate() {
            want_ga[ch(i)] += v.min(0.0) * rs[i];
        }
        let what = format!("prelu {shape:?}");
        exact(&to_f64_vec(&y), &want_y, &format!("{what}: values"));
        // The composition's gradients round differently (d/dx of a positive x is
        // `(r - a·r) + a·r`, of a sum in another order for d/da): f64 rounding.
        let close = |got: &[f64], want: &[f64], what: &str| {
            for (k, (g, w)) in got.iter().zip(want).enumerate() {
                assert!((g - w).abs() <= 1e-14 * (1.0 + w.abs()), "{what}[{k}]: {g} vs {w}");
            }
        };
        close(&to_f64_vec(grads.get(x.as_tensor()).unwrap()), &want_gx, &format!("{what}: d/dx"));
        close(&to_f64_vec(grads.get(a.as_tensor()).unwrap()), &want_ga, &format!("{what}: d/da"));
    }
    let x = rand_tensor(&[2, 3, 4], 1, DType::F32);
    let err = err_text(prelu(&x, &Tensor::ones(4, DType::F32, &Device::Cpu).unwrap()));
    assert!(err.contains("prelu") && err.contains("[2, 3, 4]") && err.contains("[4]"), "{err}");
}
