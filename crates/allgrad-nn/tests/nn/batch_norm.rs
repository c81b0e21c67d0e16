//! The fused batch norm (with its ReLU and residual tails, and the residual whose shortcut is
//! batch normalised too) against batch norm written with Candle's own broadcast ops and
//! autograd, in f64 and f32; against finite differences; and its cross-rank sum (the sum rule)
//! against one batch, with two threads standing for two ranks.

use std::sync::{mpsc, Arc, Barrier, Mutex};
use std::time::Duration;

use allgrad_nn::{batch_norm, BnBranch, BnStats, BnTail, ChannelSum};
use candle_core::{DType, Result, Tensor, Var};

use crate::common::{assert_close, err_text, fd_grad, rand_tensor, to_f64_vec};

const EPS: f64 = 1e-5;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Tail {
    Identity,
    Relu,
    AddRelu,
}

/// Per-channel reduction dims of an `[N, C, ...]` tensor and the `[1, C, 1, ...]` shape.
fn channel_dims(x: &Tensor) -> (Vec<usize>, Vec<usize>) {
    let dims: Vec<usize> = (0..x.rank()).filter(|&d| d != 1).collect();
    let shape: Vec<usize> = (0..x.rank()).map(|d| if d == 1 { x.dim(1).unwrap() } else { 1 }).collect();
    (dims, shape)
}

/// Batch statistics of `x` in f64, computed directly (mean, biased variance, count).
fn plain_stats(x: &Tensor) -> (Vec<f64>, Vec<f64>, f64) {
    let c = x.dim(1).unwrap();
    let v = to_f64_vec(x);
    let inner: usize = x.dims()[2..].iter().product();
    let n = x.dim(0).unwrap();
    let count = (n * inner) as f64;
    let mut mean = vec![0.0; c];
    let mut var = vec![0.0; c];
    for ch in 0..c {
        let vals: Vec<f64> = (0..n).flat_map(|i| v[(i * c + ch) * inner..(i * c + ch + 1) * inner].to_vec()).collect();
        mean[ch] = vals.iter().sum::<f64>() / count;
        var[ch] = vals.iter().map(|x| (x - mean[ch]).powi(2)).sum::<f64>() / count;
    }
    (mean, var, count)
}

/// The reference: batch norm from Candle's broadcast ops (statistics differentiated by Candle
/// when `batch`), then Candle's relu.
fn reference(
    x: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    skip: Option<&Tensor>,
    batch: bool,
    fixed: &(Vec<f64>, Vec<f64>),
) -> Result<Tensor> {
    let (dims, shape) = channel_dims(x);
    let (mean, var) = if batch {
        let mean = x.mean_keepdim(dims.as_slice())?;
        let var = x.broadcast_sub(&mean)?.sqr()?.mean_keepdim(dims.as_slice())?;
        (mean, var)
    } else {
        let dev = x.device();
        let m = Tensor::new(fixed.0.as_slice(), dev)?.to_dtype(x.dtype())?.reshape(shape.as_slice())?;
        let v = Tensor::new(fixed.1.as_slice(), dev)?.to_dtype(x.dtype())?.reshape(shape.as_slice())?;
        (m, v)
    };
    let xhat = x.broadcast_sub(&mean)?.broadcast_div(&(var + EPS)?.sqrt()?)?;
    let y = xhat.broadcast_mul(&gamma.reshape(shape.as_slice())?)?.broadcast_add(&beta.reshape(shape.as_slice())?)?;
    match skip {
        Some(s) => (y + s)?.relu(),
        None => Ok(y),
    }
}

/// The fused op on `x` with statistics taken as a caller would (batch or fixed).
fn fused(
    x: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    skip: Option<&Tensor>,
    tail: Tail,
    batch: bool,
    fixed: &(Vec<f64>, Vec<f64>),
) -> Result<Tensor> {
    let stats = if batch {
        let (mean, var, count) = plain_stats(x);
        BnStats::Batch { mean, var, count, sum_over_ranks: None }
    } else {
        BnStats::Fixed { mean: fixed.0.clone(), var: fixed.1.clone() }
    };
    let t = match (tail, skip) {
        (Tail::Identity, _) => BnTail::Identity,
        (Tail::Relu, _) => BnTail::Relu,
        (Tail::AddRelu, Some(s)) => BnTail::AddRelu(s),
        (Tail::AddRelu, None) => unreachable!(),
    };
    batch_norm(x, gamma, beta, &stats, EPS, t)
}

