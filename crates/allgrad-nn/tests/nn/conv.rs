//! conv2d against Candle's conv2d (forward and, where Candle's backward is right, gradients)
//! and against central finite differences in f64.

use allgrad_nn::{conv2d, conv2d_backward, Conv2d, ConvParams};
use candle_core::{DType, Module, Result, Tensor, Var};

use crate::common::*;

#[derive(Clone, Copy, Debug)]
struct Case {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    o: usize,
    kh: usize,
    kw: usize,
    p: ConvParams,
}

impl Case {
    fn x_shape(&self) -> [usize; 4] {
        [self.n, self.c, self.h, self.w]
    }
    fn w_shape(&self) -> [usize; 4] {
        [self.o, self.c / self.p.groups, self.kh, self.kw]
    }
    fn fits(&self) -> bool {
        let d = self.p.dilation;
        d * (self.kh - 1) < self.h + 2 * self.p.padding && d * (self.kw - 1) < self.w + 2 * self.p.padding
    }
    /// Candle's backward computes conv_transpose2d's output padding from the height only and
    /// uses it for the width too, so its input gradient is wrong (or fails) when the two axes
    /// leave different remainders.
    fn candle_backward_ok(&self) -> bool {
        let rem = |size: usize, k: usize| (size + 2 * self.p.padding - self.p.dilation * (k - 1) - 1) % self.p.stride;
        rem(self.h, self.kh) == rem(self.w, self.kw)
    }
}

/// Batch 1 and 3; groups 1, 2 and 4 (4 = depthwise with channel multiplier 2); strides 1-3;
/// padding 0-2; dilation 1-2; square, non-square and pointwise kernels; a non-square input.
fn grid() -> Vec<Case> {
    let mut cases = vec![];
    for n in [1, 3] {
        for groups in [1, 2, 4] {
            for stride in [1, 2, 3] {
                for padding in [0, 1, 2] {
                    for dilation in [1, 2] {
                        for (kh, kw) in [(3, 3), (2, 3), (1, 1)] {
                            let p = ConvParams { stride, padding, dilation, groups };
                            let case = Case { n, c: 4, h: 6, w: 7, o: 8, kh, kw, p };
                            if case.fits() {
                                cases.push(case);
                            }
                        }
                    }
                }
            }
        }
    }
    cases
}

fn candle_conv(x: &Tensor, w: &Tensor, p: ConvParams) -> Result<Tensor> {
    x.conv2d(w, p.padding, p.stride, p.dilation, p.groups)
}

/// Gradients of `sum(conv(x, w) * r)` with respect to x and w.
fn grads(
    conv: fn(&Tensor, &Tensor, ConvParams) -> Result<Tensor>,
    x: &Tensor,
    w: &Tensor,
    r: &Tensor,
    p: ConvParams,
) -> Result<(Tensor, Tensor)> {
    let (xv, wv) = (Var::from_tensor(x)?, Var::from_tensor(w)?);
    let y = conv(xv.as_tensor(), wv.as_tensor(), p)?;
    let g = (y * r)?.sum_all()?.backward()?;
    Ok((g.get(&xv).unwrap().clone(), g.get(&wv).unwrap().clone()))
}

fn out_shape(x: &Tensor, w: &Tensor, p: ConvParams) -> Vec<usize> {
    candle_conv(x, w, p).unwrap().dims().to_vec()
}

#[test]
fn forward_matches_candle_on_parameter_grid() {
    for (i, case) in grid().into_iter().enumerate() {
        for dtype in [DType::F32, DType::F64] {
            let x = rand_tensor(&case.x_shape(), i as u64, dtype);
            let w = rand_tensor(&case.w_shape(), 1000 + i as u64, dtype);
            let ours = conv2d(&x, &w, case.p).unwrap();
            let theirs = candle_conv(&x, &w, case.p).unwrap();
            assert_close(&ours, &theirs, tol(dtype), &format!("{case:?} {dtype:?}"));
        }
    }
}

