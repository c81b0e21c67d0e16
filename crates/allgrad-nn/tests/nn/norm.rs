//! layer_norm against Candle's layer norms (forward; gradients against Candle's differentiable
//! `layer_norm_slow`), PyTorch values, and central finite differences in f64.

use allgrad_nn::{layer_norm, layer_norm_composed, LayerNorm};
use candle_core::{DType, Device, Module, Tensor, Var};

use crate::common::*;

type Norm = fn(&Tensor, &Tensor, &Tensor, f64) -> candle_core::Result<Tensor>;

fn candle_slow(x: &Tensor, g: &Tensor, b: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    candle_nn::ops::layer_norm_slow(x, g, b, eps as f32)
}

/// Gradients of `sum(norm(x, gamma, beta) * r)` with respect to x, gamma and beta.
fn grads(norm: Norm, x: &Tensor, g: &Tensor, b: &Tensor, r: &Tensor, eps: f64) -> [Tensor; 3] {
    let (xv, gv, bv) = (Var::from_tensor(x).unwrap(), Var::from_tensor(g).unwrap(), Var::from_tensor(b).unwrap());
    let y = norm(&xv, &gv, &bv, eps).unwrap();
    let s = (y * r).unwrap().sum_all().unwrap().backward().unwrap();
    [&xv, &gv, &bv].map(|v| s.get(v).unwrap().clone())
}

fn inputs(shape: &[usize], seed: u64, dtype: DType) -> (Tensor, Tensor, Tensor, Tensor) {
    let d = *shape.last().unwrap();
    let x = (rand_tensor(shape, seed, dtype) * 3.0).unwrap();
    let g = (rand_tensor(&[d], seed + 1, dtype) + 1.0).unwrap();
    let b = rand_tensor(&[d], seed + 2, dtype);
    let r = rand_tensor(shape, seed + 3, dtype);
    (x, g, b, r)
}

const SHAPES: [&[usize]; 5] = [&[3, 5, 7], &[1, 1], &[4, 33], &[2, 1, 1, 9], &[6]];

#[test]
fn forward_matches_candle_layer_norm() {
    for (i, shape) in SHAPES.iter().enumerate() {
        for dtype in [DType::F32, DType::F64] {
            let (x, g, b, _) = inputs(shape, 10 * i as u64, dtype);
            let ours = layer_norm(&x, &g, &b, 1e-5).unwrap();
            let slow = candle_slow(&x, &g, &b, 1e-5).unwrap();
            if dtype == DType::F32 {
                // Candle's fused kernel has no f64 version.
                let fused = candle_nn::ops::layer_norm(&x, &g, &b, 1e-5).unwrap();
                assert_close(&ours, &fused, tol(dtype), &format!("vs fused {shape:?} {dtype:?}"));
            }
            assert_close(&ours, &slow, tol(dtype), &format!("vs slow {shape:?} {dtype:?}"));
        }
    }
}

#[test]
fn gradients_match_candle_composition() {
    for (i, shape) in SHAPES.iter().enumerate() {
        for dtype in [DType::F32, DType::F64] {
            let (x, g, b, r) = inputs(shape, 10 * i as u64, dtype);
            let ours = grads(layer_norm, &x, &g, &b, &r, 1e-5);
            let theirs = grads(candle_slow, &x, &g, &b, &r, 1e-5);
            for (name, (a, c)) in ["x", "gamma", "beta"].iter().zip(ours.iter().zip(&theirs)) {
                assert_close(a, c, tol(dtype), &format!("d{name} {shape:?} {dtype:?}"));
            }
        }
    }
}