/// Value and gradients (x, γ, β, skip) of `Σ w·y` for the fused op or the reference.
fn run(shape: &[usize], dtype: DType, tail: Tail, batch: bool, use_fused: bool) -> Vec<Tensor> {
    let c = shape[1];
    let x = Var::from_tensor(&rand_tensor(shape, 1, DType::F64).affine(2.0, 0.7).unwrap().to_dtype(dtype).unwrap()).unwrap();
    let gamma = Var::from_tensor(&(rand_tensor(&[c], 2, dtype) + 1.5).unwrap()).unwrap();
    let beta = Var::from_tensor(&rand_tensor(&[c], 3, dtype)).unwrap();
    let skip = Var::from_tensor(&rand_tensor(shape, 4, dtype)).unwrap();
    let w = rand_tensor(shape, 5, dtype);
    let fixed = (
        to_f64_vec(&(rand_tensor(&[c], 6, DType::F64) * 0.3).unwrap()),
        to_f64_vec(&(rand_tensor(&[c], 7, DType::F64) + 1.2).unwrap()),
    );
    let skip_t = (tail == Tail::AddRelu).then(|| skip.as_tensor());
    let y = if use_fused {
        fused(x.as_tensor(), gamma.as_tensor(), beta.as_tensor(), skip_t, tail, batch, &fixed).unwrap()
    } else {
        let y = reference(x.as_tensor(), gamma.as_tensor(), beta.as_tensor(), skip_t, batch, &fixed).unwrap();
        if tail == Tail::Relu {
            y.relu().unwrap()
        } else {
            y
        }
    };
    let loss = (&y * &w).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    let mut out = vec![y.clone(), loss];
    for v in [&x, &gamma, &beta] {
        out.push(grads.get(v.as_tensor()).expect("a gradient").clone());
    }
    if tail == Tail::AddRelu {
        out.push(grads.get(skip.as_tensor()).expect("a skip gradient").clone());
    }
    out
}

const NAMES: [&str; 6] = ["y", "loss", "dx", "dgamma", "dbeta", "dskip"];

fn compare(shape: &[usize], dtype: DType, tail: Tail, batch: bool) {
    let ours = run(shape, dtype, tail, batch, true);
    // The reference always in f64, so the f32 case is judged against exact arithmetic.
    let want = run(shape, DType::F64, tail, batch, false);
    let tol = if dtype == DType::F64 { 1e-10 } else { 1e-5 };
    for ((a, b), name) in ours.iter().zip(&want).zip(NAMES) {
        let what = format!("{name} of {shape:?} {dtype:?} {tail:?} batch={batch}");
        if name == "loss" {
            // Σ w·y over terms that cancel: its rounding (in the dtype, by Candle's sum) is
            // relative to Σ |w·y|, not to the sum (f32 [4, 3, 5, 6]: 1.1e-5 of the sum itself).
            let terms = (rand_tensor(shape, 5, DType::F64) * &want[0]).unwrap().abs().unwrap();
            let scale = terms.sum_all().unwrap().to_scalar::<f64>().unwrap();
            let (a, b) = (to_f64_vec(a)[0], to_f64_vec(b)[0]);
            let e = (a - b).abs() / scale;
            allgrad_testkit::close::report(&what, e, tol);
            assert!(e <= tol, "{what}: {a} vs {b}, error {e:e} of the terms' magnitudes {scale:e}");
        } else {
            assert_close(a, b, tol, &what);
        }
    }
}

#[test]
fn matches_candle_composition_for_every_tail_and_both_statistics() {
    for shape in [&[4, 3, 5, 6][..], &[9, 5], &[2, 3, 4, 1], &[3, 2, 7]] {
        for tail in [Tail::Identity, Tail::Relu, Tail::AddRelu] {
            for batch in [true, false] {
                compare(shape, DType::F64, tail, batch);
                compare(shape, DType::F32, tail, batch);
            }
        }
    }
}

