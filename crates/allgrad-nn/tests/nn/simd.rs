//! The vectorised loops' copies per SIMD level (`allgrad_nn::SimdLevel`): layer norm, GELU,
//! softmax and log-softmax, batch norm (with its ReLU and residual tails), the channel sums of
//! `channel_moments` and `channel_affine`'s backward, forward and backward,
//! at each level the CPU has, against their composed references (f64 1e-10, f32 1e-5), with
//! identical bits across levels, and the path counters (`allgrad_nn::simd_paths`, moved by the
//! dispatch arm that ran, not by the op that planned it) at the forced level only; f64 GELU,
//! which has one copy, counted as baseline at every level; and `ALLGRAD_CPU_SIMD`'s values and
//! errors.

use std::time::Duration;

use allgrad_nn::{force_simd, gelu_erf, gelu_erf_composed, layer_norm, layer_norm_composed, simd_level, simd_paths, SimdLevel};
use allgrad_testkit::{skip, Need};
use candle_core::{DType, Tensor, Var};

use crate::common::*;

const LEVELS: [SimdLevel; 3] = [SimdLevel::Baseline, SimdLevel::Avx2, SimdLevel::Avx512];

/// `op`'s output and the gradients of `sum(op(inputs) * r)` with respect to each input.
fn value_and_grads(op: &dyn Fn(&[&Tensor]) -> candle_core::Result<Tensor>, inputs: &[Tensor], r: &Tensor) -> Vec<Tensor> {
    let vars: Vec<Var> = inputs.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
    let refs: Vec<&Tensor> = vars.iter().map(|v| v.as_tensor()).collect();
    let y = op(&refs).unwrap();
    let grads = (&y * r).unwrap().sum_all().unwrap().backward().unwrap();
    let mut out = vec![y];
    out.extend(vars.iter().map(|v| grads.get(v).unwrap().clone()));
    out
}

fn bits(t: &Tensor) -> Vec<u64> {
    match t.dtype() {
        DType::F32 => t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits() as u64).collect(),
        _ => t.flatten_all().unwrap().to_vec1::<f64>().unwrap().iter().map(|v| v.to_bits()).collect(),
    }
}

/// The count of `level` in `p`.
fn ran(level: SimdLevel, p: allgrad_nn::SimdPaths) -> u64 {
    match level {
        SimdLevel::Avx512 => p.avx512,
        SimdLevel::Avx2 => p.avx2,
        SimdLevel::Baseline => p.baseline,
    }
}

/// Which copy runs when `level` is forced: that level's, or with `one_copy` (a loop without
/// copies per level) the baseline.
fn copy_run(level: SimdLevel, one_copy: bool) -> SimdLevel {
    if one_copy {
        SimdLevel::Baseline
    } else {
        level
    }
}

/// Runs the fused op and its composed reference at every level the CPU has: each level's
/// results within `tol` of the reference; the counter of the copy that runs (see [`copy_run`])
/// up by at least `calls` (the forward and backward kernels each run one copy or more, one per
/// parallel task) and the others unchanged; and the same bits at every level.
fn check_levels(
    name: &str,
    fused: &dyn Fn(&[&Tensor]) -> candle_core::Result<Tensor>,
    composed: &dyn Fn(&[&Tensor]) -> candle_core::Result<Tensor>,
    inputs: &[Tensor],
    r: &Tensor,
    calls: u64,
) {
    check_levels_of(name, fused, composed, inputs, r, calls, false, tol(r.dtype()))
}

