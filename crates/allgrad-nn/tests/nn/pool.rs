//! Pooling against Candle's pooling (forward; backward where kernel == stride, the only case
//! Candle supports), against PyTorch values, and against central finite differences in f64.

use allgrad_nn::{adaptive_avg_pool2d, avg_pool2d, max_pool2d};
use candle_core::{DType, Device, Result, Tensor, Var};

use crate::common::*;

type Pool = fn(&Tensor, (usize, usize), (usize, usize), (usize, usize)) -> Result<Tensor>;

fn ours_max(x: &Tensor, k: (usize, usize), s: (usize, usize), p: (usize, usize)) -> Result<Tensor> {
    max_pool2d(x, k, s, p)
}
fn ours_avg(x: &Tensor, k: (usize, usize), s: (usize, usize), p: (usize, usize)) -> Result<Tensor> {
    avg_pool2d(x, k, s, p)
}
fn candle_max(x: &Tensor, k: (usize, usize), s: (usize, usize), _p: (usize, usize)) -> Result<Tensor> {
    x.max_pool2d_with_stride(k, s)
}
fn candle_avg(x: &Tensor, k: (usize, usize), s: (usize, usize), _p: (usize, usize)) -> Result<Tensor> {
    x.avg_pool2d_with_stride(k, s)
}

/// Gradient of `sum(pool(x) * r)` with respect to x, for a seeded r.
fn grad(pool: Pool, x: &Tensor, k: (usize, usize), s: (usize, usize), p: (usize, usize)) -> Result<Tensor> {
    let xv = Var::from_tensor(x)?;
    let y = pool(xv.as_tensor(), k, s, p)?;
    let r = rand_tensor(y.dims(), 99, x.dtype());
    let g = (y * r)?.sum_all()?.backward()?;
    Ok(g.get(&xv).unwrap().clone())
}

/// The PyTorch input used for the pasted reference values: x[i] = sin(1.3 i), shape 1x1x5x6.
fn torch_input() -> Tensor {
    let v: Vec<f64> = (0..30).map(|i| (1.3 * i as f64).sin()).collect();
    Tensor::from_vec(v, (1, 1, 5, 6), &Device::Cpu).unwrap()
}

/// Gradient of `sum(pool(x) * r)` with r[i] = 1 + 0.5 i, as in the PyTorch snippet.
fn torch_style_grad(pool: impl Fn(&Tensor) -> Result<Tensor>, x: &Tensor) -> (Tensor, Tensor) {
    let xv = Var::from_tensor(x).unwrap();
    let y = pool(xv.as_tensor()).unwrap();
    let r: Vec<f64> = (0..y.elem_count()).map(|i| 1.0 + 0.5 * i as f64).collect();
    let r = Tensor::from_vec(r, y.shape(), &Device::Cpu).unwrap();
    let g = (&y * r).unwrap().sum_all().unwrap().backward().unwrap();
    (y, g.get(&xv).unwrap().clone())
}

fn vec_tensor(v: &[f64], like: &Tensor) -> Tensor {
    Tensor::from_vec(v.to_vec(), like.shape(), &Device::Cpu).unwrap()
}

const NO_PAD: (usize, usize) = (0, 0);

#[test]
fn forward_matches_candle_without_padding() {
    for (k, s) in [((2, 2), (2, 2)), ((3, 3), (2, 2)), ((3, 3), (1, 1)), ((2, 3), (3, 1)), ((3, 2), (3, 3))] {
        for n in [1, 3] {
            for dtype in [DType::F32, DType::F64] {
                let x = rand_tensor(&[n, 2, 7, 6], 1, dtype);
                let what = format!("k {k:?} s {s:?} n {n} {dtype:?}");
                let (a, b) = (ours_max(&x, k, s, NO_PAD).unwrap(), candle_max(&x, k, s, NO_PAD).unwrap());
                assert_close(&a, &b, 0.0, &format!("max {what}"));
                let (a, b) = (ours_avg(&x, k, s, NO_PAD).unwrap(), candle_avg(&x, k, s, NO_PAD).unwrap());
                assert_close(&a, &b, tol(dtype), &format!("avg {what}"));
            }
        }
    }
}

