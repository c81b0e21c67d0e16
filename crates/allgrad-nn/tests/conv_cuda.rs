//! `conv2d` on CUDA through cuDNN (feature `cudnn`) against the CPU kernels: the output and
//! both gradients (through autograd, and through `conv2d_backward` called alone) for strides 1 and
//! 2, padding, dilation, 1x1 and 7x7 kernels and groups, in f64 (relative 1e-10) and f32
//! (relative 1e-5, cuDNN's plain-f32 math); then bf16 (autocast's type: f32 compute, bf16
//! results) and f32 with TF32 allowed, each element within the rounding bound of its format
//! around an f64 computation on the same inputs.
//!
//! Every CUDA run is checked to have gone through cuDNN (`allgrad_nn::kernel_paths`), and the
//! TF32 runs to have had TF32 allowed and to differ from plain f32 by more than f32 rounding
//! (on a 64-channel case, where cuDNN takes tensor cores): a TF32 switch that never reached
//! cuDNN would pass the rounding bound but not this.
//!
//! It needs the `cudnn` feature and a GPU (`scripts/ci/gpu_ci.sh`). Without either, every test
//! skips by name, saying why (`allgrad_testkit::skip`), unless ALLGRAD_REQUIRE_GPU=1, which
//! makes that a failure.

use allgrad_nn::{conv2d, conv2d_backward, kernel_paths, ConvParams, KernelPaths};
use allgrad_testkit::close::{assert_rel, rel_err, report};
use allgrad_testkit::hashed_values as values;
use candle_core::{DType, Device, Result, Tensor, Var};

/// The tests of this file one at a time: the TF32 test turns a process-wide switch on, under
/// which the plain-f32 comparison (1e-5) would fail.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn gpu() -> Option<Device> {
    if !cfg!(feature = "cudnn") {
        allgrad_testkit::skip(allgrad_testkit::Need::Gpu, "this test binary was built without the `cudnn` feature");
        return None;
    }
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            // A failure instead where a GPU is required (ALLGRAD_REQUIRE_GPU=1).
            allgrad_testkit::skip(allgrad_testkit::Need::Gpu, &format!("no CUDA device ({e})"));
            None
        }
    }
}

/// Output, ∂x and ∂w of `Σ conv2d(x, w) ⊙ c` on `dev`, as f64 host vectors.
fn run(dev: &Device, dt: DType, xs: &[usize], ws: &[usize], p: ConvParams) -> Result<[Vec<f64>; 5]> {
    run_on(dev, dt, xs, ws, p, Inputs::Plain)
}

/// The conv2d passes through cuDNN since `before` (this thread's counts): all, and those of
/// f32 with TF32 allowed.
fn cudnn_since(before: KernelPaths) -> (u64, u64) {
    let now = kernel_paths();
    (now.conv_cudnn - before.conv_cudnn, now.conv_cudnn_tf32 - before.conv_cudnn_tf32)
}

/// A run on CUDA is a forward, the backward through autograd and `conv2d_backward` called
/// alone, each backward one cuDNN call per gradient (each gradient in a buffer of its own):
/// five passes, each through cuDNN.
const PASSES: u64 = 5;

/// Which values [`run_on`] convolves: [`values`] cast to the run's dtype, [`values`] rounded to
/// bf16 first (the inputs a bf16 run sees, for an f64 reference), or their magnitudes (an f64
/// run on them gives `Σ |x| |w|` per output, the scale of a rounding bound).
#[derive(Clone, Copy, PartialEq)]
enum Inputs {
    Plain,
    Bf16,
    Magnitudes,
}

fn run_on(dev: &Device, dt: DType, xs: &[usize], ws: &[usize], p: ConvParams, inputs: Inputs) -> Result<[Vec<f64>; 5]> {
    let make = |n: usize, salt: u64, shape: &[usize]| -> Result<Tensor> {
        let mut v = values(n, salt);
        if inputs == Inputs::Magnitudes {
            v.iter_mut().for_each(|x| *x = x.abs());
        }
        let t = Tensor::from_vec(v, shape, &Device::Cpu)?;
        let t = if inputs == Inputs::Bf16 { t.to_dtype(DType::BF16)? } else { t };
        t.to_dtype(dt)?.to_device(dev)
    };
    let x = Var::from_tensor(&make(xs.iter().product(), 1, xs)?)?;
    let w = Var::from_tensor(&make(ws.iter().product(), 2, ws)?)?;
    let y = conv2d(x.as_tensor(), w.as_tensor(), p)?;
    let c = make(y.elem_count(), 3, y.dims())?;
    let grads = (&y * &c)?.sum_all()?.backward()?;
    let host = |t: &Tensor| -> Result<Vec<f64>> { t.flatten_all()?.to_dtype(DType::F64)?.to_device(&Device::Cpu)?.to_vec1() };
    // The plain-function backward, called directly, as well as through autograd.
    let direct = conv2d_backward(x.as_tensor(), w.as_tensor(), &c, p, true, true)?;
    let (gx, gw) = (grads.get(&x).expect("x is tracked"), grads.get(&w).expect("w is tracked"));
    let (dx, dw) = (direct.input.expect("input asked for"), direct.weight.expect("weight asked for"));
    Ok([host(&y)?, host(gx)?, host(gw)?, host(&dx)?, host(&dw)?])
}