#[allow(clippy::too_many_arguments)]
fn check_levels_of(
    name: &str,
    fused: &dyn Fn(&[&Tensor]) -> candle_core::Result<Tensor>,
    composed: &dyn Fn(&[&Tensor]) -> candle_core::Result<Tensor>,
    inputs: &[Tensor],
    r: &Tensor,
    calls: u64,
    one_copy: bool,
    tol: f64,
) {
    let dtype = r.dtype();
    let want = value_and_grads(composed, inputs, r);
    let mut first: Option<(SimdLevel, Vec<Vec<u64>>)> = None;
    for level in LEVELS {
        let Ok(_forced) = force_simd(level) else {
            skip(
                Need::Simd(level.name()),
                &format!("{name}: the CPU lacks {} (its widest: {})", level.name(), SimdLevel::detected().name()),
            );
            continue;
        };
        let before = simd_paths();
        let got = value_and_grads(fused, inputs, r);
        let after = simd_paths();
        let runs = copy_run(level, one_copy);
        for other in LEVELS {
            let n = ran(other, after) - ran(other, before);
            let what = format!("{name} {dtype:?} forced to {}: {n} copies counted at {}", level.name(), other.name());
            if other == runs {
                assert!(n >= calls, "{what}, expected at least {calls}");
            } else {
                assert_eq!(n, 0, "{what}, expected none");
            }
        }
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_close(g, w, tol, &format!("{name} {dtype:?} at {}: output {i} vs composed", level.name()));
        }
        let b: Vec<Vec<u64>> = got.iter().map(bits).collect();
        match &first {
            None => first = Some((level, b)),
            Some((l0, b0)) => assert!(b == *b0, "{name} {dtype:?}: {} and {} give different bits", l0.name(), level.name()),
        }
    }
}

#[test]
fn layer_norm_at_every_simd_level_matches_its_composition_with_the_same_bits() {
    // 389 and 7: rows with a tail beyond the 16 partial sums; 384: BERT-small's width.
    for (shape, seed) in [(vec![7usize, 389], 1u64), (vec![2, 5, 384], 5), (vec![3, 7], 9)] {
        for dtype in [DType::F64, DType::F32] {
            let d = *shape.last().unwrap();
            let x = rand_tensor(&shape, seed, dtype).affine(3.0, 0.5).unwrap();
            let g = (rand_tensor(&[d], seed + 1, dtype) + 1.0).unwrap();
            let b = rand_tensor(&[d], seed + 2, dtype);
            let r = rand_tensor(&shape, seed + 3, dtype);
            let fused = |t: &[&Tensor]| layer_norm(t[0], t[1], t[2], 1e-5);
            let composed = |t: &[&Tensor]| layer_norm_composed(t[0], t[1], t[2], 1e-5);
            check_levels(&format!("layer_norm {shape:?}"), &fused, &composed, &[x, g, b], &r, 2);
        }
    }
}

#[test]
fn gelu_at_every_simd_level_matches_its_composition_with_the_same_bits() {
    // 100,003 elements: several parallel tasks of the element-wise grain, the last one partial.
    // f64 GELU has one copy (Candle's scalar erf per element): it counts as baseline at every
    // level, and its same-bits check says nothing about copies; f32 has one per level.
    for dtype in [DType::F64, DType::F32] {
        let x = (rand_tensor(&[100_003], 21, dtype) * 4.0).unwrap();
        let r = rand_tensor(&[100_003], 22, dtype);
        let one_copy = dtype == DType::F64;
        let (fused, composed) = (|t: &[&Tensor]| gelu_erf(t[0]), |t: &[&Tensor]| gelu_erf_composed(t[0]));
        check_levels_of("gelu_erf", &fused, &composed, &[x], &r, 2, one_copy, tol(dtype));
    }
}

/// Batch norm with batch statistics from Candle's broadcast ops, then the tail: `relu(y)`,
/// `relu(y + skip)` or `y`; computed in f64 (f32 inputs widened, the output narrowed), so that
/// the f32 case is judged against exact arithmetic.
fn batch_norm_composed(x: &Tensor, g: &Tensor, b: &Tensor, skip: Option<&Tensor>, relu: bool) -> candle_core::Result<Tensor> {
    let dtype = x.dtype();
    let wide = |t: &Tensor| t.to_dtype(DType::F64);
    let (x, g, b, skip) = (&wide(x)?, &wide(g)?, &wide(b)?, skip.map(wide).transpose()?);
    let skip = skip.as_ref();
    let c = x.dim(1)?;
    let shape = [1, c, 1, 1];
    let mean = x.mean_keepdim(&[0usize, 2, 3][..])?;
    let var = x.broadcast_sub(&mean)?.sqr()?.mean_keepdim(&[0usize, 2, 3][..])?;
    let xhat = x.broadcast_sub(&mean)?.broadcast_div(&(var + 1e-5)?.sqrt()?)?;
    let y = xhat.broadcast_mul(&g.reshape(&shape[..])?)?.broadcast_add(&b.reshape(&shape[..])?)?;
    match (skip, relu) {
        (Some(s), _) => (y + s)?.relu(),
        (None, true) => y.relu(),
        (None, false) => Ok(y),
    }?
    .to_dtype(dtype)
}