#[test]
fn avg_gradients_match_candle_when_kernel_equals_stride_and_divides_the_input() {
    for k in [(2, 2), (3, 3), (2, 3)] {
        for dtype in [DType::F32, DType::F64] {
            let x = rand_tensor(&[3, 2, 6, 6], 2, dtype);
            let (a, b) = (grad(ours_avg, &x, k, k, NO_PAD).unwrap(), grad(candle_avg, &x, k, k, NO_PAD).unwrap());
            assert_close(&a, &b, tol(dtype), &format!("avg k = s = {k:?} {dtype:?}"));
        }
    }
}

#[test]
fn max_gradients_are_candles_times_the_kernel_area_which_candle_divides_by() {
    // Candle's max-pool backward scales each gradient by (number of maxima) / (kernel area),
    // so with distinct values it returns grad / (kh * kw). Ours matches PyTorch and finite
    // differences (below), i.e. exactly kh * kw times Candle's.
    for k in [(2, 2), (3, 3), (2, 3)] {
        for dtype in [DType::F32, DType::F64] {
            let x = rand_tensor(&[3, 2, 6, 6], 2, dtype);
            let ours = grad(ours_max, &x, k, k, NO_PAD).unwrap();
            let candle = (grad(candle_max, &x, k, k, NO_PAD).unwrap() * (k.0 * k.1) as f64).unwrap();
            assert_close(&ours, &candle, tol(dtype), &format!("max k = s = {k:?} {dtype:?}"));
        }
    }
}

#[test]
fn candle_backward_fails_for_the_resnet_stem_pool_and_ours_works() {
    let x = rand_tensor(&[2, 3, 9, 8], 3, DType::F32);
    assert!(grad(candle_max, &x, (3, 3), (2, 2), NO_PAD).is_err(), "Candle now supports kernel != stride");
    let g = grad(ours_max, &x, (3, 3), (2, 2), (1, 1)).unwrap();
    assert_eq!(g.dims(), x.dims());
}

#[test]
fn candle_avg_backward_is_wrong_when_the_kernel_does_not_divide_the_input() {
    // Candle upsamples the output gradient to the input size, which misplaces it when the
    // last rows are covered by no window (7 rows, 2x2 windows).
    let x = rand_tensor(&[1, 1, 7, 6], 2, DType::F64);
    let r = rand_tensor(&[1, 1, 3, 3], 99, DType::F64);
    let f = |t: &Tensor| (ours_avg(t, (2, 2), (2, 2), NO_PAD)? * &r)?.sum_all();
    // Average pooling is linear: central differences at a step of 1/2 are exact but for rounding.
    let want = fd_grad(&f, &x, 0.5);
    assert_close(&grad(ours_avg, &x, (2, 2), (2, 2), NO_PAD).unwrap(), &want, 1e-12, "ours");
    let candle = grad(candle_avg, &x, (2, 2), (2, 2), NO_PAD).unwrap();
    assert!(rel_err(&candle, &want) > 0.1, "Candle's avg-pool backward is now right here; revisit");
}

#[test]
fn gradients_match_finite_differences_f64() {
    let configs = [
        ((3, 3), (2, 2), (1, 1)),
        ((3, 3), (1, 1), (1, 1)),
        ((2, 2), (1, 1), (0, 0)),
        ((3, 2), (3, 1), (1, 0)),
        ((3, 3), (3, 3), (0, 0)),
        ((5, 4), (2, 3), (2, 2)),
    ];
    for (k, s, p) in configs {
        for n in [1, 3] {
            let x = rand_tensor(&[n, 2, 7, 6], 4, DType::F64);
            for (name, pool) in [("max", ours_max as Pool), ("avg", ours_avg as Pool)] {
                let r = rand_tensor(pool(&x, k, s, p).unwrap().dims(), 99, DType::F64);
                let f = |t: &Tensor| (pool(t, k, s, p)? * &r)?.sum_all();
                // Linear (average) or piecewise linear (max) pooling: no h² term, the loss's
                // rounding over 2h; measured up to 1.0e-9 of the gradient's norm.
                let want = fd_grad(&f, &x, 1e-6);
                let got = grad(pool, &x, k, s, p).unwrap();
                assert_close(&got, &want, 1e-8, &format!("{name} k {k:?} s {s:?} p {p:?} n {n}"));
            }
        }
    }
}