#[test]
fn gradients_match_finite_differences_f64() {
    for (i, shape) in [&[3usize, 5][..], &[2, 3, 4], &[1, 7]].iter().enumerate() {
        let (x, g, b, r) = inputs(shape, 100 + i as u64, DType::F64);
        let [dx, dg, db] = grads(layer_norm, &x, &g, &b, &r, 1e-5);
        let fx = |t: &Tensor| (layer_norm(t, &g, &b, 1e-5)? * &r)?.sum_all();
        let fg = |t: &Tensor| (layer_norm(&x, t, &b, 1e-5)? * &r)?.sum_all();
        let fb = |t: &Tensor| (layer_norm(&x, &g, t, 1e-5)? * &r)?.sum_all();
        // x: central differences at h = 1e-6, the loss's rounding over 2h and an h² term,
        // measured up to 8.7e-10 of the gradient's norm. γ and β: the output is linear in
        // them, so a step of 1/2 is exact but for rounding.
        assert_close(&dx, &fd_grad(&fx, &x, 1e-6), 1e-8, &format!("dx {shape:?}"));
        assert_close(&dg, &fd_grad(&fg, &g, 0.5), 1e-12, &format!("dgamma {shape:?}"));
        assert_close(&db, &fd_grad(&fb, &b, 0.5), 1e-12, &format!("dbeta {shape:?}"));
    }
}

#[test]
fn matches_pytorch() {
    // x[i,j] = sin(0.9 i + 0.4 j) (3x4), gamma = 1 + 0.1 j, beta = 0.05 j, r[i,j] = cos(0.3 i + 0.7 j)
    // y = F.layer_norm(x, (4,), gamma, beta, 1e-5); (y * r).sum().backward()
    let dev = &Device::Cpu;
    let m = |f: &dyn Fn(f64, f64) -> f64| {
        let v: Vec<f64> = (0..12).map(|k| f((k / 4) as f64, (k % 4) as f64)).collect();
        Tensor::from_vec(v, (3, 4), dev).unwrap()
    };
    let x = m(&|i, j| (0.9 * i + 0.4 * j).sin());
    let r = m(&|i, j| (0.3 * i + 0.7 * j).cos());
    let g = Tensor::new(&[1.0f64, 1.1, 1.2, 1.3], dev).unwrap();
    let b = Tensor::new(&[0.0f64, 0.05, 0.1, 0.15], dev).unwrap();
    let y = layer_norm(&x, &g, &b, 1e-5).unwrap();
    let [dx, dg, db] = grads(layer_norm, &x, &g, &b, &r, 1e-5);
    let want_y = [
        -1.4477622885073105,
        -0.3258235924088084,
        0.8077805080280702,
        1.7094839126940493,
        -1.413785826410479,
        0.8881607103894971,
        1.4215206047994464,
        -0.4342793143563935,
        1.150536688401336,
        0.7408490478812316,
        -0.25734585218092343,
        -1.7750309874035546,
    ];
    let want_dx = [
        -0.6155243661592666,
        0.820581696016824,
        0.5991248852509323,
        -0.8041822151084896,
        7.496786566528982,
        7.32291699382354,
        -1.0658400852803638,
        -13.753863475072151,
        0.29847688735535005,
        -0.13175513579680054,
        -0.4282205449244598,
        0.2614987933659103,
    ];
    let want_dg = [-1.8488245710879785, 0.3183779428409978, 0.08228093555153809, 1.064547234037359];
    let want_db = [2.7806721040352844, 1.572643321777216, -0.375024187942426, -2.1463119621581632];
    let t = |v: &[f64], like: &Tensor| Tensor::from_vec(v.to_vec(), like.shape(), dev).unwrap();
    assert_close(&y, &t(&want_y, &y), 1e-13, "y");
    assert_close(&dx, &t(&want_dx, &dx), 1e-12, "dx");
    assert_close(&dg, &t(&want_dg, &dg), 1e-13, "dgamma");
    assert_close(&db, &t(&want_db, &db), 1e-13, "dbeta");
}

#[test]
fn candle_layer_norm_drops_gradients_and_ours_keeps_them() {
    let (x, g, b, _) = inputs(&[4, 6], 7, DType::F32);
    let xv = Var::from_tensor(&x).unwrap();
    let theirs = candle_nn::ops::layer_norm(&xv, &g, &b, 1e-5).unwrap();
    assert!(!theirs.track_op(), "Candle's layer_norm now tracks gradients; revisit");
    let ours = layer_norm(&xv, &g, &b, 1e-5).unwrap();
    let s = ours.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    assert!(s.get(&xv).is_some());
}

