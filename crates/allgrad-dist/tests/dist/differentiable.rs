//! The differentiable collectives against independent references:
//! - the seed scenarios with their known gradients (12/18, 6/9, 40/60, 10/15, Prod 30/30);
//! - every op, W = 1..4, asymmetric f64 data and a different loss on every rank, against the
//!   same computation done in ONE process with ordinary Candle ops (the "simulation");
//! - finite differences (plain f64 loops, no Candle) for Prod with zeros and Max/Min with
//!   and without ties;
//! - the classic wrong variant (local slice of the gradient only) giving 1/W of the truth;
//! - the world-size-invariance helper accepting a right loss and rejecting a wrong one;
//! - the point-to-point exchange (`ppermute`, `ring_shift`): W = 1..4, uneven shards, against
//!   the simulation and against finite differences of a chain of shifts; bad permutations.
//!
//! One file for all ops (about 700 lines): they share the simulation harness.

// The references are formulas of (rank, index): the loops index by both on purpose.
#![allow(clippy::needless_range_loop)]

use allgrad_dist::testing::check_world_size_invariance;
use allgrad_dist::{
    all_gather, all_reduce, all_to_all, all_to_all_sizes, broadcast, ppermute, reduce_scatter, ring_destinations, ring_shift,
    run_threads, ProcessGroup, ReduceOp, ThreadWorld,
};
use allgrad_testkit::close::{assert_rel, report};
use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Result, Shape, Tensor, Var, D};

const CPU: Device = Device::Cpu;

/// Deterministic pseudo-random values in [-2, 2), different for every (seed, index).
fn values(seed: u64, n: usize) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(0x2545_F491_4F6C_DD1D);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 11) as f64 / (1u64 << 53) as f64 * 4.0 - 2.0
        })
        .collect()
}

fn tensor(seed: u64, shape: &[usize]) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_vec(values(seed, n), shape, &CPU).unwrap()
}

fn flat(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap()
}

/// Rank k's loss on its output: different weights on every rank, and nonlinear, so that
/// every gradient path is exercised with asymmetric values.
fn rank_loss(out: &Tensor, k: usize) -> Result<Tensor> {
    let c = tensor(1000 + k as u64, out.dims());
    let d = tensor(2000 + k as u64, out.dims());
    (out.sqr()?.mul(&c)?.sum_all()? + out.mul(&d)?.sum_all()?)? / 3.0
}

/// Runs `dist` on W ranks (rank r's input from `input(r)`), backpropagates each rank's own
/// loss, and compares every rank's input gradient with the single-process simulation, where
/// `sim(xs, k)` computes rank k's output from all ranks' inputs with ordinary Candle ops and
/// the gradient is that of Σ_k L_k.
fn check_against_simulation(
    w: usize,
    input: impl Fn(usize) -> Tensor + Sync,
    dist: impl Fn(&Tensor, &ProcessGroup) -> Result<Tensor> + Sync,
    sim: impl Fn(&[Tensor], usize) -> Result<Tensor>,
) {
    let got = run_threads(w, |pg| {
        let x = Var::from_tensor(&input(pg.rank()))?;
        let out = dist(x.as_tensor(), &pg)?;
        let loss = rank_loss(&out, pg.rank())?;
        let g = loss.backward()?.get(&x).cloned().unwrap_or(x.as_tensor().zeros_like()?);
        Ok((flat(&out), flat(&g)))
    })
    .unwrap();

    let xs: Vec<Var> = (0..w).map(|r| Var::from_tensor(&input(r)).unwrap()).collect();
    let ts: Vec<Tensor> = xs.iter().map(|v| v.as_tensor().clone()).collect();
    let mut total = Tensor::zeros((), DType::F64, &CPU).unwrap();
    let mut outs = Vec::new();
    for k in 0..w {
        let out = sim(&ts, k).unwrap();
        total = (total + rank_loss(&out, k).unwrap()).unwrap();
        outs.push(flat(&out));
    }
    let grads = total.backward().unwrap();
    for r in 0..w {
        let want_out = &outs[r];
        assert_eq!(got[r].0.len(), want_out.len(), "W={w} rank {r}: output size");
        // Norm-wise relative (allgrad_testkit::close::rel_err), f64.
        assert_rel(&got[r].0, want_out, 1e-10, &format!("W={w} rank {r}: output vs simulation"));
        let want = flat(grads.get(&xs[r]).unwrap_or(&ts[r].zeros_like().unwrap()));
        assert_eq!(got[r].1.len(), want.len(), "W={w} rank {r}: gradient size");
        assert_rel(&got[r].1, &want, 1e-10, &format!("W={w} rank {r}: input gradient vs simulation"));
    }
}

