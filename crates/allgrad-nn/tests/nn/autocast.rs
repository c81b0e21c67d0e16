//! bf16 autocast and the bf16 CPU kernels: each op's bf16 result against the same op computed
//! in f64 on the bf16-rounded operands (an independent reference in exact-enough arithmetic),
//! within one bf16 rounding of each stored value; the dtypes of outputs and gradients (bf16
//! activations, f32 parameter gradients); and the guard's scope.

use allgrad_nn::autocast::{compute_dtype, full, Autocast};
use allgrad_nn::{
    adaptive_avg_pool2d, add_relu, attention, batch_norm, conv2d, gelu_erf, layer_norm, linear, max_pool2d, relu,
    softmax_last_dim, BnStats, BnTail, ConvParams,
};
use candle_core::{DType, Result, Tensor, Var};

use crate::common::{self, rand_tensor, to_f64_vec};

/// bf16 keeps 8 significant bits: a value rounded to nearest is within `U·|v|` of `v`.
const U: f64 = 1.0 / 256.0;

/// `got` (bf16) is `want` (f64, computed from the same bf16 operands) rounded once: every
/// element within `U·|want|`, plus `1e-5·max|want|` for the f32 accumulation before rounding.
fn assert_one_rounding(got: &Tensor, want: &Tensor, what: &str) {
    assert_eq!(got.dtype(), DType::BF16, "{what}: dtype");
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    let (g, w) = (to_f64_vec(got), to_f64_vec(want));
    let scale = w.iter().fold(0f64, |m, v| m.max(v.abs()));
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        let bound = U * b.abs() + 1e-5 * scale;
        assert!((a - b).abs() <= bound, "{what}[{i}]: bf16 {a} vs f64 {b} (bound {bound:e})");
    }
}

/// A bf16 tensor and the same values in f64.
fn bf16_pair(shape: &[usize], seed: u64, scale: f64) -> (Tensor, Tensor) {
    let t = (rand_tensor(shape, seed, DType::F32) * scale).unwrap().to_dtype(DType::BF16).unwrap();
    let wide = t.to_dtype(DType::F64).unwrap();
    (t, wide)
}

#[test]
fn the_guard_sets_and_restores_the_compute_dtype_on_its_thread() {
    assert_eq!(compute_dtype(), None);
    {
        let _on = Autocast::bf16();
        assert_eq!(compute_dtype(), Some(DType::BF16));
        {
            let _off = Autocast::off();
            assert_eq!(compute_dtype(), None);
        }
        assert_eq!(compute_dtype(), Some(DType::BF16));
        // Another thread has its own state.
        std::thread::spawn(|| assert_eq!(compute_dtype(), None)).join().unwrap();
    }
    assert_eq!(compute_dtype(), None);
}

#[test]
fn conv2d_under_autocast_is_one_rounding_of_the_convolution_of_bf16_operands() {
    // 3x3 stride 1 with 16 channels takes Winograd; the 1x1 stride-2 one im2col + GEMM.
    for (cin, cout, k, stride) in [(16, 16, 3, 1), (5, 7, 1, 2), (3, 8, 3, 2)] {
        let p = ConvParams { stride, padding: k / 2, ..Default::default() };
        let x = rand_tensor(&[2, cin, 9, 8], 1, DType::F32);
        let w = Var::from_tensor(&(rand_tensor(&[cout, cin, k, k], 2, DType::F32) * 0.3).unwrap()).unwrap();
        let c = rand_tensor(&[2, cout, (9 - 1) / stride + 1, (8 - 1) / stride + 1], 3, DType::F32);
        let y = {
            let _bf16 = Autocast::bf16();
            conv2d(&x, w.as_tensor(), p).unwrap()
        };
        let round = |t: &Tensor| t.to_dtype(DType::BF16).unwrap().to_dtype(DType::F64).unwrap();
        let want = conv2d(&round(&x), &round(w.as_tensor()), p).unwrap();
        assert_one_rounding(&y, &want, &format!("conv {cin}->{cout} k{k}/s{stride}"));
        // The weight's gradient arrives as f32, computed in f32 from the bf16 values (x, w and
        // ∂y = bf16(c)) and not rounded: f32 accuracy against the f64 gradient.
        let grads = (full(&y).unwrap() * &c).unwrap().sum_all().unwrap().backward().unwrap();
        let dw = grads.get(w.as_tensor()).unwrap();
        assert_eq!(dw.dtype(), DType::F32);
        let g = allgrad_nn::conv2d_backward(&round(&x), &round(w.as_tensor()), &round(&c), p, false, true).unwrap();
        common::assert_close(dw, &g.weight.unwrap(), 1e-5, "conv weight gradient");
    }
}