/// Each element of `gpu` within `rel · |exact| + acc · scale` of `exact`, where `scale` is the
/// element's `Σ |x| |w|` (the rounding bound of a format with unit roundoff `rel` for the
/// result and `acc` for the accumulation).
fn check_bound(what: &str, gpu: &[f64], exact: &[f64], scale: &[f64], rel: f64, acc: f64) {
    assert_eq!(gpu.len(), exact.len(), "{what}: lengths");
    // The largest |difference| / bound, reported as an error against a tolerance of 1.
    let worst = gpu
        .iter()
        .zip(exact)
        .zip(scale)
        .map(|((g, e), s)| (g - e).abs() / (rel * e.abs() + acc * s + 1e-30))
        .fold(0f64, f64::max);
    report(&format!("{what}: |difference| / rounding bound"), worst, 1.0);
    for (i, ((g, e), s)) in gpu.iter().zip(exact).zip(scale).enumerate() {
        let bound = rel * e.abs() + acc * s + 1e-30;
        assert!(
            (g - e).abs() <= bound,
            "{what}: element {i}: CUDA {g:e}, exact {e:e}: |difference| {:e} > bound {bound:e}",
            (g - e).abs()
        );
    }
}

/// Norm-wise relative error within `rel` (`allgrad_testkit::close`).
fn check(what: &str, gpu: &[f64], cpu: &[f64], rel: f64) {
    assert_rel(gpu, cpu, rel, what);
}

#[test]
fn cudnn_conv2d_and_its_gradients_equal_the_cpu_kernels() {
    let _serial = serial();
    let Some(dev) = gpu() else { return };
    let p = |stride, padding, dilation, groups| ConvParams { stride, padding, dilation, groups };
    let cases: [(&str, [usize; 4], [usize; 4], ConvParams); 6] = [
        ("3x3 stride 1 pad 1", [4, 8, 12, 12], [16, 8, 3, 3], p(1, 1, 1, 1)),
        ("3x3 stride 2 pad 1, odd size", [3, 8, 13, 11], [8, 8, 3, 3], p(2, 1, 1, 1)),
        ("1x1 stride 2 (a shortcut)", [4, 16, 8, 8], [32, 16, 1, 1], p(2, 0, 1, 1)),
        ("7x7 stride 2 pad 3 (a stem)", [2, 3, 20, 20], [8, 3, 7, 7], p(2, 3, 1, 1)),
        ("3x3 dilation 2 pad 2", [2, 4, 10, 10], [6, 4, 3, 3], p(1, 2, 2, 1)),
        ("3x3 groups 2", [2, 8, 9, 9], [6, 4, 3, 3], p(1, 1, 1, 2)),
    ];
    for (name, xs, ws, params) in cases {
        for (dt, rel) in [(DType::F64, 1e-10), (DType::F32, 1e-5)] {
            let cpu = run(&Device::Cpu, dt, &xs, &ws, params).unwrap();
            let before = kernel_paths();
            let cuda = run(&dev, dt, &xs, &ws, params).unwrap();
            assert_eq!(cudnn_since(before), (PASSES, 0), "{name} {dt:?}: conv2d passes through cuDNN (all, TF32)");
            let parts = [
                "output",
                "input gradient",
                "weight gradient",
                "conv2d_backward's input gradient",
                "conv2d_backward's weight gradient",
            ];
            for (i, part) in parts.iter().enumerate() {
                check(&format!("{name} {dt:?} {part}"), &cuda[i], &cpu[i], rel);
            }
            eprintln!("{name} {dt:?}: CUDA (cuDNN) equals the CPU kernels");
        }
    }
}