#[test]
fn large_rows_take_the_parallel_chunking_and_still_match() {
    // inner = 128 * 300 > the kernels' grain: rows are split over tasks, in the forward and the
    // backward kernel (the kernel path counters of this thread show it).
    for (dtype, tail) in [(DType::F64, Tail::AddRelu), (DType::F32, Tail::Relu)] {
        let before = allgrad_nn::kernel_paths();
        compare(&[2, 3, 128, 300], dtype, tail, true);
        let after = allgrad_nn::kernel_paths();
        assert!(after.batch_norm_split >= before.batch_norm_split + 2, "{dtype:?}: forward and backward split: {after:?}");
    }
    // And a small case runs whole.
    let before = allgrad_nn::kernel_paths();
    compare(&[4, 3, 5, 6], DType::F64, Tail::Relu, true);
    let after = allgrad_nn::kernel_paths();
    assert_eq!(after.batch_norm_split, before.batch_norm_split, "a small batch norm was split");
    assert!(after.batch_norm_whole >= before.batch_norm_whole + 2, "{after:?}");
}

#[test]
fn gradients_match_finite_differences() {
    let shape = [3, 2, 2, 3];
    let gamma = rand_tensor(&[2], 2, DType::F64).affine(1.0, 1.5).unwrap();
    let beta = rand_tensor(&[2], 3, DType::F64);
    let skip = rand_tensor(&shape, 4, DType::F64);
    let w = rand_tensor(&shape, 5, DType::F64);
    let x0 = rand_tensor(&shape, 1, DType::F64).affine(2.0, 0.7).unwrap();
    let none = (vec![], vec![]);
    for tail in [Tail::Identity, Tail::Relu, Tail::AddRelu] {
        let f = |x: &Tensor| -> Result<Tensor> {
            let s = (tail == Tail::AddRelu).then_some(&skip);
            (fused(x, &gamma, &beta, s, tail, true, &none)? * &w)?.sum_all()
        };
        let xv = Var::from_tensor(&x0).unwrap();
        let analytic = f(xv.as_tensor()).unwrap().backward().unwrap().get(xv.as_tensor()).unwrap().clone();
        // Central differences at h = 1e-6: the loss's rounding over 2h and an h² term; measured
        // 1.3e-9 of the gradient's norm.
        assert_close(&analytic, &fd_grad(&f, &x0, 1e-6), 1e-8, &format!("dx vs finite differences, {tail:?}"));
    }
}

/// The data of rank `r` of `w`: its rows of the whole batch.
fn rows(t: &Tensor, r: usize, w: usize) -> Tensor {
    let n = t.dim(0).unwrap() / w;
    t.narrow(0, r * n, n).unwrap()
}