/// The fused batch norm on batch statistics taken from `x` in f64.
fn batch_norm_fused(x: &Tensor, g: &Tensor, b: &Tensor, skip: Option<&Tensor>, relu: bool) -> candle_core::Result<Tensor> {
    use allgrad_nn::{batch_norm, BnStats, BnTail};
    let (n, c, h, w) = x.dims4()?;
    let v = x.to_dtype(DType::F64)?.transpose(0, 1)?.reshape((c, n * h * w))?.to_vec2::<f64>()?;
    let count = (n * h * w) as f64;
    let mean: Vec<f64> = v.iter().map(|r| r.iter().sum::<f64>() / count).collect();
    let var: Vec<f64> = v.iter().zip(&mean).map(|(r, m)| r.iter().map(|x| (x - m).powi(2)).sum::<f64>() / count).collect();
    let stats = BnStats::Batch { mean, var, count, sum_over_ranks: None };
    let tail = match (skip, relu) {
        (Some(s), _) => BnTail::AddRelu(s),
        (None, true) => BnTail::Relu,
        (None, false) => BnTail::Identity,
    };
    batch_norm(x, g, b, &stats, 1e-5, tail)
}

#[test]
fn batch_norm_at_every_simd_level_matches_its_composition_with_the_same_bits() {
    // [2, 3, 5, 7]: rows of 35 (a tail beyond the 8 f64 partial sums of the channel sums);
    // [4, 2, 96, 96]: rows of 9216 in several parallel tasks of the grain, the last partial.
    for (shape, seed) in [([2usize, 3, 5, 7], 41u64), ([4, 2, 96, 96], 45)] {
        for dtype in [DType::F64, DType::F32] {
            let c = shape[1];
            let x = rand_tensor(&shape, seed, dtype).affine(2.0, 0.7).unwrap();
            let g = (rand_tensor(&[c], seed + 1, dtype) + 1.5).unwrap();
            let b = rand_tensor(&[c], seed + 2, dtype);
            let skip = rand_tensor(&shape, seed + 3, dtype);
            let r = rand_tensor(&shape, seed + 4, dtype);
            // Forward (one kernel), backward (channel sums and the ∂x pass). Against the f64
            // composition: measured 1.6e-14 (f64) and 6.7e-8 (f32) at worst.
            let name = format!("batch_norm {shape:?}");
            let tol = if dtype == DType::F64 { 1e-12 } else { 1e-6 };
            for (tail, relu) in [("relu", true), ("identity", false)] {
                let fused = |t: &[&Tensor]| batch_norm_fused(t[0], t[1], t[2], None, relu);
                let composed = |t: &[&Tensor]| batch_norm_composed(t[0], t[1], t[2], None, relu);
                let inputs = [x.clone(), g.clone(), b.clone()];
                check_levels_of(&format!("{name} {tail}"), &fused, &composed, &inputs, &r, 3, false, tol);
            }
            let fused = |t: &[&Tensor]| batch_norm_fused(t[0], t[1], t[2], Some(t[3]), true);
            let composed = |t: &[&Tensor]| batch_norm_composed(t[0], t[1], t[2], Some(t[3]), true);
            let inputs = [x.clone(), g.clone(), b.clone(), skip.clone()];
            check_levels_of(&format!("{name} add_relu"), &fused, &composed, &inputs, &r, 3, false, tol);
        }
    }
}

