//! `conv2d` on CUDA through cuDNN (feature `cudnn`) against the CPU kernels: the output and
//! both gradients (through autograd, and through `conv2d_backward` called alone) for strides 1 and
//! 2, padding, dilation, 1x1 and 7x7 kernels and groups, in f64 (relative 1e-10) and f32
//! (relative 1e-5, cuDNN's plain-f32 math).
//!
//! Built only with the `cudnn` feature; it needs a GPU (`scripts/gpu_ci.sh`). Without one it
//! skips, saying why (`allgrad_testkit::skip`), unless ALLGRAD_REQUIRE_GPU=1, which makes that
//! a failure.
#![cfg(feature = "cudnn")]

use allgrad_nn::{conv2d, conv2d_backward, ConvParams};
use candle_core::{DType, Device, Result, Tensor, Var};

fn gpu() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            // A failure instead where a GPU is required (ALLGRAD_REQUIRE_GPU=1).
            allgrad_testkit::skip(allgrad_testkit::Need::Gpu, &format!("no CUDA device ({e})"));
            None
        }
    }
}

/// Deterministic values in [-1, 1), different for every position and `salt`.
fn values(n: usize, salt: u64) -> Vec<f64> {
    (0..n as u64)
        .map(|i| {
            let h = (i.wrapping_add(salt.wrapping_mul(0x9E37_79B9_7F4A_7C15))).wrapping_mul(0xD1B5_4A32_D192_ED03);
            ((h >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        })
        .collect()
}

/// Output, ∂x and ∂w of `Σ conv2d(x, w) ⊙ c` on `dev`, as f64 host vectors.
fn run(dev: &Device, dt: DType, xs: &[usize], ws: &[usize], p: ConvParams) -> Result<[Vec<f64>; 5]> {
    let x = Var::from_tensor(&Tensor::from_vec(values(xs.iter().product(), 1), xs, &Device::Cpu)?.to_dtype(dt)?.to_device(dev)?)?;
    let w = Var::from_tensor(&Tensor::from_vec(values(ws.iter().product(), 2), ws, &Device::Cpu)?.to_dtype(dt)?.to_device(dev)?)?;
    let y = conv2d(x.as_tensor(), w.as_tensor(), p)?;
    let c = Tensor::from_vec(values(y.elem_count(), 3), y.shape(), &Device::Cpu)?.to_dtype(dt)?.to_device(dev)?;
    let grads = (&y * &c)?.sum_all()?.backward()?;
    let host = |t: &Tensor| -> Result<Vec<f64>> { t.flatten_all()?.to_dtype(DType::F64)?.to_device(&Device::Cpu)?.to_vec1() };
    // The plain-function backward, called directly, as well as through autograd.
    let direct = conv2d_backward(x.as_tensor(), w.as_tensor(), &c, p, true, true)?;
    let (gx, gw) = (grads.get(&x).expect("x is tracked"), grads.get(&w).expect("w is tracked"));
    let (dx, dw) = (direct.input.expect("input asked for"), direct.weight.expect("weight asked for"));
    Ok([host(&y)?, host(gx)?, host(gw)?, host(&dx)?, host(&dw)?])
}

fn check(what: &str, gpu: &[f64], cpu: &[f64], rel: f64) {
    assert_eq!(gpu.len(), cpu.len(), "{what}: lengths");
    let scale = cpu.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-300);
    let worst = gpu.iter().zip(cpu).map(|(g, c)| (g - c).abs()).fold(0f64, f64::max);
    assert!(worst <= rel * scale, "{what}: max |CUDA - CPU| = {worst:e} > {rel:e} x max |CPU| = {scale:e}");
}

#[test]
fn cudnn_conv2d_and_its_gradients_equal_the_cpu_kernels() {
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
            let cuda = run(&dev, dt, &xs, &ws, params).unwrap();
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