// ------------------------------------------------------------------ seed scenarios

/// y = x + 2, z = y*y, gathered, r = z_0 * z_1, out = r.mean(); returns y's gradient per rank.
fn seed_gather(divide_by_w: bool) -> Vec<f64> {
    run_threads(2, |pg| {
        let x = Var::from_tensor(&Tensor::full(if pg.rank() == 0 { 1f64 } else { 0. }, (2, 2), &CPU)?)?;
        let y = (x.as_tensor() + 2.0)?;
        let z = (&y * &y)?;
        let g = all_gather(&z, &pg)?;
        let r = (g.narrow(0, 0, 2)? * g.narrow(0, 2, 2)?)?;
        let mut out = r.mean_all()?;
        if divide_by_w {
            out = (out / pg.world_size() as f64)?;
        }
        let grads = out.backward()?;
        let gy = grads.get(&x).unwrap(); // dy/dx = 1
        let v = flat(gy);
        assert!(v.iter().all(|e| *e == v[0]), "uniform gradient expected: {v:?}");
        Ok(v[0])
    })
    .unwrap()
}

#[test]
fn seed_gather_gives_12_and_18_under_the_sum_rule() {
    assert_eq!(seed_gather(false), vec![12.0, 18.0]);
}

#[test]
fn seed_gather_gives_6_and_9_when_the_loss_is_divided_by_w() {
    assert_eq!(seed_gather(true), vec![6.0, 9.0]);
}

/// x = 1 on both ranks, xx = (rank+2)*x, s = all_reduce(xx, op); `then` maps (rank, s) to the loss.
fn seed_reduce(op: ReduceOp, then: impl Fn(usize, &Tensor) -> Result<Tensor> + Sync) -> Vec<f64> {
    run_threads(2, |pg| {
        let x = Var::from_tensor(&Tensor::new(&[1f64], &CPU)?)?;
        let xx = (x.as_tensor() * (pg.rank() + 2) as f64)?;
        let s = all_reduce(&xx, op, &pg)?;
        let loss = then(pg.rank(), &s)?.sum_all()?;
        Ok(flat(loss.backward()?.get(&x).unwrap())[0])
    })
    .unwrap()
}

#[test]
fn seed_all_reduce_square_gives_40_and_60() {
    assert_eq!(seed_reduce(ReduceOp::Sum, |_, s| s * s), vec![40.0, 60.0]);
}

#[test]
fn seed_all_reduce_then_scale_gives_10_and_15_summing_to_the_truth() {
    let g = seed_reduce(ReduceOp::Sum, |r, s| s * (r + 2) as f64);
    assert_eq!(g, vec![10.0, 15.0]);
    // Single process, one replicated x: d/dx Σ_k (k+2) Σ_j (j+2) x = 5 * 5.
    assert_eq!(g.iter().sum::<f64>(), 25.0);
}

#[test]
fn seed_all_reduce_prod_gives_30_and_30_not_12_and_18() {
    let g = seed_reduce(ReduceOp::Prod, |r, s| s * (r + 2) as f64);
    assert_eq!(g, vec![30.0, 30.0]);
    // Single process: d/dx Σ_k (k+2) (2x)(3x) = 60x at x = 1. An all_reduce whose backward
    // all-reduces the gradient with PROD (Π_k g_k = 6) would give 6*2 = 12 and 6*3 = 18.
    assert_eq!(g.iter().sum::<f64>(), 60.0);
}

// ------------------------------------------------------------------ every op vs simulation

fn sum_of(xs: &[Tensor]) -> Result<Tensor> {
    let mut acc = xs[0].clone();
    for x in &xs[1..] {
        acc = (acc + x)?;
    }
    Ok(acc)
}