#[test]
fn max_and_avg_match_pytorch_for_the_stem_pool() {
    // import torch, math; import torch.nn.functional as F
    // x = torch.tensor([math.sin(1.3*i) for i in range(30)], dtype=torch.float64).reshape(1,1,5,6)
    // r = 1 + 0.5 * arange(9);  y = F.max_pool2d(x, 3, 2, 1)  (and F.avg_pool2d(x, 3, 2, 1))
    // (y * r).sum().backward()
    let x = torch_input();
    let (y, dx) = torch_style_grad(|t| max_pool2d(t, 3, 2, 1), &x);
    let want_y = [
        0.998543345374605,
        0.963558185417193,
        0.9867719642746133,
        0.998543345374605,
        0.8273279005953786,
        0.9867719642746133,
        0.8838704235458307,
        0.8838704235458307,
        0.8273279005953786,
    ];
    let mut want_dx = [0.0; 30];
    for (i, v) in [(1, 1.5), (6, 3.5), (11, 5.5), (21, 8.0), (25, 8.5)] {
        want_dx[i] = v;
    }
    assert_close(&y, &vec_tensor(&want_y, &y), 1e-15, "max forward");
    assert_close(&dx, &vec_tensor(&want_dx, &dx), 1e-15, "max backward");

    let (y, dx) = torch_style_grad(|t| avg_pool2d(t, 3, 2, 1), &x);
    let want_y = [
        0.2534666547934611,
        -0.05326869917785007,
        -0.07901615662600991,
        -0.10111168076720568,
        -0.1142892467860707,
        0.1755052037335944,
        -0.08185095454932602,
        0.2472505316302659,
        -0.2188668199667338,
    ];
    let want_dx = [
        0.1111111111111111,
        0.2777777777777778,
        0.16666666666666666,
        0.38888888888888884,
        0.2222222222222222,
        0.2222222222222222,
        0.3888888888888889,
        0.8888888888888888,
        0.5,
        1.111111111111111,
        0.6111111111111112,
        0.6111111111111112,
        0.2777777777777778,
        0.6111111111111112,
        0.3333333333333333,
        0.7222222222222222,
        0.3888888888888889,
        0.3888888888888889,
        0.7222222222222222,
        1.5555555555555556,
        0.8333333333333333,
        1.777777777777778,
        0.9444444444444444,
        0.9444444444444444,
        0.4444444444444444,
        0.9444444444444444,
        0.5,
        1.0555555555555556,
        0.5555555555555556,
        0.5555555555555556,
    ];
    assert_close(&y, &vec_tensor(&want_y, &y), 1e-14, "avg forward");
    assert_close(&dx, &vec_tensor(&want_dx, &dx), 1e-14, "avg backward");
}

#[test]
fn max_pool_ties_send_the_gradient_to_the_first_max_in_row_major_order() {
    // A constant 1x1x3x3 input, 2x2 windows at stride 1: every window's first element (its
    // top-left) takes that window's gradient; nothing is split.
    let x = Tensor::ones((1, 1, 3, 3), DType::F64, &Device::Cpu).unwrap();
    let xv = Var::from_tensor(&x).unwrap();
    let y = max_pool2d(&xv, 2, 1, 0).unwrap();
    let r = Tensor::new(&[[[[1.0f64, 2.0], [3.0, 4.0]]]], &Device::Cpu).unwrap();
    let g = (y * r).unwrap().sum_all().unwrap().backward().unwrap();
    let want = Tensor::new(&[[[[1.0f64, 2.0, 0.0], [3.0, 4.0, 0.0], [0.0, 0.0, 0.0]]]], &Device::Cpu).unwrap();
    assert_close(g.get(&xv).unwrap(), &want, 0.0, "tie gradient");
}