#[test]
fn gradients_match_candle_where_candle_is_right() {
    let mut compared = 0;
    for (i, case) in grid().into_iter().enumerate() {
        if !case.candle_backward_ok() {
            continue;
        }
        for dtype in [DType::F32, DType::F64] {
            let x = rand_tensor(&case.x_shape(), i as u64, dtype);
            let w = rand_tensor(&case.w_shape(), 1000 + i as u64, dtype);
            let r = rand_tensor(&out_shape(&x, &w, case.p), 2000 + i as u64, dtype);
            let (dx, dw) = grads(conv2d, &x, &w, &r, case.p).unwrap();
            let (cdx, cdw) = grads(candle_conv, &x, &w, &r, case.p).unwrap();
            assert_close(&dx, &cdx, tol(dtype), &format!("input grad {case:?} {dtype:?}"));
            assert_close(&dw, &cdw, tol(dtype), &format!("weight grad {case:?} {dtype:?}"));
            compared += 1;
        }
    }
    assert!(compared > 200, "only {compared} cases compared");
}

#[test]
fn candle_backward_is_wrong_when_height_and_width_leave_different_remainders() {
    // The case our op exists for: Candle's input gradient fails here; ours matches finite
    // differences (checked in the grid test below).
    let p = ConvParams { stride: 2, padding: 1, ..Default::default() };
    let x = rand_tensor(&[1, 2, 6, 7], 1, DType::F64);
    let w = rand_tensor(&[3, 2, 3, 3], 2, DType::F64);
    let r = rand_tensor(&out_shape(&x, &w, p), 3, DType::F64);
    let candle = grads(candle_conv, &x, &w, &r, p);
    let candle_right = match &candle {
        Ok((dx, _)) => dx.dims() == x.dims(),
        Err(_) => false,
    };
    assert!(!candle_right, "Candle's conv2d backward got this case right; revisit the grid filter");
    let (dx, _) = grads(conv2d, &x, &w, &r, p).unwrap();
    assert_eq!(dx.dims(), x.dims());
}

#[test]
fn gradients_match_directional_finite_differences_f64() {
    for (i, case) in grid().into_iter().enumerate() {
        let dt = DType::F64;
        let x = rand_tensor(&case.x_shape(), i as u64, dt);
        let w = rand_tensor(&case.w_shape(), 1000 + i as u64, dt);
        let r = rand_tensor(&out_shape(&x, &w, case.p), 2000 + i as u64, dt);
        let (dx, dw) = grads(conv2d, &x, &w, &r, case.p).unwrap();
        let vx = rand_tensor(x.dims(), 3000 + i as u64, dt);
        let vw = rand_tensor(w.dims(), 4000 + i as u64, dt);
        let fx = |t: &Tensor| (conv2d(t, &w, case.p)? * &r)?.sum_all();
        let fw = |t: &Tensor| (conv2d(&x, t, case.p)? * &r)?.sum_all();
        // The loss is linear in each argument, so central differences are exact but for
        // rounding at any step: 1/2, a power of two, adds none of its own.
        let (ex, ew) = (fd_directional(&fx, &x, &vx, 0.5), fd_directional(&fw, &w, &vw, 0.5));
        for (what, got, want) in [("input grad", dot(&dx, &vx), ex), ("weight grad", dot(&dw, &vw), ew)] {
            let e = (got - want).abs() / want.abs();
            allgrad_testkit::close::report(&format!("{what} {case:?} vs directional difference"), e, 1e-10);
            assert!(e <= 1e-10, "{what} {case:?}: {got} vs {want} (relative error {e:e})");
        }
    }
}