#[test]
fn softmax_and_log_softmax_at_every_simd_level_match_their_composition_with_the_same_bits() {
    // Rows of 37 (a tail beyond the 16 lanes) and 128; softmax's rows each with a masked (-inf)
    // entry, log-softmax's with a large negative one (its output there is -inf or finite, which a
    // relative error cannot compare when infinite).
    for (shape, seed) in [(vec![9usize, 37], 31u64), (vec![2, 3, 128], 35)] {
        for dtype in [DType::F64, DType::F32] {
            let d = *shape.last().unwrap();
            let mask = |v: f64| -> Tensor {
                let m: Vec<f64> = (0..d).map(|i| if i == 3 { v } else { 0.0 }).collect();
                Tensor::new(m, &candle_core::Device::Cpu).unwrap().to_dtype(dtype).unwrap()
            };
            let x = (rand_tensor(&shape, seed, dtype) * 6.0).unwrap();
            let (x, xl) = (x.broadcast_add(&mask(f64::NEG_INFINITY)).unwrap(), x.broadcast_add(&mask(-60.0)).unwrap());
            let r = rand_tensor(&shape, seed + 1, dtype);
            let name = format!("softmax {shape:?}");
            let softmax = |t: &[&Tensor]| allgrad_nn::softmax_last_dim(t[0]);
            let composed = |t: &[&Tensor]| candle_nn::ops::softmax(t[0], candle_core::D::Minus1);
            check_levels(&name, &softmax, &composed, std::slice::from_ref(&x), &r, 2);
            let log_softmax = |t: &[&Tensor]| allgrad_nn::log_softmax_last_dim(t[0]);
            let composed = |t: &[&Tensor]| candle_nn::ops::log_softmax(t[0], candle_core::D::Minus1);
            check_levels(&format!("log_{name}"), &log_softmax, &composed, &[xl], &r, 2);
        }
    }
}

#[test]
fn the_setting_takes_its_four_values_and_names_itself_in_errors() {
    let cpu = SimdLevel::detected();
    assert_eq!(SimdLevel::parse("auto", cpu).unwrap(), cpu);
    assert_eq!(SimdLevel::parse("", cpu).unwrap(), cpu);
    assert_eq!(SimdLevel::parse(" Baseline ", cpu).unwrap(), SimdLevel::Baseline);
    assert_eq!(SimdLevel::parse("avx2", SimdLevel::Avx512).unwrap(), SimdLevel::Avx2);
    assert_eq!(SimdLevel::parse("avx512", SimdLevel::Avx512).unwrap(), SimdLevel::Avx512);
    let bad = SimdLevel::parse("sse9", cpu).unwrap_err().to_string();
    assert!(bad.contains("ALLGRAD_CPU_SIMD") && bad.contains("sse9") && bad.contains("avx512"), "{bad}");
    let above = SimdLevel::parse("avx512", SimdLevel::Avx2).unwrap_err().to_string();
    assert!(above.contains("ALLGRAD_CPU_SIMD") && above.contains("widest level is avx2"), "{above}");
}