#[test]
fn cudnn_bf16_and_tf32_stay_within_their_rounding_bounds() {
    let _serial = serial();
    let Some(dev) = gpu() else { return };
    let p = |stride, padding, dilation, groups| ConvParams { stride, padding, dilation, groups };
    let cases: [(&str, [usize; 4], [usize; 4], ConvParams); 4] = [
        ("3x3 stride 1 pad 1", [4, 16, 12, 12], [16, 16, 3, 3], p(1, 1, 1, 1)),
        ("1x1 stride 2 (a shortcut)", [4, 16, 8, 8], [32, 16, 1, 1], p(2, 0, 1, 1)),
        ("7x7 stride 2 pad 3 (a stem)", [2, 3, 20, 20], [8, 3, 7, 7], p(2, 3, 1, 1)),
        (TF32_CASE, [8, 64, 16, 16], [64, 64, 3, 3], p(1, 1, 1, 1)),
    ];
    // Whether some part of the 64-channel case differed from plain f32 beyond f32 rounding.
    let mut tf32_seen = false;
    let parts =
        ["output", "input gradient", "weight gradient", "conv2d_backward's input gradient", "conv2d_backward's weight gradient"];
    for (name, xs, ws, params) in cases {
        let scale = run_on(&Device::Cpu, DType::F64, &xs, &ws, params, Inputs::Magnitudes).unwrap();
        // bf16: the inputs are exactly bf16 values; cuDNN multiplies them exactly in f32,
        // accumulates in f32 (at most (n - 1) · 2^-24 · Σ |terms| for n terms: 2^-12 covers the
        // longest sum here, 576 terms of a weight gradient, with room for the algorithm's
        // order) and rounds the result to bf16 (unit roundoff 2^-8).
        let exact = run_on(&Device::Cpu, DType::F64, &xs, &ws, params, Inputs::Bf16).unwrap();
        let cuda = run_on(&dev, DType::BF16, &xs, &ws, params, Inputs::Bf16).unwrap();
        for (i, part) in parts.iter().enumerate() {
            check_bound(&format!("{name} bf16 {part}"), &cuda[i], &exact[i], &scale[i], 2f64.powi(-8), 2f64.powi(-12));
        }
        eprintln!("{name} bf16: CUDA (cuDNN) within bf16 rounding of the f64 result");
        // TF32: each f32 input rounded to a 10-bit mantissa (2^-11 each, so 2^-10 for a
        // product) before an f32 accumulation; the result is f32.
        allgrad_nn::set_tf32(true);
        let before = kernel_paths();
        let tf32 = run_on(&dev, DType::F32, &xs, &ws, params, Inputs::Plain);
        let passes = cudnn_since(before);
        allgrad_nn::set_tf32(false);
        assert_eq!(passes, (PASSES, PASSES), "{name} f32 + TF32: conv2d passes through cuDNN (all, TF32 allowed)");
        let (tf32, exact) = (tf32.unwrap(), run_on(&Device::Cpu, DType::F64, &xs, &ws, params, Inputs::Plain).unwrap());
        // The same inputs in plain f32 on the GPU: within f32's own rounding of the exact result.
        let plain = run_on(&dev, DType::F32, &xs, &ws, params, Inputs::Plain).unwrap();
        for (i, part) in parts.iter().enumerate() {
            check_bound(
                &format!("{name} f32 + TF32 {part}"),
                &tf32[i],
                &exact[i],
                &scale[i],
                2f64.powi(-24),
                2f64.powi(-10) + 2f64.powi(-12),
            );
            // TF32 rounds each input to 10 mantissa bits: about 1e-4 of error norm-wise where
            // plain f32 has about 1e-7. An error above 1e-5 (the f32 tolerance) and ten times
            // plain f32's can only come from TF32 arithmetic.
            let (e_tf32, e_f32) = (rel_err(&tf32[i], &exact[i]), rel_err(&plain[i], &exact[i]));
            report(&format!("{name} {part}: TF32 error"), e_tf32, TF32_SEEN);
            report(&format!("{name} {part}: plain f32 error"), e_f32, 1e-5);
            assert!(e_f32 <= 1e-5, "{name} {part}: plain f32 on CUDA is {e_f32:e} from the exact result");
            if name == TF32_CASE && e_tf32 > TF32_SEEN && e_tf32 > 10.0 * e_f32 {
                tf32_seen = true;
            }
        }
        eprintln!("{name} f32 with TF32: CUDA (cuDNN) within TF32 rounding of the f64 result");
    }
    assert!(
        tf32_seen,
        "{TF32_CASE}: with TF32 allowed, no part differed from plain f32 by more than {TF32_SEEN:e}: TF32 did not run"
    );
}

/// The case on which TF32 must show (64 channels: cuDNN takes tensor-core algorithms there).
const TF32_CASE: &str = "3x3 64 channels";

/// The norm-wise error above which a result was computed with TF32 (the f32 tolerance).
const TF32_SEEN: f64 = 1e-5;

/// The plan cache on CUDA: the first forward and backward of a geometry ask cuDNN's heuristic
/// once per direction (forward, input gradient, weight gradient), a repeat asks nothing and
/// gives the same bits; another stride is a new plan. (The key logic itself is tested on any
/// machine in `src/conv/plan.rs`.)
#[test]
fn cudnn_plans_are_cached_a_repeat_asks_no_heuristic_and_gives_the_same_bits() {
    let _serial = serial();
    let Some(dev) = gpu() else { return };
    // A geometry no other test of this file uses, so this thread's first call builds its plans.
    let (xs, ws) = ([3usize, 5, 13, 11], [6usize, 5, 3, 3]);
    let p = ConvParams { padding: 1, ..Default::default() };
    let queries = || allgrad_nn::host_traffic().heuristic_queries;
    let q0 = queries();
    let first = run(&dev, DType::F32, &xs, &ws, p).unwrap();
    let q1 = queries();
    let again = run(&dev, DType::F32, &xs, &ws, p).unwrap();
    let q2 = queries();
    assert_eq!(q1 - q0, 3, "one heuristic query per direction the first time");
    assert_eq!(q2 - q1, 0, "a repeat must hit the plan cache");
    for (a, b) in first.iter().zip(&again) {
        assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "a cached plan gave other bits");
    }
    run(&dev, DType::F32, &xs, &ws, ConvParams { stride: 2, ..p }).unwrap();
    assert_eq!(queries() - q2, 3, "another stride is another plan");
}