/// 3x3 convolutions with stride 1, padding 1 and at least 16 channels each way take the
/// Winograd path (unless ALLGRAD_WINOGRAD=0): forward, input and weight gradients against
/// Candle's convolution in f32 and f64 and against directional finite differences in f64, on
/// odd, even, non-square and 1x1 planes, and batches that span several blocks.
#[test]
fn winograd_shapes_match_candle_and_finite_differences() {
    let p = ConvParams { stride: 1, padding: 1, dilation: 1, groups: 1 };
    let cases = [
        Case { n: 3, c: 16, h: 5, w: 7, o: 20, kh: 3, kw: 3, p },
        Case { n: 2, c: 24, h: 4, w: 4, o: 16, kh: 3, kw: 3, p },
        Case { n: 2, c: 16, h: 1, w: 1, o: 16, kh: 3, kw: 3, p },
        Case { n: 9, c: 32, h: 8, w: 6, o: 32, kh: 3, kw: 3, p },
    ];
    for (i, case) in cases.into_iter().enumerate() {
        for dtype in [DType::F32, DType::F64] {
            let x = rand_tensor(&case.x_shape(), 50 + i as u64, dtype);
            let w = rand_tensor(&case.w_shape(), 60 + i as u64, dtype);
            let r = rand_tensor(&out_shape(&x, &w, case.p), 70 + i as u64, dtype);
            let what = format!("{case:?} {dtype:?}");
            assert_close(&conv2d(&x, &w, p).unwrap(), &candle_conv(&x, &w, p).unwrap(), tol(dtype), &what);
            let (dx, dw) = grads(conv2d, &x, &w, &r, p).unwrap();
            let (cdx, cdw) = grads(candle_conv, &x, &w, &r, p).unwrap();
            assert_close(&dx, &cdx, tol(dtype), &format!("input grad {what}"));
            assert_close(&dw, &cdw, tol(dtype), &format!("weight grad {what}"));
            if dtype == DType::F64 {
                let vx = rand_tensor(x.dims(), 80 + i as u64, dtype);
                let fx = |t: &Tensor| (conv2d(t, &w, p)? * &r)?.sum_all();
                // Linear in x: exact but for rounding at a step of 1/2 (see above).
                let ex = fd_directional(&fx, &x, &vx, 0.5);
                let e = (dot(&dx, &vx) - ex).abs() / ex.abs();
                allgrad_testkit::close::report(&format!("input grad {case:?} vs directional difference"), e, 1e-10);
                assert!(e <= 1e-10, "input grad {case:?}: relative error {e:e}");
            }
        }
    }
}

#[test]
fn gradients_match_elementwise_finite_differences_f64() {
    let cases = [
        Case { n: 3, c: 2, h: 5, w: 4, o: 3, kh: 3, kw: 2, p: ConvParams { stride: 2, padding: 1, dilation: 1, groups: 1 } },
        Case { n: 1, c: 4, h: 7, w: 5, o: 4, kh: 3, kw: 3, p: ConvParams { stride: 3, padding: 2, dilation: 2, groups: 4 } },
        Case { n: 2, c: 4, h: 4, w: 6, o: 6, kh: 2, kw: 2, p: ConvParams { stride: 1, padding: 0, dilation: 2, groups: 2 } },
    ];
    for (i, case) in cases.into_iter().enumerate() {
        let dt = DType::F64;
        let x = rand_tensor(&case.x_shape(), i as u64, dt);
        let w = rand_tensor(&case.w_shape(), 10 + i as u64, dt);
        let r = rand_tensor(&out_shape(&x, &w, case.p), 20 + i as u64, dt);
        let (dx, dw) = grads(conv2d, &x, &w, &r, case.p).unwrap();
        let fx = |t: &Tensor| (conv2d(t, &w, case.p)? * &r)?.sum_all();
        let fw = |t: &Tensor| (conv2d(&x, t, case.p)? * &r)?.sum_all();
        assert_close(&dx, &fd_grad(&fx, &x, 1e-5), 1e-9, &format!("input grad {case:?}"));
        assert_close(&dw, &fd_grad(&fw, &w, 1e-5), 1e-9, &format!("weight grad {case:?}"));
    }
}

#[test]
fn non_contiguous_input_and_weight() {
    let p = ConvParams { stride: 2, padding: 1, dilation: 1, groups: 2 };
    for dtype in [DType::F32, DType::F64] {
        // x: a transposed (h <-> w) view; w: a narrowed view of a larger weight.
        let x = rand_tensor(&[3, 4, 9, 6], 1, dtype).transpose(2, 3).unwrap();
        let w = rand_tensor(&[6, 3, 3, 3], 2, dtype).narrow(1, 1, 2).unwrap();
        assert!(!x.is_contiguous() && !w.is_contiguous());
        let r = rand_tensor(&out_shape(&x, &w, p), 3, dtype);
        assert_close(&conv2d(&x, &w, p).unwrap(), &candle_conv(&x, &w, p).unwrap(), tol(dtype), "forward");
        let (dx, dw) = grads(conv2d, &x, &w, &r, p).unwrap();
        let (cdx, cdw) = grads(conv2d, &x.contiguous().unwrap(), &w.contiguous().unwrap(), &r, p).unwrap();
        assert_close(&dx, &cdx, tol(dtype), "input grad");
        assert_close(&dw, &cdw, tol(dtype), "weight grad");
    }
}