/// In a child with `ALLGRAD_CPU_SIMD=sse9` (the variable is read once per process), the ops with
/// vectorised loops fail naming the variable; in a plain run (the variable unset, or a valid
/// value) they run at the level it names.
#[test]
fn a_bad_setting_fails_the_op_naming_the_variable() {
    let x = rand_tensor(&[4, 16], 3, DType::F32);
    let (g, b) = (rand_tensor(&[16], 4, DType::F32), rand_tensor(&[16], 5, DType::F32));
    match std::env::var("ALLGRAD_CPU_SIMD").ok().as_deref() {
        Some("sse9") => {
            let text = format!("{:?}", layer_norm(&x, &g, &b, 1e-5).unwrap_err());
            assert!(text.contains("ALLGRAD_CPU_SIMD") && text.contains("sse9"), "{text}");
            let text = format!("{:?}", gelu_erf(&x).unwrap_err());
            assert!(text.contains("ALLGRAD_CPU_SIMD"), "{text}");
            assert!(simd_level().is_err());
        }
        value => {
            let want = SimdLevel::parse(value.unwrap_or("auto"), SimdLevel::detected()).unwrap();
            assert_eq!(simd_level().unwrap(), want);
            layer_norm(&x, &g, &b, 1e-5).unwrap();
            let exe = std::env::current_exe().unwrap();
            let mut cmd = std::process::Command::new(exe);
            cmd.args(["--exact", "simd::a_bad_setting_fails_the_op_naming_the_variable", "--test-threads", "1"]);
            cmd.env("ALLGRAD_CPU_SIMD", "sse9");
            let (out, _) = allgrad_testkit::process::run(
                &mut cmd,
                "the test in a child with ALLGRAD_CPU_SIMD=sse9",
                Duration::from_secs(120),
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

/// `x·a + b` per channel, composed from Candle's broadcast ops in f64 (the output narrowed to
/// the input's dtype).
fn channel_affine_composed(x: &Tensor, a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    let c = x.dim(1)?;
    let wide = |t: &Tensor| t.to_dtype(DType::F64);
    let (a, b) = (wide(a)?.reshape((1, c, 1, 1))?, wide(b)?.reshape((1, c, 1, 1))?);
    wide(x)?.broadcast_mul(&a)?.broadcast_add(&b)?.to_dtype(x.dtype())
}

#[test]
fn the_channel_sums_at_every_simd_level_match_their_composition_with_the_same_bits() {
    // Rows of 35 and 9216 (the 8 f64 partial sums and a tail): `channel_moments`' (Σx, Σx²) per
    // channel (one kernel; its backward is composed) and `channel_affine`'s parameter gradients
    // (one kernel in its backward), against Candle's sums in f64.
    for (shape, seed) in [([2usize, 3, 5, 7], 51u64), ([4, 2, 96, 96], 55)] {
        for dtype in [DType::F64, DType::F32] {
            let c = shape[1];
            let x = rand_tensor(&shape, seed, dtype).affine(2.0, 0.7).unwrap();
            let r = rand_tensor(&[2, c], seed + 1, dtype);
            let tol = if dtype == DType::F64 { 1e-12 } else { 1e-6 };
            let fused = |t: &[&Tensor]| allgrad_nn::channel_moments(t[0])?.to_dtype(t[0].dtype());
            let composed = |t: &[&Tensor]| {
                let x = t[0].to_dtype(DType::F64)?;
                let dims = &[0usize, 2, 3][..];
                Tensor::stack(&[x.sum(dims)?, x.sqr()?.sum(dims)?], 0)?.to_dtype(t[0].dtype())
            };
            check_levels_of(
                &format!("channel_moments {shape:?}"),
                &fused,
                &composed,
                std::slice::from_ref(&x),
                &r,
                1,
                false,
                tol,
            );
            let (a, b) = ((rand_tensor(&[c], seed + 2, dtype) + 1.5).unwrap(), rand_tensor(&[c], seed + 3, dtype));
            let r = rand_tensor(&shape, seed + 4, dtype);
            let fused = |t: &[&Tensor]| allgrad_nn::channel_affine(t[0], t[1], t[2]);
            let composed = |t: &[&Tensor]| channel_affine_composed(t[0], t[1], t[2]);
            check_levels_of(&format!("channel_affine {shape:?}"), &fused, &composed, &[x, a, b], &r, 1, false, tol);
        }
    }
}

#[test]
fn conv2d_im2col_at_every_simd_level_matches_candle_with_the_same_bits() {
    // 3x3 stride 2 (never Winograd): im2col in the forward and the weight gradient, col2im in
    // the input gradient, against Candle's conv2d and its autograd in f64.
    use allgrad_nn::{conv2d, ConvParams};
    let p = ConvParams { stride: 2, padding: 1, dilation: 1, groups: 1 };
    for dtype in [DType::F64, DType::F32] {
        let x = rand_tensor(&[2, 3, 9, 11], 61, dtype);
        let w = rand_tensor(&[4, 3, 3, 3], 62, dtype);
        let r = rand_tensor(&[2, 4, 5, 6], 63, dtype);
        let fused = |t: &[&Tensor]| conv2d(t[0], t[1], p);
        let composed = |t: &[&Tensor]| {
            let (x, w) = (t[0].to_dtype(DType::F64)?, t[1].to_dtype(DType::F64)?);
            x.conv2d(&w, 1, 2, 1, 1)?.to_dtype(t[0].dtype())
        };
        let tol = if dtype == DType::F64 { 1e-12 } else { 1e-6 };
        check_levels_of("conv2d", &fused, &composed, &[x, w], &r, 3, false, tol);
    }
}