#[test]
fn non_contiguous_input_and_untracked_parameters() {
    let (x, g, b, r) = inputs(&[5, 3, 4], 9, DType::F64);
    let xt = x.transpose(0, 2).unwrap();
    let r = r.transpose(0, 2).unwrap();
    let g3 = rand_tensor(&[5], 1, DType::F64);
    let b3 = rand_tensor(&[5], 2, DType::F64);
    assert!(!xt.is_contiguous());
    let xc = xt.contiguous().unwrap();
    assert_close(&layer_norm(&xt, &g3, &b3, 1e-5).unwrap(), &layer_norm(&xc, &g3, &b3, 1e-5).unwrap(), 0.0, "forward");
    let a = grads(layer_norm, &xt, &g3, &b3, &r, 1e-5);
    let c = grads(layer_norm, &xc, &g3, &b3, &r, 1e-5);
    for (u, v) in a.iter().zip(&c) {
        assert_close(u, v, 1e-14, "gradients");
    }
    // Only x tracked: gamma and beta get nothing, and nothing panics.
    let xv = Var::from_tensor(&x).unwrap();
    let s = layer_norm(&xv, &g, &b, 1e-5).unwrap().sum_all().unwrap().backward().unwrap();
    assert!(s.get(&xv).is_some() && s.get(&g).is_none() && s.get(&b).is_none());
}

#[test]
fn composed_matches_fused_and_module_applies_it() {
    let (x, g, b, r) = inputs(&[4, 10], 21, DType::F64);
    assert_close(&layer_norm_composed(&x, &g, &b, 1e-3).unwrap(), &layer_norm(&x, &g, &b, 1e-3).unwrap(), 1e-13, "forward");
    let a = grads(layer_norm_composed, &x, &g, &b, &r, 1e-3);
    let c = grads(layer_norm, &x, &g, &b, &r, 1e-3);
    for (u, v) in a.iter().zip(&c) {
        assert_close(u, v, 1e-12, "gradients");
    }
    let m = LayerNorm::new(g.clone(), b.clone(), 1e-3).unwrap();
    assert_close(&m.forward(&x).unwrap(), &layer_norm(&x, &g, &b, 1e-3).unwrap(), 0.0, "module");
    // f16 takes the composed path and stays f16.
    let y =
        layer_norm(&x.to_dtype(DType::F16).unwrap(), &g.to_dtype(DType::F16).unwrap(), &b.to_dtype(DType::F16).unwrap(), 1e-3)
            .unwrap();
    assert_eq!(y.dtype(), DType::F16);
    // f16 keeps 11 significant bits (unit roundoff 2⁻¹¹ ≈ 4.9e-4): the rounded x, γ and β, the
    // statistics and the output, each rounded in f16; measured 5.1e-4 norm-wise.
    assert_close(&y.to_dtype(DType::F64).unwrap(), &layer_norm(&x, &g, &b, 1e-3).unwrap(), 2e-3, "f16");
}

#[test]
fn bad_input_is_an_error_that_names_the_shapes() {
    let (x, g, b, _) = inputs(&[4, 6], 7, DType::F32);
    let e = err_text(layer_norm(&x, &rand_tensor(&[5], 1, DType::F32), &b, 1e-5));
    assert!(e.contains("[5]") && e.contains("(6,)") && e.contains("[4, 6]"), "{e}");
    let e = err_text(layer_norm(&x, &g.to_dtype(DType::F64).unwrap(), &b, 1e-5));
    assert!(e.contains("F64") && e.contains("F32"), "{e}");
    let e = err_text(layer_norm(&x, &g, &b, -1.0));
    assert!(e.contains("eps"), "{e}");
    let e = err_text(LayerNorm::new(g, rand_tensor(&[3], 1, DType::F32), 1e-5));
    assert!(e.contains("[6]") && e.contains("[3]"), "{e}");
}