#[test]
fn pointwise_conv_reads_the_input_directly_and_matches_candle() {
    // 1x1 / stride 1 / no padding takes the no-im2col path when channel planes are contiguous
    // (a batch split one image per task: in a pool of 4 threads, 3 images), and the im2col
    // path for a non-contiguous plane; this thread's kernel path counters show which.
    let pool = rayon::ThreadPoolBuilder::new().num_threads(4).build().unwrap();
    let p = ConvParams { groups: 2, ..Default::default() };
    let w = rand_tensor(&[6, 2, 1, 1], 2, DType::F64);
    for (x, pointwise) in [
        (rand_tensor(&[3, 4, 5, 7], 1, DType::F64), true),
        (rand_tensor(&[3, 4, 7, 5], 1, DType::F64).transpose(2, 3).unwrap(), false),
        (rand_tensor(&[4, 3, 5, 7], 1, DType::F64).transpose(0, 1).unwrap(), true),
    ] {
        pool.install(|| {
            let r = rand_tensor(&out_shape(&x, &w, p), 3, DType::F64);
            let before = allgrad_nn::kernel_paths();
            // The forward and the backward on `x` as laid out...
            let y = conv2d(&x, &w, p).unwrap();
            let direct = conv2d_backward(&x, &w, &r, p, true, true).unwrap();
            let mid = allgrad_nn::kernel_paths();
            // ...and through autograd, whose variable is a contiguous copy of `x`.
            let (dx, dw) = grads(conv2d, &x, &w, &r, p).unwrap();
            let after = allgrad_nn::kernel_paths();
            let laid_out = (mid.conv_pointwise - before.conv_pointwise, mid.conv_im2col - before.conv_im2col);
            let copied = (after.conv_pointwise - mid.conv_pointwise, after.conv_im2col - mid.conv_im2col);
            let what = format!("(pointwise, im2col) passes of strides {:?}", x.stride());
            assert_eq!(laid_out, if pointwise { (2, 0) } else { (0, 2) }, "{what}");
            assert_eq!(copied, (2, 0), "{what}, copied");
            assert_close(&y, &candle_conv(&x, &w, p).unwrap(), 1e-12, "forward");
            let (cdx, cdw) = grads(candle_conv, &x, &w, &r, p).unwrap();
            assert_close(&dx, &cdx, 1e-12, "input grad");
            assert_close(&dw, &cdw, 1e-12, "weight grad");
            assert_close(direct.input.as_ref().unwrap(), &cdx, 1e-12, "input grad, conv2d_backward");
            assert_close(direct.weight.as_ref().unwrap(), &cdw, 1e-12, "weight grad, conv2d_backward");
        });
    }
}

#[test]
fn batch_of_one_with_larger_image_uses_parallel_gemm() {
    // One image in a pool of 2 threads: the GEMMs get the whole pool (this thread's kernel
    // path counters show the plan).
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    pool.install(|| {
        let p = ConvParams { padding: 1, ..Default::default() };
        let x = rand_tensor(&[1, 8, 20, 17], 1, DType::F32);
        let w = rand_tensor(&[16, 8, 3, 3], 2, DType::F32);
        let r = rand_tensor(&[1, 16, 20, 17], 3, DType::F32);
        let before = allgrad_nn::kernel_paths().parallel_gemm;
        let y = conv2d(&x, &w, p).unwrap();
        let (dx, dw) = grads(conv2d, &x, &w, &r, p).unwrap();
        let planned = allgrad_nn::kernel_paths().parallel_gemm - before;
        assert!(planned >= 2, "{planned} of the passes planned parallel GEMMs; the forward and the backward should");
        assert_close(&y, &candle_conv(&x, &w, p).unwrap(), 1e-5, "forward");
        let (cdx, cdw) = grads(candle_conv, &x, &w, &r, p).unwrap();
        assert_close(&dx, &cdx, 1e-5, "input grad");
        assert_close(&dw, &cdw, 1e-5, "weight grad");
    });
}