#[test]
fn the_cross_rank_sum_gives_the_gradient_of_the_whole_batch() {
    // Two threads hold halves of one batch, normalise with the statistics of the whole batch
    // and sum the backward's per-channel sums through a shared buffer: ∂x of each half must
    // equal the rows of ∂x of one batch norm over the whole batch, and ∂γ, ∂β the per-half sums.
    let w = 2;
    let shape = [6, 3, 4, 5];
    let x = rand_tensor(&shape, 1, DType::F64).affine(2.0, 0.7).unwrap();
    let gamma = (rand_tensor(&[3], 2, DType::F64) + 1.5).unwrap();
    let beta = rand_tensor(&[3], 3, DType::F64);
    let skip = rand_tensor(&shape, 4, DType::F64);
    let wt = rand_tensor(&shape, 5, DType::F64);
    let (mean, var, count) = plain_stats(&x);
    let whole = {
        let (xv, gv, bv) = (Var::from_tensor(&x).unwrap(), Var::from_tensor(&gamma).unwrap(), Var::from_tensor(&beta).unwrap());
        let stats = BnStats::Batch { mean: mean.clone(), var: var.clone(), count, sum_over_ranks: None };
        let y = batch_norm(xv.as_tensor(), gv.as_tensor(), bv.as_tensor(), &stats, EPS, BnTail::AddRelu(&skip)).unwrap();
        let g = (y * &wt).unwrap().sum_all().unwrap().backward().unwrap();
        [&xv, &gv, &bv].map(|v| g.get(v.as_tensor()).unwrap().clone())
    };
    // A two-party all_reduce: each adds its buffer in, waits, reads the total.
    let total: Arc<Mutex<Vec<f64>>> = Arc::new(Mutex::new(Vec::new()));
    let barrier = Arc::new(Barrier::new(w));
    let (tx, rx) = mpsc::channel();
    for r in 0..w {
        let (x, gamma, beta, skip, wt) = (rows(&x, r, w), gamma.clone(), beta.clone(), rows(&skip, r, w), rows(&wt, r, w));
        let (mean, var, total, barrier, tx) = (mean.clone(), var.clone(), total.clone(), barrier.clone(), tx.clone());
        std::thread::spawn(move || {
            let sum: ChannelSum = Arc::new(move |s: &mut [f64]| {
                {
                    let mut t = total.lock().unwrap();
                    if t.is_empty() {
                        t.resize(s.len(), 0.0);
                    }
                    t.iter_mut().zip(s.iter()).for_each(|(a, b)| *a += b);
                }
                barrier.wait();
                s.copy_from_slice(&total.lock().unwrap());
                Ok(())
            });
            let (xv, gv, bv) =
                (Var::from_tensor(&x).unwrap(), Var::from_tensor(&gamma).unwrap(), Var::from_tensor(&beta).unwrap());
            let stats = BnStats::Batch { mean, var, count, sum_over_ranks: Some(sum) };
            let y = batch_norm(xv.as_tensor(), gv.as_tensor(), bv.as_tensor(), &stats, EPS, BnTail::AddRelu(&skip)).unwrap();
            let g = (y * &wt).unwrap().sum_all().unwrap().backward().unwrap();
            tx.send((r, [&xv, &gv, &bv].map(|v| g.get(v.as_tensor()).unwrap().clone()))).unwrap();
        });
    }
    drop(tx);
    let mut param_sums = [gamma.zeros_like().unwrap(), beta.zeros_like().unwrap()];
    for _ in 0..w {
        // A watchdog: a rank that fails leaves the other at the barrier.
        let (r, [dx, dg, db]) =
            rx.recv_timeout(Duration::from_secs(60)).expect("a rank did not finish within 60 s (it panicked or hangs)");
        assert_close(&dx, &rows(&whole[0], r, w), 1e-12, &format!("dx of rank {r}"));
        param_sums = [(&param_sums[0] + dg).unwrap(), (&param_sums[1] + db).unwrap()];
    }
    // Each rank's ∂γ, ∂β are its own sums: together they are the whole batch's.
    assert_close(&param_sums[0], &whole[1], 1e-12, "dgamma summed over ranks");
    assert_close(&param_sums[1], &whole[2], 1e-12, "dbeta summed over ranks");
}

/// `relu(bn(x) + bn'(xs))` fused ([`BnTail::AddBnRelu`]) or composed from the Candle reference,
/// with batch or fixed statistics (each branch its own), and the value and gradients of
/// `Σ w·y`: `[y, loss, dx, dγ, dβ, dxs, dγ', dβ']`.
fn run_dual(shape: &[usize], dtype: DType, batch: bool, use_fused: bool) -> Vec<Tensor> {
    let c = shape[1];
    let var = |t: Tensor| Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap();
    let x = var(rand_tensor(shape, 1, DType::F64).affine(2.0, 0.7).unwrap());
    let xs = var(rand_tensor(shape, 11, DType::F64).affine(1.5, -0.4).unwrap());
    let (g1, b1) = (var((rand_tensor(&[c], 2, DType::F64) + 1.5).unwrap()), var(rand_tensor(&[c], 3, DType::F64)));
    let (g2, b2) = (var((rand_tensor(&[c], 12, DType::F64) + 0.8).unwrap()), var(rand_tensor(&[c], 13, DType::F64)));
    let w = rand_tensor(shape, 5, dtype);
    let fixed = |seed| {
        (
            to_f64_vec(&(rand_tensor(&[c], seed, DType::F64) * 0.3).unwrap()),
            to_f64_vec(&(rand_tensor(&[c], seed + 1, DType::F64) + 1.2).unwrap()),
        )
    };
    let (f1, f2) = (fixed(6), fixed(16));
    let y = if use_fused {
        let stats = |t: &Tensor, f: &(Vec<f64>, Vec<f64>)| {
            if batch {
                let (mean, var, count) = plain_stats(t);
                BnStats::Batch { mean, var, count, sum_over_ranks: None }
            } else {
                BnStats::Fixed { mean: f.0.clone(), var: f.1.clone() }
            }
        };
        let s2 = stats(xs.as_tensor(), &f2);
        let branch = BnBranch { x: xs.as_tensor(), weight: g2.as_tensor(), bias: b2.as_tensor(), stats: &s2, eps: EPS };
        let s1 = stats(x.as_tensor(), &f1);
        batch_norm(x.as_tensor(), g1.as_tensor(), b1.as_tensor(), &s1, EPS, BnTail::AddBnRelu(&branch)).unwrap()
    } else {
        let short = reference(xs.as_tensor(), g2.as_tensor(), b2.as_tensor(), None, batch, &f2).unwrap();
        reference(x.as_tensor(), g1.as_tensor(), b1.as_tensor(), Some(&short), batch, &f1).unwrap()
    };
    let loss = (&y * &w).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    let mut out = vec![y.clone(), loss];
    for v in [&x, &g1, &b1, &xs, &g2, &b2] {
        out.push(grads.get(v.as_tensor()).expect("a gradient").clone());
    }
    out
}

