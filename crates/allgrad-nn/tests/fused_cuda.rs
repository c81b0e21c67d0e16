//! The fused element-wise ops' CUDA kernels (feature `cuda`) against their CPU kernels:
//! `relu`, `add_relu`, `gelu_erf`, `layer_norm`, `channel_moments` and `batch_norm` with every tail (none, ReLU, skip
//! add + ReLU, normalised shortcut add + ReLU) under batch and fixed statistics, outputs and
//! every gradient, on odd shapes (and a strided input), in f64 (relative 1e-10) and f32
//! (relative 1e-5), and bf16 activations with f32 parameters (autocast).
//!
//! It needs the `cuda` feature and a GPU (`scripts/ci/gpu_ci.sh`). Without either every test
//! skips by name, saying why (`allgrad_testkit::skip`), unless ALLGRAD_REQUIRE_GPU=1, which
//! makes that a failure. It compares the kernels, so it refuses to run with
//! ALLGRAD_CUDA_FUSED=0 (then `batch_norm` refuses CUDA inputs, and `relu` is Candle's, whose
//! derivative at 0 is 1).

use allgrad_nn::{add_relu, batch_norm, channel_moments, gelu_erf, layer_norm, relu, BnBranch, BnStats, BnTail};
use allgrad_testkit::hashed_values as values;
use candle_core::{DType, Device, Result, Tensor, Var};

fn gpu() -> Option<Device> {
    if !cfg!(feature = "cuda") {
        allgrad_testkit::skip(allgrad_testkit::Need::Gpu, "this test binary was built without the `cuda` feature");
        return None;
    }
    let off = std::env::var("ALLGRAD_CUDA_FUSED").is_ok_and(|v| v.trim() == "0");
    assert!(!off, "ALLGRAD_CUDA_FUSED=0 turns off the CUDA kernels this test compares with the CPU kernels: unset it");
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            // A failure instead where a GPU is required (ALLGRAD_REQUIRE_GPU=1).
            allgrad_testkit::skip(allgrad_testkit::Need::Gpu, &format!("no CUDA device ({e})"));
            None
        }
    }
}

/// A tracked tensor of `dims` with values from `salt` (scaled and shifted), of dtype `dt` on `dev`.
fn var(dev: &Device, dt: DType, dims: &[usize], salt: u64, scale: f64, shift: f64) -> Result<Var> {
    let v: Vec<f64> = values(dims.iter().product(), salt).iter().map(|v| v * scale + shift).collect();
    Var::from_tensor(&Tensor::from_vec(v, dims, &Device::Cpu)?.to_dtype(dt)?.to_device(dev)?)
}

fn host(t: &Tensor) -> Result<Vec<f64>> {
    t.flatten_all()?.to_dtype(DType::F64)?.to_device(&Device::Cpu)?.to_vec1()
}

/// `Σ y ⊙ c` for a fixed `c`: a loss whose gradient with respect to `y` is `c`.
fn loss(y: &Tensor, salt: u64) -> Result<Tensor> {
    let c =
        Tensor::from_vec(values(y.elem_count(), salt), y.shape(), &Device::Cpu)?.to_dtype(y.dtype())?.to_device(y.device())?;
    (y * c)?.sum_all()
}

/// Norm-wise relative error within `rel` (`allgrad_testkit::close`).
fn check(what: &str, gpu: &[f64], cpu: &[f64], rel: f64) {
    allgrad_testkit::close::assert_rel(gpu, cpu, rel, what);
}