#[test]
fn untracked_input_gets_no_gradient_and_weight_still_does() {
    let p = ConvParams { padding: 1, ..Default::default() };
    let x = rand_tensor(&[2, 3, 5, 5], 1, DType::F64);
    let w = rand_var(&[4, 3, 3, 3], 2, DType::F64);
    let loss = conv2d(&x, &w, p).unwrap().sqr().unwrap().sum_all().unwrap();
    let g = loss.backward().unwrap();
    assert!(g.get(&x).is_none());
    let dy = (candle_conv(&x, &w, p).unwrap() * 2.0).unwrap().detach();
    let (_, cdw) = grads(candle_conv, &x, &w.as_tensor().detach(), &dy, p).unwrap();
    assert_close(g.get(&w).unwrap(), &cdw, 1e-12, "weight grad");
}

#[test]
fn backward_function_returns_only_what_is_asked() {
    let p = ConvParams { stride: 2, padding: 1, ..Default::default() };
    let x = rand_tensor(&[2, 3, 6, 6], 1, DType::F64);
    let w = rand_tensor(&[4, 3, 3, 3], 2, DType::F64);
    let gy = rand_tensor(&[2, 4, 3, 3], 3, DType::F64);
    let (dx, dw) = grads(conv2d, &x, &w, &gy, p).unwrap();
    let only_x = conv2d_backward(&x, &w, &gy, p, true, false).unwrap();
    let only_w = conv2d_backward(&x, &w, &gy, p, false, true).unwrap();
    assert!(only_x.weight.is_none() && only_w.input.is_none());
    assert_close(&only_x.input.unwrap(), &dx, 1e-12, "input grad");
    assert_close(&only_w.weight.unwrap(), &dw, 1e-12, "weight grad");
    let bad = rand_tensor(&[2, 4, 6, 6], 3, DType::F64);
    let e = err_text(conv2d_backward(&x, &w, &bad, p, true, true));
    assert!(e.contains("[2, 4, 6, 6]") && e.contains("[2, 4, 3, 3]"), "{e}");
}

#[test]
fn f16_falls_back_to_candle() {
    let p = ConvParams { padding: 1, ..Default::default() };
    let x = rand_tensor(&[2, 3, 5, 5], 1, DType::F16);
    let w = rand_tensor(&[4, 3, 3, 3], 2, DType::F16);
    let ours = conv2d(&x, &w, p).unwrap();
    assert_eq!(ours.dtype(), DType::F16);
    assert_close(&ours, &candle_conv(&x, &w, p).unwrap(), 0.0, "f16 forward");
}

#[test]
fn module_adds_the_bias_per_output_channel() {
    let p = ConvParams { padding: 1, ..Default::default() };
    let x = rand_tensor(&[2, 3, 5, 4], 1, DType::F64);
    let w = rand_tensor(&[4, 3, 3, 3], 2, DType::F64);
    let b = rand_tensor(&[4], 3, DType::F64);
    let layer = Conv2d::new(w.clone(), Some(b.clone()), p).unwrap();
    let want = candle_conv(&x, &w, p).unwrap().broadcast_add(&b.reshape((1, 4, 1, 1)).unwrap()).unwrap();
    assert_close(&layer.forward(&x).unwrap(), &want, 1e-12, "conv + bias");
    let e = err_text(Conv2d::new(w, Some(rand_tensor(&[5], 3, DType::F64)), p));
    assert!(e.contains("[5]") && e.contains("4 output channels"), "{e}");
}