#[test]
fn a_normalised_shortcut_matches_two_composed_batch_norms_and_their_sum() {
    const DUAL: [&str; 8] = ["y", "loss", "dx", "dgamma", "dbeta", "dx'", "dgamma'", "dbeta'"];
    for shape in [&[4, 3, 5, 6][..], &[9, 5], &[2, 3, 128, 300]] {
        for batch in [true, false] {
            // The reference always in f64, so the f32 case is judged against exact arithmetic.
            let want = run_dual(shape, DType::F64, batch, false);
            for dtype in [DType::F64, DType::F32] {
                let ours = run_dual(shape, dtype, batch, true);
                let tol = if dtype == DType::F64 { 1e-10 } else { 1e-5 };
                for ((a, b), name) in ours.iter().zip(&want).zip(DUAL) {
                    assert_close(a, b, tol, &format!("{name} of {shape:?} {dtype:?} batch={batch}"));
                }
            }
        }
    }
}

#[test]
fn a_normalised_shortcut_equals_its_batch_norm_followed_by_the_skip_tail_bitwise() {
    // The fused op rounds the shortcut's a'·x' + b' as a separate batch norm's output is
    // rounded, so the two paths of a ResNet block agree exactly.
    let shape = [4, 3, 5, 6];
    let x = rand_tensor(&shape, 1, DType::F32);
    let xs = rand_tensor(&shape, 11, DType::F32);
    let (g1, b1, g2, b2) = (
        rand_tensor(&[3], 2, DType::F32),
        rand_tensor(&[3], 3, DType::F32),
        rand_tensor(&[3], 12, DType::F32),
        rand_tensor(&[3], 13, DType::F32),
    );
    let stats = |t: &Tensor| {
        let (mean, var, count) = plain_stats(t);
        BnStats::Batch { mean, var, count, sum_over_ranks: None }
    };
    let (s1, s2) = (stats(&x), stats(&xs));
    let branch = BnBranch { x: &xs, weight: &g2, bias: &b2, stats: &s2, eps: EPS };
    let fused = batch_norm(&x, &g1, &b1, &s1, EPS, BnTail::AddBnRelu(&branch)).unwrap();
    let short = batch_norm(&xs, &g2, &b2, &s2, EPS, BnTail::Identity).unwrap();
    let composed = batch_norm(&x, &g1, &b1, &s1, EPS, BnTail::AddRelu(&short)).unwrap();
    assert_eq!(to_f64_vec(&fused), to_f64_vec(&composed));
}