/// Output, ∂a and ∂b of `relu(a)` (`add`: `add_relu(a, b)`) on `dev`; `a` is a transposed
/// (strided) view.
fn run_relu(dev: &Device, dt: DType, add: bool) -> Result<Vec<Vec<f64>>> {
    let a = var(dev, dt, &[3, 7, 5, 9], 1, 1.0, 0.1)?;
    let b = var(dev, dt, &[3, 5, 7, 9], 2, 1.0, 0.0)?;
    let at = a.as_tensor().transpose(1, 2)?;
    let y = if add { add_relu(&at, b.as_tensor())? } else { relu(&at)? };
    let grads = loss(&y, 3)?.backward()?;
    let mut out = vec![host(&y)?, host(grads.get(&a).expect("a is tracked"))?];
    if add {
        out.push(host(grads.get(&b).expect("b is tracked"))?);
    }
    Ok(out)
}

#[test]
fn relu_and_add_relu_on_cuda_equal_the_cpu_kernels() {
    let Some(dev) = gpu() else { return };
    // Both sides compute max(a + b, 0) in the same precision (bf16: in f32, rounded to nearest
    // even once), so the tolerances could be 0; the project's usual ones are kept for f64/f32.
    for (dt, rel) in [(DType::F64, 1e-10), (DType::F32, 1e-5), (DType::BF16, 0.0)] {
        for add in [false, true] {
            let name = if add { "add_relu" } else { "relu" };
            let cpu = run_relu(&Device::Cpu, dt, add).unwrap();
            let cuda = run_relu(&dev, dt, add).unwrap();
            for (i, part) in ["output", "∂a", "∂b"].iter().take(cpu.len()).enumerate() {
                check(&format!("{name} {dt:?} {part}"), &cuda[i], &cpu[i], rel);
            }
        }
    }
}

#[test]
fn gelu_on_cuda_equals_the_cpu_kernel() {
    let Some(dev) = gpu() else { return };
    // f64: CUDA's erf and exp against the CPU's, both within a few ulp. f32: the CPU's erf is a
    // vectorised formula (absolute error below 3e-7), CUDA's erff within 2 ulp. bf16: both
    // compute in f32 and round once, so a value near a rounding boundary may land one bf16 step
    // (2^-8 relative) apart.
    for (dt, rel) in [(DType::F64, 1e-10), (DType::F32, 1e-5), (DType::BF16, 2f64.powi(-7))] {
        let run = |dev: &Device| -> Result<Vec<Vec<f64>>> {
            // Values over [-4, 4] (the tails, where erf saturates) through a strided view.
            let x = var(dev, dt, &[5, 7, 33], 7, 4.0, 0.0)?;
            let xt = x.as_tensor().transpose(0, 2)?;
            let y = gelu_erf(&xt)?;
            let grads = loss(&y, 8)?.backward()?;
            Ok(vec![host(&y)?, host(grads.get(&x).expect("x is tracked"))?])
        };
        let (cpu, cuda) = (run(&Device::Cpu).unwrap(), run(&dev).unwrap());
        for (i, part) in ["output", "∂x"].iter().enumerate() {
            check(&format!("gelu_erf {dt:?} {part}"), &cuda[i], &cpu[i], rel);
        }
    }
}

#[test]
fn layer_norm_on_cuda_equals_the_cpu_kernel() {
    let Some(dev) = gpu() else { return };
    // Row sums in a block's tree order on CUDA, sequentially on the CPU: equal to f64 / f32
    // tolerance. Rows shorter and longer than a block (256 threads), a strided input, and 300
    // rows of 45 (five row parts of the columns' two-stage sums, a partial column tile).
    for (dt, rel) in [(DType::F64, 1e-10), (DType::F32, 1e-5)] {
        for (dims, strided) in
            [(&[6usize, 37][..], false), (&[3, 5, 384], false), (&[2, 1000], false), (&[40, 3, 7], true), (&[300, 45], false)]
        {
            let run = |dev: &Device| -> Result<Vec<Vec<f64>>> {
                let x = var(dev, dt, dims, 11, 2.0, 0.5)?;
                let d = if strided { dims[1] } else { *dims.last().unwrap() };
                let gamma = var(dev, dt, &[d], 12, 1.0, 1.0)?;
                let beta = var(dev, dt, &[d], 13, 1.0, 0.0)?;
                // The strided case normalises over dim 1 of x, moved last by a transpose.
                let xt = if strided { x.as_tensor().transpose(1, 2)? } else { x.as_tensor().clone() };
                let y = layer_norm(&xt, gamma.as_tensor(), beta.as_tensor(), 1e-5)?;
                let grads = loss(&y, 14)?.backward()?;
                let g = |v: &Var| host(grads.get(v).expect("tracked"));
                Ok(vec![host(&y)?, g(&x)?, g(&gamma)?, g(&beta)?])
            };
            let (cpu, cuda) = (run(&Device::Cpu).unwrap(), run(&dev).unwrap());
            for (i, part) in ["output", "∂x", "∂γ", "∂β"].iter().enumerate() {
                check(&format!("layer_norm {dims:?} strided {strided} {dt:?} {part}"), &cuda[i], &cpu[i], rel);
            }
        }
    }
}

