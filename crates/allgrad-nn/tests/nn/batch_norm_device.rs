//! Batch norm's device path on the CPU ([`allgrad_nn::transfer::set_device_path`]): statistics
//! as tensors ([`batch_moments`] → [`batch_statistics`] → the coefficients op), the backward's
//! sums, their cross-rank sum and coefficients as tensors, against the host path (the CPU
//! default) for every tail, batch and fixed statistics, f64, f32 and bf16: outputs and
//! gradients bit for bit, and no host read or upload inside the forward or the backward. The
//! finalize op's statistics against a plain f64 computation; the cross-rank sum of the backward
//! as a tensor against the host's; bad tables named.

use std::sync::{Arc, Barrier, Mutex};

use allgrad_nn::transfer::set_device_path;
use allgrad_nn::{batch_moments, batch_norm, batch_statistics, host_traffic, BnBranch, BnStats, BnTail, ChannelSum, TensorSum};
use candle_core::{DType, Device, Tensor, Var};

use crate::common::{err_text, rand_tensor, to_f64_vec};

const EPS: f64 = 1e-5;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Tail {
    Identity,
    Relu,
    AddRelu,
    AddBnRelu,
}

/// Host statistics of `x` as the models' host path computes them (moments in f64).
fn host_stats(x: &Tensor, sum: Option<ChannelSum>) -> BnStats {
    let c = x.dim(1).unwrap();
    let m = to_f64_vec(&allgrad_nn::channel_moments(&x.detach()).unwrap());
    let n = (x.elem_count() / c) as f64;
    let mean: Vec<f64> = m[..c].iter().map(|s| s / n).collect();
    let var: Vec<f64> = m[c..].iter().zip(&mean).map(|(s2, m)| s2 / n - m * m).map(|v| if v < 0.0 { 0.0 } else { v }).collect();
    BnStats::Batch { mean, var, count: n, sum_over_ranks: sum }
}

/// Device statistics of `x`: the finalize op on the moments.
fn device_stats(x: &Tensor, sum: Option<TensorSum>) -> BnStats {
    BnStats::BatchOnDevice { table: batch_statistics(&batch_moments(x).unwrap()).unwrap(), sum_over_ranks: sum }
}

fn fixed(c: usize, seed: u64, device: bool) -> BnStats {
    let mean = (rand_tensor(&[c], seed, DType::F64) * 0.3).unwrap();
    let var = (rand_tensor(&[c], seed + 1, DType::F64) + 1.2).unwrap();
    if device {
        BnStats::FixedOnDevice { mean: mean.to_dtype(DType::F32).unwrap(), var: var.to_dtype(DType::F32).unwrap() }
    } else {
        // The values a device tensor of f32 holds, so both paths normalise with the same.
        let r = |t: &Tensor| to_f64_vec(&t.to_dtype(DType::F32).unwrap());
        BnStats::Fixed { mean: r(&mean), var: r(&var) }
    }
}