#[test]
fn a_normalised_shortcut_has_the_gradients_of_finite_differences() {
    let shape = [3, 2, 2, 3];
    let (g1, b1) = (rand_tensor(&[2], 2, DType::F64).affine(1.0, 1.5).unwrap(), rand_tensor(&[2], 3, DType::F64));
    let (g2, b2) = (rand_tensor(&[2], 12, DType::F64).affine(1.0, 0.8).unwrap(), rand_tensor(&[2], 13, DType::F64));
    let w = rand_tensor(&shape, 5, DType::F64);
    let x0 = rand_tensor(&shape, 1, DType::F64).affine(2.0, 0.7).unwrap();
    let xs0 = rand_tensor(&shape, 11, DType::F64).affine(1.5, -0.4).unwrap();
    let f = |x: &Tensor, xs: &Tensor| -> Result<Tensor> {
        let stats = |t: &Tensor| {
            let (mean, var, count) = plain_stats(t);
            BnStats::Batch { mean, var, count, sum_over_ranks: None }
        };
        let s2 = stats(xs);
        let branch = BnBranch { x: xs, weight: &g2, bias: &b2, stats: &s2, eps: EPS };
        (batch_norm(x, &g1, &b1, &stats(x), EPS, BnTail::AddBnRelu(&branch))? * &w)?.sum_all()
    };
    let (xv, xsv) = (Var::from_tensor(&x0).unwrap(), Var::from_tensor(&xs0).unwrap());
    let grads = f(xv.as_tensor(), xsv.as_tensor()).unwrap().backward().unwrap();
    let fd_x = fd_grad(&|x: &Tensor| f(x, &xs0), &x0, 1e-6);
    let fd_xs = fd_grad(&|xs: &Tensor| f(&x0, xs), &xs0, 1e-6);
    assert_close(grads.get(xv.as_tensor()).unwrap(), &fd_x, 1e-7, "dx vs finite differences");
    assert_close(grads.get(xsv.as_tensor()).unwrap(), &fd_xs, 1e-7, "dx' vs finite differences");
}

/// A two-party all_reduce of f64 slices for two threads: each adds its buffer in, waits, reads
/// the total (a fresh one per collective).
fn two_party_sum() -> [ChannelSum; 2] {
    let total: Arc<Mutex<Vec<f64>>> = Arc::new(Mutex::new(Vec::new()));
    let barrier = Arc::new(Barrier::new(2));
    let party = || -> ChannelSum {
        let (total, barrier) = (total.clone(), barrier.clone());
        Arc::new(move |s: &mut [f64]| {
            {
                let mut t = total.lock().unwrap();
                if t.is_empty() {
                    t.resize(s.len(), 0.0);
                }
                t.iter_mut().zip(s.iter()).for_each(|(a, b)| *a += b);
            }
            barrier.wait();
            s.copy_from_slice(&total.lock().unwrap());
            Ok(())
        })
    };
    [party(), party()]
}

#[test]
fn a_normalised_shortcut_sums_both_branches_over_ranks_and_equals_the_whole_batch() {
    let w = 2;
    let shape = [6, 3, 4, 5];
    let x = rand_tensor(&shape, 1, DType::F64).affine(2.0, 0.7).unwrap();
    let xs = rand_tensor(&shape, 11, DType::F64).affine(1.5, -0.4).unwrap();
    let (g1, b1) = ((rand_tensor(&[3], 2, DType::F64) + 1.5).unwrap(), rand_tensor(&[3], 3, DType::F64));
    let (g2, b2) = ((rand_tensor(&[3], 12, DType::F64) + 0.8).unwrap(), rand_tensor(&[3], 13, DType::F64));
    let wt = rand_tensor(&shape, 5, DType::F64);
    let (st1, st2) = (plain_stats(&x), plain_stats(&xs));
    // ∂ of Σ wt·y for (x, xs, γ, β, γ', β'), with each branch's statistics and reducer.
    let grads = |x: &Tensor, xs: &Tensor, wt: &Tensor, sums: [Option<ChannelSum>; 2]| {
        let vars = [x, xs, &g1, &b1, &g2, &b2].map(|t| Var::from_tensor(t).unwrap());
        let [s1, s2] = sums;
        let stats1 = BnStats::Batch { mean: st1.0.clone(), var: st1.1.clone(), count: st1.2, sum_over_ranks: s1 };
        let stats2 = BnStats::Batch { mean: st2.0.clone(), var: st2.1.clone(), count: st2.2, sum_over_ranks: s2 };
        let branch =
            BnBranch { x: vars[1].as_tensor(), weight: vars[4].as_tensor(), bias: vars[5].as_tensor(), stats: &stats2, eps: EPS };
        let y =
            batch_norm(vars[0].as_tensor(), vars[2].as_tensor(), vars[3].as_tensor(), &stats1, EPS, BnTail::AddBnRelu(&branch))
                .unwrap();
        let g = (y * wt).unwrap().sum_all().unwrap().backward().unwrap();
        vars.map(|v| g.get(v.as_tensor()).unwrap().clone())
    };
    let whole = grads(&x, &xs, &wt, [None, None]);
    let [main0, main1] = two_party_sum();
    let [short0, short1] = two_party_sum();
    let mut reducers = vec![(main0, short0), (main1, short1)];
    let (tx, rx) = mpsc::channel();
    std::thread::scope(|scope| {
        for r in 0..w {
            let (m, sh) = reducers.remove(0);
            let (x, xs, wt, tx) = (rows(&x, r, w), rows(&xs, r, w), rows(&wt, r, w), tx.clone());
            let grads = &grads;
            scope.spawn(move || {
                let _ = tx.send((r, grads(&x, &xs, &wt, [Some(m), Some(sh)])));
            });
        }
        drop(tx);
        let mut param_sums: Vec<Tensor> = whole[2..].iter().map(|t| t.zeros_like().unwrap()).collect();
        for _ in 0..w {
            // A watchdog: a rank that fails leaves the other at a barrier.
            let (r, g) =
                rx.recv_timeout(Duration::from_secs(60)).expect("a rank did not finish within 60 s (it panicked or hangs)");
            assert_close(&g[0], &rows(&whole[0], r, w), 1e-12, &format!("dx of rank {r}"));
            assert_close(&g[1], &rows(&whole[1], r, w), 1e-12, &format!("dx' of rank {r}"));
            for (acc, p) in param_sums.iter_mut().zip(&g[2..]) {
                *acc = (&*acc + p).unwrap();
            }
        }
        for (i, (a, b)) in param_sums.iter().zip(&whole[2..]).enumerate() {
            assert_close(a, b, 1e-12, &format!("parameter gradient {i} summed over ranks"));
        }
    });
}