#[test]
fn max_pool_padding_never_wins_and_nan_propagates() {
    let x = (Tensor::ones((1, 1, 4, 4), DType::F32, &Device::Cpu).unwrap() * -5.0).unwrap();
    let y = max_pool2d(&x, 3, 2, 1).unwrap();
    assert_eq!(to_f64_vec(&y), vec![-5.0; 4]);
    let mut v = vec![0.0f32; 16];
    v[5] = f32::NAN;
    let y = max_pool2d(&Tensor::from_vec(v, (1, 1, 4, 4), &Device::Cpu).unwrap(), 2, 2, 0).unwrap();
    let y = to_f64_vec(&y);
    assert!(y[0].is_nan() && y[1..].iter().all(|v| *v == 0.0), "{y:?}");
}

#[test]
fn avg_pool_counts_zero_padding_in_the_divisor() {
    let x = Tensor::ones((1, 1, 3, 3), DType::F64, &Device::Cpu).unwrap();
    let y = to_f64_vec(&avg_pool2d(&x, 3, 1, 1).unwrap());
    assert_eq!(y[0], 4.0 / 9.0);
    assert_eq!(y[4], 1.0);
}

#[test]
fn global_average_pool_is_the_mean_with_a_uniform_gradient() {
    let x = rand_tensor(&[3, 4, 5, 7], 5, DType::F64);
    let xv = Var::from_tensor(&x).unwrap();
    let y = adaptive_avg_pool2d(&xv, 1).unwrap();
    assert_eq!(y.dims(), [3, 4, 1, 1]);
    let want = x.mean_keepdim(3).unwrap().mean_keepdim(2).unwrap();
    assert_close(&y, &want, 1e-14, "global mean");
    let g = y.sum_all().unwrap().backward().unwrap();
    let uniform = Tensor::full(1.0 / 35.0, (3, 4, 5, 7), &Device::Cpu).unwrap();
    assert_close(g.get(&xv).unwrap(), &uniform, 1e-15, "global mean gradient");
}

#[test]
fn adaptive_average_pool_matches_pytorch_and_finite_differences() {
    // y = F.adaptive_avg_pool2d(x, (2, 4)) on the same x; r = 1 + 0.5 * arange(8)
    let x = torch_input();
    let (y, dx) = torch_style_grad(|t| adaptive_avg_pool2d(t, (2, 4)), &x);
    let want_y = [
        0.24330492211770371,
        -0.09393756410638304,
        -0.06311704303327946,
        0.2597938286870129,
        -0.25967149189647687,
        0.06337204483604793,
        0.09369009965905566,
        -0.2434514035938159,
    ];
    let want_dx = [
        0.16666666666666666,
        0.41666666666666663,
        0.25,
        0.3333333333333333,
        0.75,
        0.4166666666666667,
        0.16666666666666666,
        0.41666666666666663,
        0.25,
        0.3333333333333333,
        0.75,
        0.4166666666666667,
        0.6666666666666666,
        1.5,
        0.8333333333333334,
        1.0,
        2.1666666666666665,
        1.1666666666666667,
        0.5,
        1.0833333333333335,
        0.5833333333333334,
        0.6666666666666666,
        1.4166666666666665,
        0.75,
        0.5,
        1.0833333333333335,
        0.5833333333333334,
        0.6666666666666666,
        1.4166666666666665,
        0.75,
    ];
    assert_close(&y, &vec_tensor(&want_y, &y), 1e-15, "adaptive forward");
    assert_close(&dx, &vec_tensor(&want_dx, &dx), 1e-15, "adaptive backward");

    let x = rand_tensor(&[3, 2, 7, 5], 6, DType::F64);
    let r = rand_tensor(&[3, 2, 3, 2], 7, DType::F64);
    let f = |t: &Tensor| (adaptive_avg_pool2d(t, (3, 2))? * &r)?.sum_all();
    let xv = Var::from_tensor(&x).unwrap();
    let g = f(&xv).unwrap().backward().unwrap();
    // Linear: central differences at a step of 1/2 are exact but for rounding.
    assert_close(g.get(&xv).unwrap(), &fd_grad(&f, &x, 0.5), 1e-12, "adaptive (3, 2) gradient");
}