/// Output, gradients of `Σ w·y` for (x, γ, β, third, γ', β'), and the traffic of the forward
/// and backward, on the path `device` picks.
fn run(shape: &[usize], dtype: DType, tail: Tail, batch: bool, device: bool) -> (Vec<Vec<f64>>, allgrad_nn::HostTraffic) {
    let c = shape[1];
    // Parameters are f32 with bf16 activations (autocast), else of the activations' dtype.
    let pdt = if dtype == DType::BF16 { DType::F32 } else { dtype };
    let var = |t: Tensor, dt: DType| Var::from_tensor(&t.to_dtype(dt).unwrap()).unwrap();
    let x = var(rand_tensor(shape, 1, DType::F64).affine(2.0, 0.7).unwrap(), dtype);
    let third = var(rand_tensor(shape, 11, DType::F64).affine(1.5, -0.4).unwrap(), dtype);
    let (g1, b1) = (var((rand_tensor(&[c], 2, DType::F64) + 1.5).unwrap(), pdt), var(rand_tensor(&[c], 3, DType::F64), pdt));
    let (g2, b2) = (var((rand_tensor(&[c], 12, DType::F64) + 0.8).unwrap(), pdt), var(rand_tensor(&[c], 13, DType::F64), pdt));
    let w = rand_tensor(shape, 5, dtype);
    let was = set_device_path(device);
    let before = host_traffic();
    let stats = |t: &Tensor, seed| match (batch, device) {
        (true, true) => device_stats(t, None),
        (true, false) => host_stats(t, None),
        // The test's fixed statistics are its inputs, made (uploaded) before the op runs: not
        // the op's traffic.
        (false, d) => candle_core::host_traffic::uncounted(|| fixed(c, seed, d)),
    };
    let (s1, s2) = (stats(x.as_tensor(), 6), stats(third.as_tensor(), 16));
    let branch = BnBranch { x: third.as_tensor(), weight: g2.as_tensor(), bias: b2.as_tensor(), stats: &s2, eps: EPS };
    let t = match tail {
        Tail::Identity => BnTail::Identity,
        Tail::Relu => BnTail::Relu,
        Tail::AddRelu => BnTail::AddRelu(third.as_tensor()),
        Tail::AddBnRelu => BnTail::AddBnRelu(&branch),
    };
    let y = batch_norm(x.as_tensor(), g1.as_tensor(), b1.as_tensor(), &s1, EPS, t).unwrap();
    let grads =
        (y.to_dtype(DType::F64).unwrap() * w.to_dtype(DType::F64).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
    let traffic = host_traffic() - before;
    set_device_path(was);
    let mut out = vec![to_f64_vec(&y)];
    let mut vars = vec![&x, &g1, &b1];
    match tail {
        Tail::AddRelu => vars.push(&third),
        Tail::AddBnRelu => vars.extend([&third, &g2, &b2]),
        _ => {}
    }
    for v in vars {
        out.push(to_f64_vec(grads.get(v.as_tensor()).expect("a gradient")));
    }
    (out, traffic)
}

#[test]
fn the_device_path_equals_the_host_path_bitwise_and_reads_nothing() {
    for tail in [Tail::Identity, Tail::Relu, Tail::AddRelu, Tail::AddBnRelu] {
        for shape in [&[4, 3, 5, 6][..], &[9, 5], &[3, 7, 1, 33]] {
            for dtype in [DType::F64, DType::F32, DType::BF16] {
                for batch in [true, false] {
                    let what = format!("{tail:?} {shape:?} {dtype:?} batch={batch}");
                    let (host, _) = run(shape, dtype, tail, batch, false);
                    let (dev, traffic) = run(shape, dtype, tail, batch, true);
                    assert_eq!(host.len(), dev.len());
                    for (i, (a, b)) in dev.iter().zip(&host).enumerate() {
                        assert!(a == b, "{what}: output {i} differs between the device and the host path");
                    }
                    // Fixed statistics come from device tensors too: nothing crosses either way.
                    assert_eq!(traffic, Default::default(), "{what}: the device path read or uploaded");
                }
            }
        }
    }
}

#[test]
fn the_device_path_is_taken_and_host_statistics_are_uploaded_and_counted() {
    // A host-path caller's statistics on the device path are computed from a read of the input
    // and uploaded once per normalisation (both counted), and their host cross-rank sum reads and
    // uploads once per backward: the counters see the path; with device tables the same call
    // reads and uploads nothing (above).
    let x = Var::from_tensor(&rand_tensor(&[4, 3, 2, 2], 1, DType::F64)).unwrap();
    let (g, b) = (rand_tensor(&[3], 2, DType::F64), rand_tensor(&[3], 3, DType::F64));
    let sum: ChannelSum = Arc::new(|_: &mut [f64]| Ok(()));
    let was = set_device_path(true);
    let before = host_traffic();
    let y = batch_norm(x.as_tensor(), &g, &b, &host_stats(x.as_tensor(), Some(sum)), EPS, BnTail::Relu).unwrap();
    let mid = host_traffic();
    y.sum_all().unwrap().backward().unwrap();
    let (fwd, bwd) = (mid - before, host_traffic() - mid);
    set_device_path(was);
    assert_eq!((fwd.reads, fwd.uploads), (1, 1), "forward: {fwd:?}");
    assert_eq!((bwd.reads, bwd.uploads), (1, 1), "backward: {bwd:?}");
}

#[test]
fn the_statistics_op_equals_a_plain_f64_computation() {
    for shape in [&[5, 4, 3, 7][..], &[11, 6], &[1, 2, 1, 1]] {
        let x = rand_tensor(shape, 21, DType::F64).affine(3.0, 1.7).unwrap();
        let (n, c) = (shape[0], shape[1]);
        let inner: usize = shape[2..].iter().product();
        let v = to_f64_vec(&x);
        let table = to_f64_vec(&batch_statistics(&batch_moments(&x).unwrap()).unwrap());
        assert_eq!(table.len(), 3 * c + 1);
        let count = (n * inner) as f64;
        assert_eq!(table[3 * c], count);
        for ch in 0..c {
            let vals: Vec<f64> = (0..n).flat_map(|i| v[(i * c + ch) * inner..(i * c + ch + 1) * inner].to_vec()).collect();
            let mean = vals.iter().sum::<f64>() / count;
            let var = vals.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / count;
            let unbiased = var * count / (count - 1.0).max(1.0);
            let what = format!("{shape:?} channel {ch}");
            allgrad_testkit::close::assert_rel(&[table[ch]], &[mean], 1e-12, &format!("mean of {what}"));
            // Σx²/n − mean² against the two-pass variance: the cancellation costs ~mean²/var ulps.
            allgrad_testkit::close::assert_rel(&[table[c + ch]], &[var], 1e-12, &format!("variance of {what}"));
            allgrad_testkit::close::assert_rel(&[table[2 * c + ch]], &[unbiased], 1e-12, &format!("unbiased variance of {what}"));
        }
    }
}

/// A two-party all_reduce of f64 tensors for two threads (the device path's [`TensorSum`]).
fn two_party_tensor_sum() -> [TensorSum; 2] {
    let total: Arc<Mutex<Vec<f64>>> = Arc::new(Mutex::new(Vec::new()));
    let barrier = Arc::new(Barrier::new(2));
    let party = || -> TensorSum {
        let (total, barrier) = (total.clone(), barrier.clone());
        Arc::new(move |t: &Tensor| {
            let s = to_f64_vec(t);
            {
                let mut tot = total.lock().unwrap();
                if tot.is_empty() {
                    tot.resize(s.len(), 0.0);
                }
                tot.iter_mut().zip(&s).for_each(|(a, b)| *a += b);
            }
            barrier.wait();
            let v = total.lock().unwrap().clone();
            barrier.wait();
            total.lock().unwrap().clear();
            Tensor::from_vec(v, t.shape(), t.device())
        })
    };
    [party(), party()]
}

#[test]
fn the_backward_sums_summed_over_ranks_as_tensors_give_the_whole_batchs_gradient() {
    // Two threads hold half the batch each, with the statistics of the whole batch (as
    // SyncBatchNorm gives them): ∂x of each half equals the whole batch's rows, and γ's, β's
    // gradients summed over the halves equal the whole batch's.
    let shape = [6, 3, 4, 5];
    let x = rand_tensor(&shape, 1, DType::F64).affine(2.0, 0.7).unwrap();
    let (g, b) = ((rand_tensor(&[3], 2, DType::F64) + 1.5).unwrap(), rand_tensor(&[3], 3, DType::F64));
    let wt = rand_tensor(&shape, 5, DType::F64);
    let table = batch_statistics(&batch_moments(&x).unwrap()).unwrap();
    let grads = |x: &Tensor, wt: &Tensor, sum: Option<TensorSum>| {
        let was = set_device_path(true);
        let vars = [x, &g, &b].map(|t| Var::from_tensor(t).unwrap());
        let stats = BnStats::BatchOnDevice { table: table.clone(), sum_over_ranks: sum };
        let y = batch_norm(vars[0].as_tensor(), vars[1].as_tensor(), vars[2].as_tensor(), &stats, EPS, BnTail::Relu).unwrap();
        let gr = (y * wt).unwrap().sum_all().unwrap().backward().unwrap();
        set_device_path(was);
        vars.map(|v| to_f64_vec(gr.get(v.as_tensor()).unwrap()))
    };
    let whole = grads(&x, &wt, None);
    let rows = |t: &Tensor, r: usize| t.narrow(0, 3 * r, 3).unwrap();
    let [s0, s1] = two_party_tensor_sum();
    let halves: Vec<[Vec<f64>; 3]> = std::thread::scope(|scope| {
        let grads = &grads;
        let hs: Vec<_> = [(0, s0), (1, s1)]
            .into_iter()
            .map(|(r, s)| {
                let (x, wt) = (rows(&x, r), rows(&wt, r));
                scope.spawn(move || grads(&x, &wt, Some(s)))
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("a rank thread panicked")).collect()
    });
    let half = whole[0].len() / 2;
    for (r, h) in halves.iter().enumerate() {
        allgrad_testkit::close::assert_rel(&h[0], &whole[0][r * half..(r + 1) * half], 1e-12, &format!("dx of rank {r}"));
    }
    for p in 1..3 {
        let sum: Vec<f64> = halves[0][p].iter().zip(&halves[1][p]).map(|(a, b)| a + b).collect();
        allgrad_testkit::close::assert_rel(&sum, &whole[p], 1e-12, &format!("parameter gradient {p} summed over ranks"));
    }
}

#[test]
fn bad_tables_are_errors_that_name_them() {
    let x = rand_tensor(&[2, 3, 2], 1, DType::F64);
    let (g, b) = (rand_tensor(&[3], 2, DType::F64), rand_tensor(&[3], 3, DType::F64));
    let short = BnStats::BatchOnDevice { table: Tensor::zeros(7, DType::F64, &Device::Cpu).unwrap(), sum_over_ranks: None };
    let e = err_text(batch_norm(&x, &g, &b, &short, EPS, BnTail::Identity));
    assert!(e.contains("2 channels given for 3"), "{e}");
    let wrong = BnStats::BatchOnDevice { table: Tensor::zeros(10, DType::F32, &Device::Cpu).unwrap(), sum_over_ranks: None };
    let e = err_text(batch_norm(&x, &g, &b, &wrong, EPS, BnTail::Identity));
    assert!(e.contains("flat f64 tensor of 3·C + 1 values"), "{e}");
    let e = err_text(batch_statistics(&Tensor::zeros(4, DType::F64, &Device::Cpu).unwrap()));
    assert!(e.contains("2·C + 1"), "{e}");
    let fixed = BnStats::FixedOnDevice {
        mean: Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap(),
        var: Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap(),
    };
    let e = err_text(batch_norm(&x, &g, &b, &fixed, EPS, BnTail::Identity));
    assert!(e.contains("[2] and [3] given for 3 channels"), "{e}");
}