#[test]
fn bad_input_is_an_error_that_names_it() {
    let x = rand_tensor(&[2, 3, 4], 1, DType::F32);
    let (g, b) = (rand_tensor(&[3], 2, DType::F32), rand_tensor(&[3], 3, DType::F32));
    let stats = |c: usize| BnStats::Batch { mean: vec![0.0; c], var: vec![1.0; c], count: 8.0, sum_over_ranks: None };
    let e = err_text(batch_norm(&x, &rand_tensor(&[4], 2, DType::F32), &b, &stats(3), EPS, BnTail::Identity));
    assert!(e.contains("3 channels") && e.contains("[4]"), "{e}");
    let e = err_text(batch_norm(&x, &g, &b, &stats(2), EPS, BnTail::Identity));
    assert!(e.contains("2 means") && e.contains("3 channels"), "{e}");
    let e = err_text(batch_norm(&x, &g, &b, &stats(3), -1.0, BnTail::Identity));
    assert!(e.contains("eps"), "{e}");
    let zero = BnStats::Batch { mean: vec![0.0; 3], var: vec![1.0; 3], count: 0.0, sum_over_ranks: None };
    assert!(err_text(batch_norm(&x, &g, &b, &zero, EPS, BnTail::Identity)).contains("count"));
    let e = err_text(batch_norm(&x, &g, &b, &stats(3), EPS, BnTail::AddRelu(&rand_tensor(&[2, 3, 5], 4, DType::F32))));
    assert!(e.contains("[2, 3, 4]") && e.contains("[2, 3, 5]"), "{e}");
    let e = err_text(batch_norm(&x.to_dtype(DType::F64).unwrap(), &g, &b, &stats(3), EPS, BnTail::Identity));
    assert!(e.contains("F64") && e.contains("F32"), "{e}");
    let e = err_text(batch_norm(
        &x.to_dtype(DType::F16).unwrap(),
        &g.to_dtype(DType::F16).unwrap(),
        &b.to_dtype(DType::F16).unwrap(),
        &stats(3),
        EPS,
        BnTail::Identity,
    ));
    assert!(e.contains("F16") && e.contains("channel_moments"), "{e}");
    // bf16 activations take f32 parameters (autocast), not f64 ones.
    let e = err_text(batch_norm(
        &x.to_dtype(DType::BF16).unwrap(),
        &g.to_dtype(DType::F64).unwrap(),
        &b,
        &stats(3),
        EPS,
        BnTail::Identity,
    ));
    assert!(e.contains("BF16") && e.contains("F64"), "{e}");
    assert!(
        err_text(batch_norm(&rand_tensor(&[5], 1, DType::F32), &g, &b, &stats(3), EPS, BnTail::Identity)).contains("[N, C, ...]")
    );
}