fn reduce_sim(op: ReduceOp, xs: &[Tensor]) -> Result<Tensor> {
    let mut acc = xs[0].clone();
    for x in &xs[1..] {
        acc = match op {
            ReduceOp::Sum | ReduceOp::Avg => (acc + x)?,
            ReduceOp::Prod => (acc * x)?,
            ReduceOp::Max => acc.maximum(x)?,
            ReduceOp::Min => acc.minimum(x)?,
        };
    }
    if op == ReduceOp::Avg {
        acc = (acc / xs.len() as f64)?;
    }
    Ok(acc)
}

const OPS: [ReduceOp; 5] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Prod, ReduceOp::Max, ReduceOp::Min];

#[test]
fn all_gather_uneven_matches_simulation() {
    for w in 1..=4 {
        // Rank r has 2r+1 rows (rank 2 of W=4 has none, to cover empty contributions).
        let rows = |r: usize| if w == 4 && r == 2 { 0 } else { 2 * r + 1 };
        check_against_simulation(w, |r| tensor(10 + r as u64, &[rows(r), 3]), all_gather, |xs, _| Tensor::cat(xs, 0));
    }
}

#[test]
fn all_reduce_every_op_matches_simulation() {
    for op in OPS {
        for w in 1..=4 {
            check_against_simulation(
                w,
                |r| tensor(20 + r as u64, &[4, 3]),
                |x, pg| all_reduce(x, op, pg),
                |xs, _| reduce_sim(op, xs),
            );
        }
    }
}

#[test]
fn all_reduce_takes_the_large_message_path_for_large_inputs() {
    // 40_000 f64 = 320 KB: above the direct-path threshold. Thread ranks share a host, so the
    // forward call goes through shared memory (over the TCP ring without /dev/shm); the group's
    // path counters show which path it took.
    for w in [2, 3] {
        check_against_simulation(
            w,
            |r| tensor(25 + r as u64, &[40_000]),
            |x, pg| {
                let before = pg.all_reduce_paths();
                let y = all_reduce(x, ReduceOp::Sum, pg)?;
                let after = pg.all_reduce_paths();
                let taken = (after.direct - before.direct, after.ring - before.ring, after.shared_memory - before.shared_memory);
                let want = if pg.shared_memory() { (0, 0, 1) } else { (0, 1, 0) };
                assert_eq!(taken, want, "W={w}: (direct, ring, shared memory) calls of the forward all_reduce");
                Ok(y)
            },
            |xs, _| sum_of(xs),
        );
    }
}

#[test]
fn reduce_scatter_every_op_matches_simulation() {
    for op in OPS {
        for w in 1..=4 {
            check_against_simulation(
                w,
                |r| tensor(30 + r as u64, &[2 * w, 3]),
                |x, pg| reduce_scatter(x, op, pg),
                |xs, k| reduce_sim(op, xs)?.narrow(0, 2 * k, 2),
            );
        }
    }
}

#[test]
fn broadcast_from_every_source_matches_simulation() {
    for w in 1..=4 {
        for src in 0..w {
            check_against_simulation(
                w,
                |r| tensor(40 + r as u64, &[3, 2]),
                |x, pg| broadcast(x, src, pg),
                |xs, _| Ok(xs[src].clone()),
            );
        }
    }
}

#[test]
fn all_to_all_matches_simulation() {
    for w in 1..=4 {
        check_against_simulation(
            w,
            |r| tensor(50 + r as u64, &[2 * w, 3]),
            all_to_all,
            |xs, k| Tensor::cat(&xs.iter().map(|x| x.narrow(0, 2 * k, 2)).collect::<Result<Vec<_>>>()?, 0),
        );
    }
}

#[test]
fn all_to_all_uneven_matches_simulation() {
    // Rank r sends (r + j) % 3 rows to rank j.
    let sends = |r: usize, w: usize| -> Vec<usize> { (0..w).map(|j| (r + j) % 3).collect() };
    for w in 1..=4 {
        check_against_simulation(
            w,
            |r| tensor(55 + r as u64, &[sends(r, w).iter().sum(), 2]),
            |x, pg| all_to_all_sizes(x, &sends(pg.rank(), pg.world_size()), pg),
            |xs, k| {
                let parts = xs
                    .iter()
                    .enumerate()
                    .map(|(j, x)| {
                        let s = sends(j, w);
                        x.narrow(0, s[..k].iter().sum(), s[k])
                    })
                    .collect::<Result<Vec<_>>>()?;
                Tensor::cat(&parts, 0)
            },
        );
    }
}