#[test]
fn bad_input_is_an_error_that_names_the_shapes() {
    let x = rand_tensor(&[2, 6, 5, 5], 1, DType::F32);
    let p = |groups| ConvParams { groups, ..Default::default() };
    let e = err_text(conv2d(&x, &rand_tensor(&[4, 4, 3, 3], 2, DType::F32), p(1)));
    assert!(e.contains("input has 6 channels but the weight expects 4 x groups 1"), "{e}");
    let e = err_text(conv2d(&x, &rand_tensor(&[5, 3, 3, 3], 2, DType::F32), p(2)));
    assert!(e.contains("5 output channels") && e.contains("groups 2"), "{e}");
    let e = err_text(conv2d(&x, &rand_tensor(&[4, 6, 7, 3], 2, DType::F32), p(1)));
    assert!(e.contains("7x3") && e.contains("5x5"), "{e}");
    let e = err_text(conv2d(&x.flatten_from(2).unwrap(), &rand_tensor(&[4, 6, 3, 3], 2, DType::F32), p(1)));
    assert!(e.contains("[2, 6, 25]"), "{e}");
    let e = err_text(conv2d(&x, &rand_tensor(&[4, 6, 3, 3], 2, DType::F32), ConvParams { stride: 0, ..Default::default() }));
    assert!(e.contains("stride (0)"), "{e}");
    let e = err_text(conv2d(&x, &rand_tensor(&[4, 6, 3, 3], 2, DType::F64), p(1)));
    assert!(e.contains("F32") && e.contains("F64"), "{e}");
}

#[test]
fn larger_batch_accumulates_the_weight_gradient_across_images_and_chunks() {
    // 17 images: several images per parallel chunk and several chunks, whatever the pool size.
    let p = ConvParams { padding: 1, groups: 3, ..Default::default() };
    let x = rand_tensor(&[17, 3, 5, 6], 1, DType::F64);
    let w = rand_tensor(&[6, 1, 3, 3], 2, DType::F64);
    let r = rand_tensor(&out_shape(&x, &w, p), 3, DType::F64);
    let (dx, dw) = grads(conv2d, &x, &w, &r, p).unwrap();
    let (cdx, cdw) = grads(candle_conv, &x, &w, &r, p).unwrap();
    assert_close(&dx, &cdx, 1e-12, "input grad");
    assert_close(&dw, &cdw, 1e-12, "weight grad");
}

#[test]
fn small_images_are_taken_in_blocks_and_match_candle() {
    // Few output pixels per image (late ResNet stages): the kernels put several images' column
    // matrices side by side in one GEMM (blocks of up to 512 / p images, the last one partial).
    // Cases: 3x3 stride 2 on a transposed (non-contiguous) input, groups 2; a 1x1 conv (read
    // through im2col when blocked) on 2x2 images; each against Candle (forward and, where
    // Candle's backward is right, gradients) and against the same images one at a time.
    let cases = [
        ([23, 4, 7, 5], [6, 2, 3, 3], ConvParams { stride: 2, padding: 1, groups: 2, ..Default::default() }, true),
        ([29, 6, 2, 2], [5, 6, 1, 1], ConvParams::default(), false),
    ];
    for (i, (xs, ws, p, transposed)) in cases.into_iter().enumerate() {
        let x = rand_tensor(&xs, 10 + i as u64, DType::F64);
        let x = if transposed { x.transpose(2, 3).unwrap() } else { x };
        let w = rand_tensor(&ws, 20 + i as u64, DType::F64);
        let r = rand_tensor(&out_shape(&x, &w, p), 30 + i as u64, DType::F64);
        let y = conv2d(&x, &w, p).unwrap();
        assert_close(&y, &candle_conv(&x, &w, p).unwrap(), 1e-12, &format!("case {i}: forward"));
        let (dx, dw) = grads(conv2d, &x, &w, &r, p).unwrap();
        let (cdx, cdw) = grads(candle_conv, &x.contiguous().unwrap(), &w, &r, p).unwrap();
        assert_close(&dx, &cdx, 1e-12, &format!("case {i}: input grad"));
        assert_close(&dw, &cdw, 1e-12, &format!("case {i}: weight grad"));
        // One image at a time (blocks of one): the same outputs and input gradients.
        let n = x.dim(0).unwrap();
        for k in [0, n / 2, n - 1] {
            let (xk, rk) = (x.narrow(0, k, 1).unwrap(), r.narrow(0, k, 1).unwrap());
            assert_close(&conv2d(&xk, &w, p).unwrap(), &y.narrow(0, k, 1).unwrap(), 1e-12, &format!("case {i}: image {k}"));
            let (dxk, _) = grads(conv2d, &xk, &w, &rk, p).unwrap();
            assert_close(&dxk, &dx.narrow(0, k, 1).unwrap(), 1e-12, &format!("case {i}: input grad of image {k}"));
        }
    }
}