#[test]
fn non_contiguous_input() {
    let x = rand_tensor(&[3, 2, 6, 7], 8, DType::F64).transpose(2, 3).unwrap();
    assert!(!x.is_contiguous());
    let xc = x.contiguous().unwrap();
    for pool in [ours_max as Pool, ours_avg as Pool] {
        let (k, s, p) = ((3, 3), (2, 2), (1, 1));
        assert_close(&pool(&x, k, s, p).unwrap(), &pool(&xc, k, s, p).unwrap(), 0.0, "forward");
        assert_close(&grad(pool, &x, k, s, p).unwrap(), &grad(pool, &xc, k, s, p).unwrap(), 0.0, "backward");
    }
    let g = adaptive_avg_pool2d(&x, (2, 3)).unwrap();
    assert_close(&g, &adaptive_avg_pool2d(&xc, (2, 3)).unwrap(), 0.0, "adaptive");
}

#[test]
fn bad_input_is_an_error_that_names_the_shapes() {
    let x = rand_tensor(&[2, 3, 4, 5], 1, DType::F32);
    let e = err_text(max_pool2d(&x, 3, 2, 2));
    assert!(e.contains("padding (2, 2)") && e.contains("kernel (3, 3)"), "{e}");
    let e = err_text(avg_pool2d(&x, 7, 1, 1));
    assert!(e.contains("kernel (7, 7)") && e.contains("4x5"), "{e}");
    let e = err_text(max_pool2d(&x, 2, 0, 0));
    assert!(e.contains("stride (0, 0)"), "{e}");
    let e = err_text(max_pool2d(&x.flatten_from(2).unwrap(), 2, 2, 0));
    assert!(e.contains("[2, 3, 20]"), "{e}");
    let e = err_text(adaptive_avg_pool2d(&x, (5, 1)));
    assert!(e.contains("5x1") && e.contains("4x5"), "{e}");
}

#[test]
fn composed_any_device_path_matches_the_cpu_kernel() {
    use allgrad_nn::{avg_pool2d_composed, max_pool2d_composed};
    fn comp_max(x: &Tensor, k: (usize, usize), s: (usize, usize), p: (usize, usize)) -> Result<Tensor> {
        max_pool2d_composed(x, k, s, p)
    }
    fn comp_avg(x: &Tensor, k: (usize, usize), s: (usize, usize), p: (usize, usize)) -> Result<Tensor> {
        avg_pool2d_composed(x, k, s, p)
    }
    for (k, s, p) in [((3, 3), (2, 2), (1, 1)), ((2, 3), (3, 1), (1, 0)), ((2, 2), (2, 2), (0, 0)), ((5, 4), (2, 3), (2, 2))] {
        for n in [1, 3] {
            let x = rand_tensor(&[n, 2, 7, 6], 11, DType::F64);
            let what = format!("k {k:?} s {s:?} p {p:?} n {n}");
            for (fast, composed) in [(ours_max as Pool, comp_max as Pool), (ours_avg as Pool, comp_avg as Pool)] {
                assert_close(&composed(&x, k, s, p).unwrap(), &fast(&x, k, s, p).unwrap(), 1e-14, &format!("forward {what}"));
                let (a, b) = (grad(composed, &x, k, s, p).unwrap(), grad(fast, &x, k, s, p).unwrap());
                assert_close(&a, &b, 1e-14, &format!("backward {what}"));
            }
        }
    }
    // f16 on the CPU takes the composed path.
    let x = rand_tensor(&[1, 2, 7, 6], 11, DType::F16);
    let y = max_pool2d(&x, 3, 2, 1).unwrap();
    let want = max_pool2d(&x.to_dtype(DType::F32).unwrap(), 3, 2, 1).unwrap();
    assert_close(&y.to_dtype(DType::F32).unwrap(), &want, 0.0, "f16 max pool");
}