#[test]
fn non_contiguous_inputs_and_chained_collectives_match_simulation() {
    for w in 2..=3 {
        check_against_simulation(
            w,
            |r| tensor(60 + r as u64, &[3, 4]),
            |x, pg| {
                let t = x.t()?; // non-contiguous
                let g = all_gather(&t, pg)?;
                all_reduce(&g.sqr()?, ReduceOp::Max, pg)
            },
            |xs, _| {
                let g = Tensor::cat(&xs.iter().map(|x| x.t()).collect::<Result<Vec<_>>>()?, 0)?;
                g.sqr() // identical on all ranks: the max over ranks is the value itself
            },
        );
    }
}

#[test]
fn float32_and_bfloat16_follow_the_same_rules() {
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let g = run_threads(2, |pg| {
            let x = Var::from_tensor(&Tensor::new(&[1f64], &CPU)?.to_dtype(dt)?)?;
            let xx = (x.as_tensor() * (pg.rank() + 2) as f64)?;
            let s = all_reduce(&xx, ReduceOp::Sum, &pg)?;
            let loss = (&s * &s)?.sum_all()?;
            let ga = flat(loss.backward()?.get(&x).unwrap())[0];
            let gathered = all_gather(&xx, &pg)?;
            let l2 = gathered.sqr()?.sum_all()?;
            let gb = flat(l2.backward()?.get(&x).unwrap())[0];
            Ok((ga, gb))
        })
        .unwrap();
        // 40/60 as above; all_gather of xx then Σ xx² on both ranks: 2 * 2 xx_r * (r+2).
        assert_eq!(g, vec![(40.0, 16.0), (60.0, 36.0)], "{dt:?}");
    }
}

// ------------------------------------------------------------------ finite differences

/// Σ_k L_k for an element-wise reduction over ranks, computed with plain f64 loops:
/// L_k = Σ_i c_{k,i} · out_i with c from `values`, out_i = op_j x_{j,i}.
fn objective(op: ReduceOp, xs: &[Vec<f64>]) -> f64 {
    (0..xs.len()).map(|k| objective_with(op, xs, k, false)).sum()
}

fn distributed_grads(op: ReduceOp, xs: &[Vec<f64>]) -> Vec<Vec<f64>> {
    let w = xs.len();
    let n = xs[0].len();
    run_threads(w, |pg| {
        let x = Var::from_tensor(&Tensor::from_vec(xs[pg.rank()].clone(), n, &CPU)?)?;
        let out = all_reduce(x.as_tensor(), op, &pg)?;
        let c = Tensor::from_vec(values(3000 + pg.rank() as u64, n), n, &CPU)?;
        let loss = out.mul(&c)?.sum_all()?;
        Ok(flat(loss.backward()?.get(&x).unwrap()))
    })
    .unwrap()
}

/// The objective's scale: Σ_k Σ_i |c_{k,i} · out_i|, which bounds its partial sums.
fn objective_scale(op: ReduceOp, xs: &[Vec<f64>]) -> f64 {
    let w = xs.len();
    let abs: Vec<Vec<f64>> = xs.iter().map(|x| x.iter().map(|v| v.abs()).collect()).collect();
    // |op_j x_j| ≤ op_j |x_j| for Prod and Sum; ≤ max_j |x_j| for Max and Min.
    let bound = match op {
        ReduceOp::Max | ReduceOp::Min => ReduceOp::Max,
        other => other,
    };
    (0..w).map(|k| objective_with(bound, &abs, k, true)).sum()
}