#[test]
fn channel_moments_on_cuda_equal_the_cpu_kernel() {
    let Some(dev) = gpu() else { return };
    for dims in [[3usize, 5, 7, 9].as_slice(), &[5, 3], &[2, 6, 1, 33]] {
        for dt in [DType::F64, DType::F32, DType::BF16] {
            let run = |d: &Device| -> Result<Vec<f64>> {
                let x = var(d, dt, dims, 4, 2.0, 3.0)?;
                host(&channel_moments(x.as_tensor())?)
            };
            // The sums are f64 on both sides, of the same (exactly widened) values, in another
            // order: f64 rounding only, whatever the input's dtype.
            check(&format!("channel_moments {dims:?} {dt:?}"), &run(&dev).unwrap(), &run(&Device::Cpu).unwrap(), 1e-10);
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Tail {
    Identity,
    Relu,
    AddRelu,
    AddBnRelu,
}

/// Batch statistics of `x` (biased variance over `N·inner` values per channel), computed in
/// f64 on the host: the same constants for both devices.
fn batch_stats(x: &Var) -> Result<BnStats> {
    let dims = x.dims().to_vec();
    let (n, c, inner) = (dims[0], dims[1], dims[2..].iter().product::<usize>());
    let v = host(x.as_tensor())?;
    let count = (n * inner) as f64;
    let (mut mean, mut var) = (vec![0f64; c], vec![0f64; c]);
    for ch in 0..c {
        let vals = (0..n).flat_map(|i| (0..inner).map(move |j| (i * c + ch) * inner + j)).map(|at| v[at]);
        mean[ch] = vals.clone().sum::<f64>() / count;
        var[ch] = vals.map(|x| (x - mean[ch]).powi(2)).sum::<f64>() / count;
    }
    Ok(BnStats::Batch { mean, var, count, sum_over_ranks: None })
}

/// Fixed statistics (as running ones would be), the same for both devices.
fn fixed_stats(c: usize, salt: u64) -> BnStats {
    let mean = values(c, salt).iter().map(|v| 0.3 * v).collect();
    let var = values(c, salt + 1).iter().map(|v| 1.0 + 0.5 * v).collect();
    BnStats::Fixed { mean, var }
}

/// Output and every gradient of `batch_norm(x) → tail` on `dev`: `[y, ∂x, ∂γ, ∂β]`, then `∂skip`
/// or the shortcut's `[∂x', ∂γ', ∂β']`. Activations in `dt`, parameters in `pdt`.
fn run_bn(dev: &Device, dt: DType, pdt: DType, dims: &[usize], tail: Tail, batch: bool) -> Result<Vec<Vec<f64>>> {
    let c = dims[1];
    let x = var(dev, dt, dims, 5, 1.5, 0.7)?;
    let w = var(dev, pdt, &[c], 6, 0.5, 1.0)?;
    let b = var(dev, pdt, &[c], 7, 0.5, 0.0)?;
    let skip = var(dev, dt, dims, 8, 1.0, 0.0)?;
    let (xs, ws, bs) =
        (var(dev, dt, dims, 9, 0.8, -0.4)?, var(dev, pdt, &[c], 10, 0.5, 1.0)?, var(dev, pdt, &[c], 11, 0.5, 0.0)?);
    let stats = if batch { batch_stats(&x)? } else { fixed_stats(c, 12) };
    let shortcut_stats = if batch { batch_stats(&xs)? } else { fixed_stats(c, 14) };
    let branch = BnBranch { x: xs.as_tensor(), weight: ws.as_tensor(), bias: bs.as_tensor(), stats: &shortcut_stats, eps: 1e-3 };
    let t = match tail {
        Tail::Identity => BnTail::Identity,
        Tail::Relu => BnTail::Relu,
        Tail::AddRelu => BnTail::AddRelu(skip.as_tensor()),
        Tail::AddBnRelu => BnTail::AddBnRelu(&branch),
    };
    let y = batch_norm(x.as_tensor(), w.as_tensor(), b.as_tensor(), &stats, 1e-5, t)?;
    let grads = loss(&y, 13)?.backward()?;
    let g = |v: &Var| host(grads.get(v).expect("tracked input has a gradient"));
    let mut out = vec![host(&y)?, g(&x)?, g(&w)?, g(&b)?];
    match tail {
        Tail::AddRelu => out.push(g(&skip)?),
        Tail::AddBnRelu => out.extend([g(&xs)?, g(&ws)?, g(&bs)?]),
        _ => {}
    }
    Ok(out)
}

#[test]
fn batch_norm_with_every_tail_on_cuda_equals_the_cpu_kernels() {
    let Some(dev) = gpu() else { return };
    // bf16 activations with f32 parameters (autocast): both sides compute in f32 and round each
    // stored value to bf16 once, but the f64 per-channel sums are added in another order, so
    // a value of ∂x near a rounding boundary may land one bf16 step (2^-8 relative) apart.
    let dtypes = [(DType::F64, DType::F64, 1e-10), (DType::F32, DType::F32, 1e-5), (DType::BF16, DType::F32, 2f64.powi(-7))];
    for dims in [[3usize, 5, 7, 9].as_slice(), &[7, 3], &[2, 4, 1, 37]] {
        for (dt, pdt, rel) in dtypes {
            for tail in [Tail::Identity, Tail::Relu, Tail::AddRelu, Tail::AddBnRelu] {
                for batch in [true, false] {
                    let cpu = run_bn(&Device::Cpu, dt, pdt, dims, tail, batch).unwrap();
                    let cuda = run_bn(&dev, dt, pdt, dims, tail, batch).unwrap();
                    let parts = ["output", "∂x", "∂γ", "∂β", "∂skip or ∂x'", "∂γ'", "∂β'"];
                    assert_eq!(cpu.len(), cuda.len());
                    for (i, part) in parts.iter().take(cpu.len()).enumerate() {
                        let what = format!("batch_norm {dims:?} {dt:?} {tail:?} batch statistics {batch}: {part}");
                        check(&what, &cuda[i], &cpu[i], rel);
                    }
                }
            }
        }
    }
}

/// The finalize ops on CUDA (`cuda/finalize.cu`) against their CPU twins on the same moments:
/// statistics bit for bit (the same f64 expressions, no contraction), and batch norm with
/// device statistics (the coefficients and backward-coefficients kernels, the sums and `∂x`
/// kernels reading the tables, the two-stage reductions with one and several parts per channel)
/// against the CPU's device path, every tail, odd shapes; and with
/// the device path the forward and backward make no host read or upload.
#[test]
fn the_finalize_ops_and_device_statistics_on_cuda_equal_the_cpu_twins() -> Result<()> {
    use allgrad_nn::transfer::set_device_path;
    use allgrad_nn::{batch_moments, batch_statistics, host_traffic};
    let Some(dev) = gpu() else { return Ok(()) };
    // Moments of one CPU tensor, run through the statistics op on each device.
    let x = Tensor::from_vec(values(5 * 7 * 3 * 11, 31), (5, 7, 3, 11), &Device::Cpu)?;
    let m = batch_moments(&x)?;
    let on_cpu = host(&batch_statistics(&m)?)?;
    let on_gpu = host(&batch_statistics(&m.to_device(&dev)?)?)?;
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&on_gpu), bits(&on_cpu), "the statistics kernel differs from its CPU twin");
    for (dt, rel) in [(DType::F64, 1e-10), (DType::F32, 1e-5)] {
        // [3, 5, 67, 71]: 14,271 values per channel, four parts of the two-stage reductions.
        for dims in [&[3usize, 5, 7, 9][..], &[13, 6], &[2, 3, 1, 67], &[3, 5, 67, 71]] {
            for tail in [Tail::Identity, Tail::Relu, Tail::AddRelu, Tail::AddBnRelu] {
                let run = |d: &Device| -> Result<(Vec<Vec<f64>>, allgrad_nn::HostTraffic)> {
                    let was = set_device_path(true);
                    let c = dims[1];
                    let x = var(d, dt, dims, 1, 2.0, 0.7)?;
                    let s = var(d, dt, dims, 11, 1.5, -0.4)?;
                    let (g1, b1) = (var(d, dt, &[c], 2, 0.5, 1.2)?, var(d, dt, &[c], 3, 0.5, 0.0)?);
                    let (g2, b2) = (var(d, dt, &[c], 12, 0.5, 0.9)?, var(d, dt, &[c], 13, 0.5, 0.0)?);
                    let before = host_traffic();
                    let stats = |t: &Var| -> Result<BnStats> {
                        Ok(BnStats::BatchOnDevice {
                            table: batch_statistics(&batch_moments(t.as_tensor())?)?,
                            sum_over_ranks: None,
                        })
                    };
                    let (s1, s2) = (stats(&x)?, stats(&s)?);
                    let branch =
                        BnBranch { x: s.as_tensor(), weight: g2.as_tensor(), bias: b2.as_tensor(), stats: &s2, eps: 1e-5 };
                    let t = match tail {
                        Tail::Identity => BnTail::Identity,
                        Tail::Relu => BnTail::Relu,
                        Tail::AddRelu => BnTail::AddRelu(s.as_tensor()),
                        Tail::AddBnRelu => BnTail::AddBnRelu(&branch),
                    };
                    let y = batch_norm(x.as_tensor(), g1.as_tensor(), b1.as_tensor(), &s1, 1e-5, t)?;
                    let grads = loss(&y, 7)?.backward()?;
                    let traffic = host_traffic() - before;
                    // The loss's own traffic (its constant's upload, the launch parameters of
                    // its broadcast gradient), measured alone on a tensor of y's shape: the
                    // batch norm's forward and backward must add nothing to it.
                    let z = Var::from_tensor(&y.detach())?;
                    let alone = host_traffic();
                    loss(z.as_tensor(), 7)?.backward()?;
                    let traffic = traffic - (host_traffic() - alone);
                    set_device_path(was);
                    let mut out = vec![host(&y)?];
                    for v in [&x, &s, &g1, &b1, &g2, &b2] {
                        if let Some(g) = grads.get(v.as_tensor()) {
                            out.push(host(g)?);
                        }
                    }
                    Ok((out, traffic))
                };
                let ((g, traffic), (c, _)) = (run(&dev)?, run(&Device::Cpu)?);
                assert_eq!(traffic, Default::default(), "{dt:?} {dims:?} {tail:?}: the device path read or uploaded on CUDA");
                assert_eq!(g.len(), c.len());
                for (i, (a, b)) in g.iter().zip(&c).enumerate() {
                    check(&format!("{dt:?} {dims:?} {tail:?} output {i}"), a, b, rel);
                }
            }
        }
    }
    Ok(())
}