#[test]
fn linear_under_autocast_is_one_rounding_and_its_parameters_get_f32_gradients() {
    let x = rand_tensor(&[5, 3, 12], 1, DType::F32);
    let w = Var::from_tensor(&rand_tensor(&[7, 12], 2, DType::F32)).unwrap();
    let b = Var::from_tensor(&rand_tensor(&[7], 3, DType::F32)).unwrap();
    let y = {
        let _bf16 = Autocast::bf16();
        linear(&x, w.as_tensor(), Some(b.as_tensor())).unwrap()
    };
    let round = |t: &Tensor| t.to_dtype(DType::BF16).unwrap().to_dtype(DType::F64).unwrap();
    let want = linear(&round(&x), &round(w.as_tensor()), Some(&round(b.as_tensor()))).unwrap();
    assert_one_rounding(&y, &want, "linear");
    // ∂W and ∂b of Σ c·y arrive f32, computed in f32 from the bf16 values of x and ∂y.
    let c = rand_tensor(&[5, 3, 7], 4, DType::F32);
    let grads = (full(&y).unwrap() * &c).unwrap().sum_all().unwrap().backward().unwrap();
    let (xr, cr) = (round(&x).reshape((15, 12)).unwrap(), round(&c).reshape((15, 7)).unwrap());
    let want_dw = cr.t().unwrap().matmul(&xr).unwrap();
    let want_db = cr.sum(0).unwrap();
    for (v, want, name) in [(&w, &want_dw, "dW"), (&b, &want_db, "db")] {
        let got = grads.get(v.as_tensor()).unwrap();
        assert_eq!(got.dtype(), DType::F32, "{name}");
        common::assert_close(got, want, 1e-5, name);
    }
    // Without the guard the same call stays f32.
    assert_eq!(linear(&x, w.as_tensor(), Some(b.as_tensor())).unwrap().dtype(), DType::F32);
}

/// Batch statistics of `x` in f64.
fn stats(x: &Tensor) -> BnStats {
    let v = to_f64_vec(x);
    let (n, c) = (x.dim(0).unwrap(), x.dim(1).unwrap());
    let inner: usize = x.dims()[2..].iter().product();
    let count = (n * inner) as f64;
    let (mut mean, mut var) = (vec![0.0; c], vec![0.0; c]);
    for ch in 0..c {
        let vals: Vec<f64> = (0..n).flat_map(|i| v[(i * c + ch) * inner..(i * c + ch + 1) * inner].to_vec()).collect();
        mean[ch] = vals.iter().sum::<f64>() / count;
        var[ch] = vals.iter().map(|x| (x - mean[ch]).powi(2)).sum::<f64>() / count;
    }
    BnStats::Batch { mean, var, count, sum_over_ranks: None }
}