/// Rank k's term of [`objective`], its weights in absolute value when `abs`.
fn objective_with(op: ReduceOp, xs: &[Vec<f64>], k: usize, abs: bool) -> f64 {
    let n = xs[0].len();
    let c = values(3000 + k as u64, n);
    (0..n)
        .map(|i| {
            let col = xs.iter().map(|x| x[i]);
            let out = match op {
                ReduceOp::Prod => col.product::<f64>(),
                ReduceOp::Max => col.fold(f64::NEG_INFINITY, f64::max),
                ReduceOp::Min => col.fold(f64::INFINITY, f64::min),
                ReduceOp::Sum => col.sum(),
                ReduceOp::Avg => col.sum::<f64>() / xs.len() as f64,
            };
            if abs {
                c[i].abs() * out
            } else {
                c[i] * out
            }
        })
        .sum()
}

/// The step of the central differences: for Prod the objective is affine in each single
/// input, so any step is exact and 1/2 (a power of two) adds no rounding of its own; for Max
/// and Min it is affine in an input as long as the step crosses no other input of the same
/// element (nor a tie), so the step is a quarter of the smallest gap there.
fn fd_step(op: ReduceOp, xs: &[Vec<f64>]) -> f64 {
    if op == ReduceOp::Prod {
        return 0.5;
    }
    let mut gap = f64::INFINITY;
    for i in 0..xs[0].len() {
        for a in xs {
            for b in xs {
                let d = (a[i] - b[i]).abs();
                if d > 0.0 {
                    gap = gap.min(d);
                }
            }
        }
    }
    if gap.is_finite() {
        gap / 4.0
    } else {
        0.5
    }
}

/// The tolerance of a central difference at step `h` of a function that is affine along it:
/// the difference is exact but for the rounding of the two objective values, each within a
/// few units in the last place of the objective's scale (n terms summed: n·2⁻⁵³ of it).
fn fd_tolerance(op: ReduceOp, xs: &[Vec<f64>], h: f64) -> f64 {
    let terms = (xs.len() * xs[0].len()) as f64;
    2.0 * terms * f64::EPSILON * objective_scale(op, xs) / (2.0 * h)
}

fn finite_difference(op: ReduceOp, xs: &[Vec<f64>], r: usize, i: usize) -> f64 {
    let h = fd_step(op, xs);
    let mut plus = xs.to_vec();
    plus[r][i] += h;
    let mut minus = xs.to_vec();
    minus[r][i] -= h;
    (objective(op, &plus) - objective(op, &minus)) / (2.0 * h)
}

#[test]
fn prod_with_zeros_matches_finite_differences() {
    // Element 0: one rank holds a zero; element 1: two ranks do; element 2: none.
    for w in 2..=4 {
        let xs: Vec<Vec<f64>> = (0..w)
            .map(|r| {
                let mut v = values(70 + r as u64, 3);
                if r == 1 {
                    v[0] = 0.0;
                    v[1] = 0.0;
                }
                if r == w - 1 {
                    v[1] = 0.0;
                }
                v
            })
            .collect();
        let got = distributed_grads(ReduceOp::Prod, &xs);
        for r in 0..w {
            for i in 0..3 {
                let fd = finite_difference(ReduceOp::Prod, &xs, r, i);
                let tol = fd_tolerance(ReduceOp::Prod, &xs, fd_step(ReduceOp::Prod, &xs));
                report(&format!("W={w} rank {r} element {i}: |gradient - finite difference|"), (got[r][i] - fd).abs(), tol);
                assert!(
                    (got[r][i] - fd).abs() <= tol,
                    "W={w} rank {r} element {i}: {} vs finite difference {fd} (tolerance {tol:e})",
                    got[r][i]
                );
            }
            // The gradient is not NaN or infinite where x_r = 0 (no division by x_r).
            assert!(got[r].iter().all(|g| g.is_finite()));
        }
        // Where the zero is held by rank 1 alone, only rank 1's gradient can be non-zero.
        if w > 2 {
            assert!((0..w).filter(|r| *r != 1).all(|r| got[r][0] == 0.0));
            assert!(got[1][0] != 0.0);
        }
    }
}