#[test]
fn a_large_weight_on_small_images_takes_its_gradient_by_channel_slabs_and_matches_candle() {
    // A late ResNet stage's shape: 4x4 images and a weight of 1024 x 128 x 3 x 3 (1.2 M
    // elements, over the 1 M-element threshold): the weight gradient is split over slabs of
    // input channels rather than chunks of images. Against Candle, and the path counted.
    let p = ConvParams { padding: 1, ..Default::default() };
    let x = rand_tensor(&[3, 128, 4, 4], 41, DType::F64);
    let w = rand_tensor(&[1024, 128, 3, 3], 42, DType::F64);
    let r = rand_tensor(&out_shape(&x, &w, p), 43, DType::F64);
    let before = allgrad_nn::kernel_paths().conv_weight_slabs;
    let (dx, dw) = grads(conv2d, &x, &w, &r, p).unwrap();
    assert_eq!(allgrad_nn::kernel_paths().conv_weight_slabs, before + 1, "the weight gradient did not go by slabs");
    let (cdx, cdw) = grads(candle_conv, &x, &w, &r, p).unwrap();
    assert_close(&dx, &cdx, 1e-12, "input grad");
    assert_close(&dw, &cdw, 1e-12, "weight grad");
    // Below the threshold (a quarter of the output channels) the image-chunked path runs.
    let w = w.narrow(0, 0, 256).unwrap().contiguous().unwrap();
    let r = r.narrow(1, 0, 256).unwrap().contiguous().unwrap();
    let before = allgrad_nn::kernel_paths().conv_weight_slabs;
    let (_, dw) = grads(conv2d, &x, &w, &r, p).unwrap();
    assert_eq!(allgrad_nn::kernel_paths().conv_weight_slabs, before, "a small weight went by slabs");
    assert_close(&dw, &cdw.narrow(0, 0, 256).unwrap(), 1e-12, "weight grad, image-chunked");
}

/// In a child with `ALLGRAD_WINOGRAD=yes` (allgrad-nn reads its variables once per process), a
/// CPU convolution and its backward fail naming the variable and the values it takes, as does
/// `check_settings`; nothing falls back to a default. In the parent (the variable unset, `0` or
/// `1`) the same calls succeed.
#[test]
fn a_bad_winograd_switch_fails_the_convolution_naming_it() {
    let x = rand_tensor(&[2, 16, 6, 6], 7, DType::F32);
    let w = rand_tensor(&[16, 16, 3, 3], 8, DType::F32);
    let p = ConvParams { padding: 1, stride: 1, dilation: 1, groups: 1 };
    let gy = rand_tensor(&[2, 16, 6, 6], 9, DType::F32);
    match std::env::var("ALLGRAD_WINOGRAD").ok().as_deref() {
        Some("yes") => {
            for text in [
                format!("{:?}", conv2d(&x, &w, p).unwrap_err()),
                format!("{:?}", conv2d_backward(&x, &w, &gy, p, true, true).unwrap_err()),
                allgrad_nn::check_settings().unwrap_err().to_string(),
            ] {
                assert!(text.contains("ALLGRAD_WINOGRAD") && text.contains("yes"), "{text}");
                assert!(text.contains("expected 0 or 1"), "{text}");
            }
        }
        _ => {
            conv2d(&x, &w, p).unwrap();
            conv2d_backward(&x, &w, &gy, p, true, true).unwrap();
            let exe = std::env::current_exe().unwrap();
            let mut cmd = std::process::Command::new(exe);
            cmd.args(["--exact", "conv::a_bad_winograd_switch_fails_the_convolution_naming_it", "--test-threads", "1"]);
            cmd.env("ALLGRAD_WINOGRAD", "yes");
            let (out, _) = allgrad_testkit::process::run(
                &mut cmd,
                "the test in a child with ALLGRAD_WINOGRAD=yes",
                std::time::Duration::from_secs(120),
            );
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success() && stdout.contains("1 passed"),
                "child: {:?}\n{stdout}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}
