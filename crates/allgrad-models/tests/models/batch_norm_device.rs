//! SyncBatchNorm on the device path (CPU tensors with
//! [`allgrad_nn::transfer::set_device_path`], the code path CUDA tensors take): the moments
//! all-reduced as a tensor, the statistics, coefficients and running statistics from the
//! finalize ops, the backward's sums all-reduced as tensors. For every tail (none, ReLU, skip
//! add + ReLU, normalised shortcut) at W = 1, 2 and 3 with uneven, asymmetric rows per rank, in
//! f64: the output, every gradient and the running statistics equal the host path's (the CPU
//! default) to 1e-10, the W-rank run equals one rank on the whole batch, and the forward and
//! backward read nothing from the device and upload nothing.

use allgrad_dist::run_threads;
use allgrad_models::batch_norm::{BatchNorm, BnTail, Mode};
use allgrad_nn::transfer::set_device_path;
use allgrad_nn::{host_traffic, HostTraffic};
use allgrad_testkit::close::assert_rel;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};

const C: usize = 3;
/// Rows of the global batch each rank holds, per world size (uneven).
fn split(w: usize) -> Vec<usize> {
    match w {
        1 => vec![7],
        2 => vec![4, 3],
        _ => vec![3, 2, 2],
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Tail {
    Identity,
    Relu,
    AddRelu,
    Shortcut,
}

/// Fixed, asymmetric values of shape `[rows, C, 2, 3]` (rows `start..start + rows` of the
/// global batch).
fn data(start: usize, rows: usize, seed: usize) -> Tensor {
    let per = C * 6;
    let v: Vec<f64> = (start * per..(start + rows) * per)
        .map(|i| (((i * 37 + seed * 11) % 29) as f64 - 13.0) / 5.0 + seed as f64 * 0.1)
        .collect();
    Tensor::from_vec(v, (rows, C, 2, 3), &Device::Cpu).unwrap()
}

/// What one rank's step gives: `[y, ∂x, ∂third, ∂γ, ∂β, ∂γ', ∂β', running mean, running var,
/// shortcut running mean, shortcut running var]` (flattened f64), and its forward and backward
/// traffic.
type RankOut = (Vec<Vec<f64>>, HostTraffic);

fn step(w: usize, tail: Tail, device: bool) -> Vec<RankOut> {
    run_threads(w, move |pg| {
        let rank = pg.rank();
        let rows = split(w);
        let start: usize = rows[..rank].iter().sum();
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, DType::F64, &Device::Cpu);
        let bn = BatchNorm::new(C, true, vb.pp("bn"))?;
        let short = BatchNorm::new(C, true, vb.pp("short"))?;
        for (name, var) in vm.data().lock().unwrap().iter() {
            let seed = name.len() as f64;
            let v: Vec<f64> = (0..C).map(|i| 0.5 + 0.3 * i as f64 + 0.07 * seed).collect();
            var.set(&Tensor::new(v.as_slice(), &Device::Cpu)?)?;
        }
        let x = Var::from_tensor(&data(start, rows[rank], 1))?;
        let third = Var::from_tensor(&data(start, rows[rank], 2))?;
        let wt = data(start, rows[rank], 3);
        let was = set_device_path(device);
        let mode = Mode { train: true, pg: &pg };
        let before = host_traffic();
        let y = match tail {
            Tail::Identity => bn.forward(x.as_tensor(), mode)?,
            Tail::Relu => bn.forward_then(x.as_tensor(), mode, BnTail::Relu)?,
            Tail::AddRelu => bn.forward_then(x.as_tensor(), mode, BnTail::AddRelu(third.as_tensor()))?,
            Tail::Shortcut => bn.forward_add_shortcut(x.as_tensor(), mode, &short, third.as_tensor())?,
        };
        let grads = (&y * &wt)?.sum_all()?.backward()?;
        let traffic = host_traffic() - before;
        set_device_path(was);
        let flat = |t: &Tensor| t.flatten_all()?.to_vec1::<f64>();
        let grad = |t: &Tensor| grads.get(t).map(flat).transpose().map(Option::unwrap_or_default);
        let vars = vm.data().lock().unwrap().clone();
        let param = |n: &str| grad(vars[n].as_tensor());
        let (rm, rv) = bn.running_stats();
        let (srm, srv) = short.running_stats();
        let out = vec![
            flat(&y)?,
            grad(x.as_tensor())?,
            grad(third.as_tensor())?,
            param("bn.weight")?,
            param("bn.bias")?,
            param("short.weight")?,
            param("short.bias")?,
            flat(&rm)?,
            flat(&rv)?,
            flat(&srm)?,
            flat(&srv)?,
        ];
        Ok((out, traffic))
    })
    .unwrap()
}

const NAMES: [&str; 11] =
    ["y", "dx", "dthird", "dgamma", "dbeta", "dgamma'", "dbeta'", "running mean", "running var", "running mean'", "running var'"];

#[test]
fn sync_batch_norm_on_the_device_path_equals_the_host_path_and_one_rank_and_reads_nothing() {
    for tail in [Tail::Identity, Tail::Relu, Tail::AddRelu, Tail::Shortcut] {
        let one = step(1, tail, false);
        for w in 1..=3 {
            let host = step(w, tail, false);
            let dev = step(w, tail, true);
            let rows = split(w);
            for r in 0..w {
                let what = |i: usize| format!("{tail:?} W={w} rank {r}: {}", NAMES[i]);
                for (i, (a, b)) in dev[r].0.iter().zip(&host[r].0).enumerate() {
                    assert_eq!(a.len(), b.len(), "{}", what(i));
                    if !b.is_empty() {
                        assert_rel(a, b, 1e-10, &format!("{} (device path vs host path)", what(i)));
                    }
                }
                assert_eq!(dev[r].1, HostTraffic::default(), "{tail:?} W={w} rank {r}: the device path read or uploaded");
                // Against one rank on the whole batch: this rank's rows of y, ∂x and ∂third, and
                // the running statistics (global on every rank).
                let start: usize = rows[..r].iter().sum::<usize>() * C * 6;
                let len = rows[r] * C * 6;
                for i in [0, 1, 2] {
                    if !one[0].0[i].is_empty() {
                        assert_rel(&dev[r].0[i], &one[0].0[i][start..start + len], 1e-10, &format!("{} vs W=1", what(i)));
                    }
                }
                for i in 7..11 {
                    assert_rel(&dev[r].0[i], &one[0].0[i], 1e-10, &format!("{} vs W=1", what(i)));
                }
            }
            // Parameter gradients: this rank's sums; over the ranks, the whole batch's.
            for (i, name) in NAMES.iter().enumerate().take(7).skip(3) {
                if one[0].0[i].is_empty() {
                    continue;
                }
                let sum: Vec<f64> = (0..C).map(|c| dev.iter().map(|d| d.0[i][c]).sum()).collect();
                assert_rel(&sum, &one[0].0[i], 1e-10, &format!("{tail:?} W={w}: {name} summed over ranks vs W=1"));
            }
        }
    }
}