#[test]
fn max_and_min_without_ties_match_finite_differences() {
    for op in [ReduceOp::Max, ReduceOp::Min] {
        for w in 1..=4 {
            let xs: Vec<Vec<f64>> = (0..w).map(|r| values(80 + r as u64, 5)).collect();
            let got = distributed_grads(op, &xs);
            for r in 0..w {
                for i in 0..5 {
                    let fd = finite_difference(op, &xs, r, i);
                    let tol = fd_tolerance(op, &xs, fd_step(op, &xs));
                    report(
                        &format!("{op:?} W={w} rank {r} element {i}: |gradient - finite difference|"),
                        (got[r][i] - fd).abs(),
                        tol,
                    );
                    assert!(
                        (got[r][i] - fd).abs() <= tol,
                        "{op:?} W={w} rank {r} element {i}: {} vs {fd} (tolerance {tol:e})",
                        got[r][i]
                    );
                }
            }
        }
    }
}

#[test]
fn max_and_min_split_ties_equally() {
    for op in [ReduceOp::Max, ReduceOp::Min] {
        // Two-way tie (ranks 0 and 2 hold the extremum of element 0): a central finite
        // difference sees half the slope on each holder, which is the equal split.
        let w = 3;
        let extreme = if op == ReduceOp::Max { 5.0 } else { -5.0 };
        let xs: Vec<Vec<f64>> = (0..w)
            .map(|r| {
                let mut v = values(90 + r as u64, 2);
                if r != 1 {
                    v[0] = extreme;
                }
                v
            })
            .collect();
        let got = distributed_grads(op, &xs);
        for r in 0..w {
            for i in 0..2 {
                let fd = finite_difference(op, &xs, r, i);
                let tol = fd_tolerance(op, &xs, fd_step(op, &xs));
                report(&format!("{op:?} ties rank {r} element {i}: |gradient - finite difference|"), (got[r][i] - fd).abs(), tol);
                assert!((got[r][i] - fd).abs() <= tol, "{op:?} rank {r} element {i}: {} vs {fd} (tolerance {tol:e})", got[r][i]);
            }
        }
        // Three-way tie: each holder gets a third of Σ_k g_k, so together they get all of it.
        let xs3: Vec<Vec<f64>> = (0..w).map(|_| vec![extreme]).collect();
        let got3 = distributed_grads(op, &xs3);
        let g_sum: f64 = (0..w).map(|k| values(3000 + k as u64, 1)[0]).sum();
        for g in &got3 {
            assert!((g[0] - g_sum / 3.0).abs() <= 1e-12 * (g_sum / 3.0).abs(), "{op:?}: {} vs {}", g[0], g_sum / 3.0);
        }
    }
}

// ------------------------------------------------------------------ the wrong variant

/// The popular "GatherLayer" backward: all_gather forward, but the backward returns only
/// this rank's slice of ITS OWN loss's gradient, with no communication.
struct LocalSliceGather(ProcessGroup);

impl CustomOp1 for LocalSliceGather {
    fn name(&self) -> &'static str {
        "local-slice-gather"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let v = match s {
            CpuStorage::F64(v) => v[l.start_offset()..l.start_offset() + l.shape().elem_count()].to_vec(),
            _ => candle_core::bail!("f64 only"),
        };
        let out = self.0.all_gather_slice(&v)?;
        let mut dims = l.dims().to_vec();
        dims[0] *= self.0.world_size();
        Ok((CpuStorage::F64(out), Shape::from(dims)))
    }
    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let n = arg.dim(0)?;
        Ok(Some(grad.narrow(0, self.0.rank() * n, n)?))
    }
}

#[test]
fn local_slice_gather_gives_one_over_w_of_the_truth() {
    for w in 2..=4 {
        let grads = run_threads(w, |pg| {
            let x = Var::from_tensor(&tensor(100 + pg.rank() as u64, &[2, 3]))?;
            // Every rank computes the same loss of the gathered batch, as in SimCLR.
            let loss = |g: &Tensor| -> Result<Tensor> { g.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?.sum_all() };
            let right = loss(&all_gather(x.as_tensor(), &pg)?)?.backward()?.get(&x).unwrap().clone();
            let wrong = loss(&x.as_tensor().apply_op1(LocalSliceGather(pg.clone()))?)?.backward()?.get(&x).unwrap().clone();
            Ok((flat(&right), flat(&wrong)))
        })
        .unwrap();
        for (right, wrong) in grads {
            let scaled: Vec<f64> = wrong.iter().map(|b| b * w as f64).collect();
            // The sum rule adds W equal terms: exact for W = 2 and 4, a unit roundoff or two at 3.
            let (e, i) = allgrad_testkit::close::elem_rel_err(&scaled, &right, f64::MIN_POSITIVE);
            assert!(e <= 1e-15, "W={w}: local-slice {} x W != sum rule {} (relative error {e:e})", wrong[i], right[i]);
        }
    }
}