#[test]
fn batch_norm_takes_bf16_activations_with_f32_parameters_and_returns_f32_parameter_gradients() {
    let (x, x64) = bf16_pair(&[4, 3, 5, 6], 1, 2.0);
    let (skip, skip64) = bf16_pair(&[4, 3, 5, 6], 4, 1.0);
    let gamma = Var::from_tensor(&(rand_tensor(&[3], 2, DType::F32) + 1.5).unwrap()).unwrap();
    let beta = Var::from_tensor(&rand_tensor(&[3], 3, DType::F32)).unwrap();
    let xv = Var::from_tensor(&x).unwrap();
    let c = rand_tensor(&[4, 3, 5, 6], 5, DType::F32).to_dtype(DType::BF16).unwrap();
    let st = stats(&x64);
    let y = batch_norm(xv.as_tensor(), gamma.as_tensor(), beta.as_tensor(), &st, 1e-5, BnTail::AddRelu(&skip)).unwrap();
    // The reference: the same op in f64 on the same values.
    let g64 = gamma.as_tensor().to_dtype(DType::F64).unwrap();
    let b64 = beta.as_tensor().to_dtype(DType::F64).unwrap();
    let (xr, gr, br) = (Var::from_tensor(&x64).unwrap(), Var::from_tensor(&g64).unwrap(), Var::from_tensor(&b64).unwrap());
    let want = batch_norm(xr.as_tensor(), gr.as_tensor(), br.as_tensor(), &st, 1e-5, BnTail::AddRelu(&skip64)).unwrap();
    // As unfused bf16 ops round: the batch norm's output, then the sum; each rounding within
    // U of its value (the batch norm's computed in f32 may round to the neighbour of the f64
    // value's rounding).
    let bn = to_f64_vec(&batch_norm(&x64, &g64, &b64, &st, 1e-5, BnTail::Identity).unwrap());
    let scale = to_f64_vec(&want).iter().fold(0f64, |m, v| m.max(v.abs()));
    for (i, ((got, exact), b)) in to_f64_vec(&y).iter().zip(to_f64_vec(&want)).zip(&bn).enumerate() {
        let bound = U * (b.abs() + exact.abs()) + 1e-5 * scale;
        assert!((got - exact).abs() <= bound, "batch norm + skip + relu[{i}]: bf16 {got} vs f64 {exact} (bound {bound:e})");
    }
    assert_eq!(y.dtype(), DType::BF16);
    let grads = (full(&y).unwrap() * full(&c).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
    let want_grads = (&want * c.to_dtype(DType::F64).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
    let dx = grads.get(xv.as_tensor()).unwrap();
    assert_eq!(dx.dtype(), DType::BF16);
    // ∂x is a difference of per-channel terms: one rounding of the f32 result, judged against
    // the scale of the whole gradient.
    assert_one_rounding(dx, want_grads.get(xr.as_tensor()).unwrap(), "batch norm dx");
    for (v, r, name) in [(&gamma, &gr, "dgamma"), (&beta, &br, "dbeta")] {
        let got = grads.get(v.as_tensor()).unwrap();
        assert_eq!(got.dtype(), DType::F32, "{name}");
        let want = to_f64_vec(want_grads.get(r.as_tensor()).unwrap());
        // Sums over f32 products of bf16 values: f32 accuracy, no bf16 rounding (the f32
        // standard, norm-wise through allgrad_testkit::close).
        allgrad_testkit::close::assert_rel(&to_f64_vec(got), &want, 1e-5, &format!("batch norm {name}"));
    }
}

/// An op of one or two tensors (the second ignored by the one-input ops).
type BinaryOp = dyn Fn(&Tensor, &Tensor) -> Result<Tensor>;

#[test]
fn element_wise_ops_on_bf16_are_one_rounding_of_the_f64_result() {
    let (a, a64) = bf16_pair(&[2, 3, 6, 5], 1, 3.0);
    let (b, b64) = bf16_pair(&[2, 3, 6, 5], 2, 3.0);
    let cases: [(&str, Box<BinaryOp>); 6] = [
        ("relu", Box::new(|a, _| relu(a))),
        ("add_relu", Box::new(add_relu)),
        ("gelu_erf", Box::new(|a, _| gelu_erf(a))),
        ("max_pool2d 3/2", Box::new(|a, _| max_pool2d(a, 3, 2, 1))),
        ("adaptive_avg_pool2d", Box::new(|a, _| adaptive_avg_pool2d(a, 1))),
        ("softmax", Box::new(|a, _| softmax_last_dim(a))),
    ];
    for (name, f) in cases {
        let av = Var::from_tensor(&a).unwrap();
        let y = f(av.as_tensor(), &b).unwrap();
        let want = f(&a64, &b64).unwrap();
        assert_one_rounding(&y, &want, name);
        let g = full(&y).unwrap().sqr().unwrap().sum_all().unwrap().backward().unwrap();
        assert_eq!(g.get(av.as_tensor()).unwrap().dtype(), DType::BF16, "{name}: gradient dtype");
    }
}

#[test]
fn attention_and_layer_norm_take_bf16_inputs_with_f32_constants_and_parameters() {
    let (qkv, qkv64) = bf16_pair(&[2, 5, 24], 1, 1.0);
    let bias = Tensor::from_vec(vec![0f32, 0., 0., -1e4, -1e4, 0., 0., 0., 0., -1e4], (2, 5), &candle_core::Device::Cpu).unwrap();
    let y = attention(&qkv, &bias, 2, None).unwrap();
    let want = attention(&qkv64, &bias.to_dtype(DType::F64).unwrap(), 2, None).unwrap();
    assert_one_rounding(&y, &want, "attention");
    let (x, x64) = bf16_pair(&[3, 4, 8], 3, 2.0);
    let gamma = (rand_tensor(&[8], 4, DType::F32) + 1.0).unwrap();
    let beta = rand_tensor(&[8], 5, DType::F32);
    let y = layer_norm(&x, &gamma, &beta, 1e-5).unwrap();
    let f64_of = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
    let want = layer_norm(&x64, &f64_of(&gamma), &f64_of(&beta), 1e-5).unwrap();
    assert_one_rounding(&y, &want, "layer norm");
}