// ------------------------------------------------------------------ the users' helper

fn contrastive_loss(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    let all = all_gather(x, pg)?;
    let sim = x.matmul(&all.t()?)?;
    let m = sim.max_keepdim(D::Minus1)?;
    let lse = (sim.broadcast_sub(&m)?.exp()?.sum_keepdim(D::Minus1)?.log()? + m)?;
    lse.mean_all()
}

#[test]
fn invariance_helper_accepts_a_correct_loss() {
    let x = tensor(7, &[12, 5]);
    let reports = check_world_size_invariance(&x, &[1, 2, 3, 4], contrastive_loss).unwrap();
    assert_eq!(reports.len(), 4);
    for r in reports {
        r.assert_close(1e-10).unwrap();
    }
}

#[test]
fn invariance_helper_rejects_the_local_slice_gather() {
    let x = tensor(8, &[12, 5]);
    let wrong = |x: &Tensor, pg: &ProcessGroup| -> Result<Tensor> {
        let all = x.apply_op1(LocalSliceGather(pg.clone()))?;
        all.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?.mean_all()
    };
    let reports = check_world_size_invariance(&x, &[2, 3], wrong).unwrap();
    for r in reports {
        let err = r.assert_close(1e-6).unwrap_err().to_string();
        assert!(err.contains("not world-size invariant"), "{err}");
    }
}

// ------------------------------------------------------------------ point-to-point exchange

/// Rows rank r holds in the exchange tests: uneven (1, 3, 2, 1, ...).
fn p2p_rows(r: usize) -> usize {
    1 + (2 * r) % 3
}

/// The rank that sends to `k` under `dst_of`.
fn source_of(dst_of: &[usize], k: usize) -> usize {
    dst_of.iter().position(|d| *d == k).unwrap()
}

/// The permutations tried at world size w: ring shifts by 1, -1 and 2, the reversal, and the
/// identity.
fn permutations(w: usize) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = [1, -1, 2].iter().map(|s| ring_destinations(w, *s)).collect();
    out.push((0..w).rev().collect());
    out.push((0..w).collect());
    out
}

#[test]
fn ppermute_every_permutation_with_uneven_shards_matches_simulation() {
    for w in 1..=4 {
        for perm in permutations(w) {
            check_against_simulation(
                w,
                |r| tensor(70 + r as u64, &[p2p_rows(r), 3]),
                |x, pg| ppermute(x, &perm, pg),
                |xs, k| Ok(xs[source_of(&perm, k)].clone()),
            );
        }
    }
}

#[test]
fn ring_shift_is_a_shift_by_shift_ranks_and_chains() {
    for w in 1..=4 {
        // Rank k receives from k - 1, then the squares travel back two ranks: k ends with x_{k+1}².
        check_against_simulation(
            w,
            |r| tensor(80 + r as u64, &[p2p_rows(r), 2]),
            |x, pg| ring_shift(&ring_shift(x, 1, pg)?.sqr()?, -2, pg),
            |xs, k| xs[(k + 1) % w].sqr(),
        );
    }
}

/// Σ_k L_k of the finite-difference test in plain f64: z_k = x_{s(k)}² where s(k) is the rank
/// whose rows reach k after a shift by 1 and then the reversal; L_k = Σ_i c_{k,i} z_{k,i}.
fn p2p_objective(xs: &[Vec<f64>]) -> f64 {
    let w = xs.len();
    let rev: Vec<usize> = (0..w).rev().collect();
    let shift = ring_destinations(w, 1);
    (0..w)
        .map(|k| {
            let mid = source_of(&rev, k);
            let s = source_of(&shift, mid);
            let c = values(4000 + k as u64, xs[s].len());
            xs[s].iter().zip(&c).map(|(x, c)| c * x * x).sum::<f64>()
        })
        .sum()
}

#[test]
fn ppermute_chain_matches_finite_differences() {
    for w in 1..=4 {
        let xs: Vec<Vec<f64>> = (0..w).map(|r| values(90 + r as u64, 2 * p2p_rows(r))).collect();
        let got = run_threads(w, |pg| {
            let r = pg.rank();
            let x = Var::from_tensor(&Tensor::from_vec(xs[r].clone(), (p2p_rows(r), 2), &CPU)?)?;
            let rev: Vec<usize> = (0..w).rev().collect();
            let z = ppermute(&ring_shift(x.as_tensor(), 1, &pg)?, &rev, &pg)?.sqr()?;
            let c = Tensor::from_vec(values(4000 + r as u64, z.elem_count()), z.shape(), &CPU)?;
            Ok(flat(z.mul(&c)?.sum_all()?.backward()?.get(&x).unwrap()))
        })
        .unwrap();
        // The objective is quadratic in each input: a central difference is exact but for the
        // rounding of the two objective values (a few ulps of their scale, 4 at most here).
        let h = 0.5;
        for r in 0..w {
            for i in 0..xs[r].len() {
                let (mut plus, mut minus) = (xs.clone(), xs.clone());
                plus[r][i] += h;
                minus[r][i] -= h;
                let fd = (p2p_objective(&plus) - p2p_objective(&minus)) / (2.0 * h);
                let scale = xs.iter().flatten().map(|v| (v.abs() + h) * (v.abs() + h) * 2.0).sum::<f64>();
                let tol = 4.0 * (2 * w * 6) as f64 * f64::EPSILON * scale / (2.0 * h);
                assert!((got[r][i] - fd).abs() <= tol, "W={w} rank {r} element {i}: {} vs finite difference {fd}", got[r][i]);
            }
        }
    }
}

#[test]
fn ppermute_refuses_what_is_not_a_permutation_naming_it() {
    let errs = run_threads(3, |pg| {
        let x = Tensor::zeros((2, 2), DType::F64, &CPU)?;
        let dup = ppermute(&x, &[1, 1, 0], &pg).unwrap_err().to_string();
        let short = ppermute(&x, &[1, 0], &pg).unwrap_err().to_string();
        let out = ppermute(&x, &[1, 2, 3], &pg).unwrap_err().to_string();
        Ok([dup, short, out])
    })
    .unwrap();
    for e in errs.iter().flatten() {
        assert!(e.contains("must name each of the 3 ranks of the group exactly once"), "{e}");
    }
}

#[test]
fn ranks_that_disagree_on_the_permutation_fail_at_the_timeout_naming_it() {
    // Rank 0 shifts by 1, the others by -1: rank 0 waits for rank 2, which sends to rank 1,
    // which waits for rank 2 too; nobody gets what it expects. Every rank must fail within
    // the timeout, its message naming the call and the permutation it was given.
    let res = ThreadWorld::new(3).timeout(std::time::Duration::from_secs(3)).run(|pg| {
        let x = Tensor::zeros((2, 2), DType::F64, &CPU)?;
        let shift = if pg.rank() == 0 { 1 } else { -1 };
        Ok(ring_shift(&x, shift, &pg).map(|_| ()).map_err(|e| e.to_string()))
    });
    let outcomes = res.unwrap();
    for (r, o) in outcomes.iter().enumerate() {
        let e = o.as_ref().expect_err("a rank finished a permutation its peers did not run");
        assert!(e.contains("permute of 4 x F64") && e.contains("ranks to ["), "rank {r}: {e}");
    }
}

#[test]
fn ppermute_in_f32_moves_bits_unchanged() {
    let got = run_threads(3, |pg| {
        let x = Var::from_tensor(&tensor(95 + pg.rank() as u64, &[p2p_rows(pg.rank()), 2]).to_dtype(DType::F32)?)?;
        let y = ring_shift(x.as_tensor(), 1, &pg)?;
        let g = y.sum_all()?.backward()?.get(&x).unwrap().clone();
        Ok((flat(&y), flat(&g), flat(x.as_tensor())))
    })
    .unwrap();
    for k in 0..3 {
        assert_eq!(got[k].0, got[(k + 2) % 3].2, "rank {k} holds rank {}'s values", (k + 2) % 3);
        assert!(got[k].1.iter().all(|g| *g == 1.0), "rank {k}: {:?}", got[k].1);
    }
}
