//! The tiled contrastive losses (`allgrad_models::tiled`) against the untiled ones, in f64:
//! the loss of every rank and every gradient (both views or all three SimCSE inputs, and a
//! learned temperature) agree to relative 1e-10 for tiles of 1, 7, the whole batch and more,
//! on 1, 2 and 3 thread-ranks with asymmetric data; uneven rank shards; the fused CPU kernel
//! against the block path used off the CPU (written-out and autograd gradients); f32; a
//! pairwise loss of one's own; finite differences; bitwise independence of the thread count;
//! NaN propagation and input errors; the fused kernel at every SIMD level the CPU has (the
//! copies of `ALLGRAD_CPU_SIMD`, counted in `allgrad_nn::simd_paths` at the forced level only)
//! with the same bits at every level, against the block path; a queue of past keys against the whole-matrix loss with
//! them appended. The PyTorch references are checked in
//! `losses_reference.rs` and `simcse_info_nce.rs`.
//!
//! The CPU f32/f64 cases are checked to have run the fused kernel, forward and backward, on
//! every rank (`allgrad_models::tiled_paths`), and the block cases the block path: the two
//! agree to rounding, so without this a fallback to the block path would pass. Tolerances
//! through `allgrad_testkit::close` (norm-wise, `ALLGRAD_TEST_ERRORS=1` prints each measured
//! error); TOL is the project's f64 standard for the same sums in another order.

use allgrad_dist::testing::check_world_size_invariance;
use allgrad_dist::{all_gather, run_threads, ProcessGroup};
use allgrad_models::losses::{l2_normalize, logsumexp, nt_xent, nt_xent_tiled, nt_xent_tiled_queued, Temperature};
use allgrad_models::simcse::{
    info_nce, info_nce_hard_negatives, info_nce_hard_negatives_tiled, info_nce_tiled, info_nce_tiled_queued,
};
use allgrad_models::tiled::{scaled_dot_cross_entropy, tiled_cross_entropy, KeyQueue, Pairs, ScaledDot};
use allgrad_models::{tiled_paths, TiledPaths};
use candle_core::{DType, Device, Result, Tensor, Var, D};

const TOL: f64 = 1e-10;

/// Central finite differences against the tiled gradients (see the test).
const FD_TOL: f64 = 3e-9;

/// Asymmetric rows: different lengths and directions, a phase per input.
fn rows(n: usize, d: usize, phase: f64) -> Vec<f64> {
    (0..n * d).map(|j| ((j as f64) * 0.61 + phase).sin() * (1.0 + (j % 5) as f64 * 0.35) + 0.07 * (j / d) as f64).collect()
}

/// What one run produced: each rank's loss, the gradient of every input (rank order, each
/// rank's scaled by 1/W as the trainer does) and the temperature's (summed over ranks, 1/W).
#[derive(Debug)]
struct Outcome {
    losses: Vec<f64>,
    grads: Vec<Vec<f64>>,
    grad_t: f64,
    /// Each rank's tiled paths during its loss and backward.
    paths: Vec<TiledPaths>,
}

impl Outcome {
    /// Every rank ran the fused CPU kernel, forward and backward, and never the block path.
    fn assert_fused(&self, what: &str) {
        for (r, p) in self.paths.iter().enumerate() {
            let ok = p.fused_forward >= 1 && p.fused_backward >= 1 && p.blocks_forward + p.blocks_backward == 0;
            assert!(ok, "{what}: rank {r} did not run the fused kernel: {p:?}");
        }
    }
}

/// Runs `loss(inputs of this rank, learned temperature, pg)` on `w` thread-ranks; rank r holds
/// its near-equal contiguous share of the `n` rows of every input.
fn run<F>(w: usize, n: usize, d: usize, inputs: &[Vec<f64>], t: f64, loss: F) -> Outcome
where
    F: Fn(&[Tensor], &Tensor, &ProcessGroup) -> Result<Tensor> + Sync,
{
    let per_rank = run_threads(w, |pg| {
        let (r, base, extra) = (pg.rank(), n / w, n % w);
        let start = r * base + r.min(extra);
        let len = base + usize::from(r < extra);
        let vars: Vec<Var> = inputs
            .iter()
            .map(|v| Var::from_vec(v[start * d..(start + len) * d].to_vec(), (len, d), &Device::Cpu))
            .collect::<Result<_>>()?;
        let tv = Var::from_vec(vec![t], (), &Device::Cpu)?;
        let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let before = tiled_paths();
        let l = loss(&tensors, tv.as_tensor(), &pg)?;
        let store = (&l / w as f64)?.backward()?;
        let paths = tiled_paths().since(before);
        let grad = |v: &Var| -> Result<Vec<f64>> {
            store
                .get(v)
                .ok_or_else(|| candle_core::Error::Msg("an input got no gradient".into()))?
                .flatten_all()?
                .to_vec1::<f64>()
        };
        let grads = vars.iter().map(grad).collect::<Result<Vec<_>>>()?;
        Ok((l.to_scalar::<f64>()?, grads, grad(&tv)?[0], paths))
    })
    .unwrap();
    let mut out = Outcome { losses: Vec::new(), grads: vec![Vec::new(); inputs.len()], grad_t: 0.0, paths: Vec::new() };
    for (l, g, gt, paths) in per_rank {
        out.losses.push(l);
        out.paths.push(paths);
        for (acc, gi) in out.grads.iter_mut().zip(g) {
            acc.extend(gi);
        }
        out.grad_t += gt;
    }
    out
}

/// Norm-wise within `tol` (`allgrad_testkit::close::rel_err`: a whole gradient computed two
/// ways; for one value, its relative error), against a reference that is not zero.
fn assert_close(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert!(want.iter().any(|v| *v != 0.0), "{what}: the reference is zero");
    allgrad_testkit::close::assert_rel(got, want, tol, what);
}

fn assert_same(got: &Outcome, want: &Outcome, tol: f64, what: &str) {
    assert_close(&got.losses, &want.losses, tol, &format!("{what}: per-rank losses"));
    for (k, (g, r)) in got.grads.iter().zip(&want.grads).enumerate() {
        assert_close(g, r, tol, &format!("{what}: gradient of input {k}"));
    }
    assert_close(&[got.grad_t], &[want.grad_t], tol, &format!("{what}: temperature gradient"));
}

const N: usize = 12;
const DIM: usize = 5;

fn nt_xent_inputs() -> Vec<Vec<f64>> {
    vec![rows(N, DIM, 0.0), rows(N, DIM, 1.7)]
}

#[test]
fn tiled_nt_xent_equals_untiled_loss_and_every_gradient_for_tiles_1_7_batch_and_larger_on_1_2_3_ranks() {
    let inputs = nt_xent_inputs();
    for w in [1, 2, 3] {
        let untiled = run(w, N, DIM, &inputs, 0.3, |z, t, pg| nt_xent(&z[0], &z[1], t, pg));
        assert!(untiled.grad_t.abs() > 1e-3, "degenerate temperature gradient");
        for tile in [1, 7, 2 * N, 2 * N + 5] {
            let tiled = run(w, N, DIM, &inputs, 0.3, |z, t, pg| nt_xent_tiled(&z[0], &z[1], t, tile, pg));
            tiled.assert_fused(&format!("W={w} tile={tile}"));
            assert_same(&tiled, &untiled, TOL, &format!("W={w} tile={tile}"));
        }
    }
}

#[test]
fn tiled_info_nce_equals_untiled_unsupervised_and_with_hard_negatives() {
    let unsup = vec![rows(N, DIM, 0.3), rows(N, DIM, 2.1)];
    let sup = vec![rows(N, DIM, 0.3), rows(N, DIM, 2.1), rows(N, DIM, 4.4)];
    for w in [1, 2, 3] {
        let want = run(w, N, DIM, &unsup, 0.07, |z, t, pg| info_nce(&z[0], &z[1], t, pg));
        for tile in [1, 7, N, N + 5] {
            let got = run(w, N, DIM, &unsup, 0.07, |z, t, pg| info_nce_tiled(&z[0], &z[1], t, tile, pg));
            got.assert_fused(&format!("unsupervised W={w} tile={tile}"));
            assert_same(&got, &want, TOL, &format!("unsupervised W={w} tile={tile}"));
        }
        for weight in [0.0, 0.6] {
            let want = run(w, N, DIM, &sup, 0.07, |z, t, pg| info_nce_hard_negatives(&z[0], &z[1], &z[2], t, weight, pg));
            for tile in [1, 7, 2 * N, 2 * N + 5] {
                let got = run(w, N, DIM, &sup, 0.07, |z, t, pg| {
                    info_nce_hard_negatives_tiled(&z[0], &z[1], &z[2], t, weight, tile, pg)
                });
                got.assert_fused(&format!("hard negatives (weight {weight}) W={w} tile={tile}"));
                assert_same(&got, &want, TOL, &format!("hard negatives (weight {weight}) W={w} tile={tile}"));
            }
        }
    }
}

#[test]
fn tiled_losses_are_world_size_invariant_with_uneven_rank_shards() {
    // 10 samples on 4 ranks: 3, 3, 2, 2 rows; on 3 ranks: 4, 3, 3.
    let x = Tensor::from_vec(rows(10, 2 * DIM, 0.9), (10, 2 * DIM), &Device::Cpu).unwrap();
    let halves = |x: &Tensor| -> Result<(Tensor, Tensor)> { Ok((x.narrow(1, 0, DIM)?, x.narrow(1, DIM, DIM)?)) };
    for tile in [1, 3, 64] {
        let reports = check_world_size_invariance(&x, &[2, 3, 4], |x, pg| {
            let (a, b) = halves(x)?;
            nt_xent_tiled(&a, &b, 0.4, tile, pg)
        })
        .unwrap();
        for r in reports {
            r.assert_close(TOL).unwrap();
        }
        let reports = check_world_size_invariance(&x, &[2, 3, 4], |x, pg| {
            let (a, b) = halves(x)?;
            info_nce_tiled(&a, &b, 0.1, tile, pg)
        })
        .unwrap();
        for r in reports {
            r.assert_close(TOL).unwrap();
        }
    }
    // The untiled NT-Xent too: each rank's loss is scaled by W / 2B, not by its own 1 / 2b.
    for r in check_world_size_invariance(&x, &[3, 4], |x, pg| {
        let (a, b) = halves(x)?;
        nt_xent(&a, &b, 0.4, pg)
    })
    .unwrap()
    {
        r.assert_close(TOL).unwrap();
    }
}

/// NT-Xent's pairing on one rank of `n` samples (`2n` rows and columns).
fn nt_xent_pairs(n: usize) -> Pairs {
    Pairs {
        target: Some((0..2 * n).map(|a| (a + n) % (2 * n)).collect()),
        exclude: Some((0..2 * n).collect()),
        boost: Some(((0..2 * n).map(|a| (a + 3) % (2 * n)).collect(), -0.8)),
    }
}

/// The three ways of computing `scaled_dot` blocks: the fused CPU kernel, [`ScaledDot`]'s
/// written-out gradients on tensor blocks (what runs off the CPU), and Candle's autograd of
/// a closure on each block; each with the tiled paths its loss and backward took.
fn three_paths(q: &Var, k: &Var, t: &Var, pairs: &Pairs, tile: usize) -> Result<Vec<(f64, Vec<f64>, TiledPaths)>> {
    let dot = |q: &Tensor, k: &Tensor, t: &Tensor| q.matmul(&k.t()?)?.broadcast_div(t);
    let (qt, kt, tt) = (q.as_tensor(), k.as_tensor(), t.as_tensor());
    let mut out = Vec::new();
    for path in 0..3 {
        let before = tiled_paths();
        let l = match path {
            0 => scaled_dot_cross_entropy(qt, kt, &Temperature::Learned(tt.clone()), pairs.clone(), tile)?,
            1 => tiled_cross_entropy(qt, kt, tt, pairs.clone(), ScaledDot, tile)?,
            _ => tiled_cross_entropy(qt, kt, tt, pairs.clone(), dot, tile)?,
        };
        let g = l.backward()?;
        let paths = tiled_paths().since(before);
        let mut flat = Vec::new();
        for v in [q, k, t] {
            flat.extend(g.get(v).expect("a gradient").flatten_all()?.to_vec1::<f64>()?);
        }
        out.push((l.to_scalar::<f64>()?, flat, paths));
    }
    Ok(out)
}

#[test]
fn fused_cpu_kernel_equals_the_block_path_and_autograd_of_the_scores_with_every_special_column() {
    // 9 query rows against 14 keys: targets, excluded and boosted columns all present, in
    // blocks that do not divide either side.
    let n = 7;
    let q = Var::from_vec(rows(2 * n, 4, 0.2), (2 * n, 4), &Device::Cpu).unwrap();
    let k = Var::from_vec(rows(2 * n, 4, 1.1), (2 * n, 4), &Device::Cpu).unwrap();
    let t = Var::from_vec(vec![0.45f64], 1, &Device::Cpu).unwrap();
    let q9 = Var::from_tensor(&q.narrow(0, 0, 9).unwrap()).unwrap();
    let mut pairs = nt_xent_pairs(n);
    for list in [&mut pairs.target, &mut pairs.exclude] {
        list.as_mut().unwrap().truncate(9);
    }
    pairs.boost.as_mut().unwrap().0.truncate(9);
    for tile in [1, 2, 5, 9, 14, 40] {
        let paths = three_paths(&q9, &k, &t, &pairs, tile).unwrap();
        let fused = TiledPaths { fused_forward: 1, fused_backward: 1, ..Default::default() };
        let block = TiledPaths { blocks_forward: 1, blocks_backward: 1, ..Default::default() };
        assert_eq!([paths[0].2, paths[1].2, paths[2].2], [fused, block, block], "tile {tile}: the paths taken");
        for (name, p) in ["written-out block", "autograd block"].iter().zip(&paths[1..]) {
            assert_close(&[p.0], &[paths[0].0], TOL, &format!("tile {tile}: {name} loss"));
            assert_close(&p.1, &paths[0].1, TOL, &format!("tile {tile}: {name} gradients"));
        }
    }
}

#[test]
fn f32_tiled_nt_xent_equals_the_untiled_within_f32_rounding() {
    let inputs = nt_xent_inputs();
    let run32 = |tile: Option<usize>| {
        run_threads(2, |pg| {
            let r = pg.rank();
            let part = |v: &Vec<f64>| {
                let v: Vec<f32> = v[r * 6 * DIM..(r + 1) * 6 * DIM].iter().map(|&x| x as f32).collect();
                Var::from_vec(v, (6, DIM), &Device::Cpu)
            };
            let (a, b) = (part(&inputs[0])?, part(&inputs[1])?);
            let l = match tile {
                Some(tile) => nt_xent_tiled(&a, &b, 0.2, tile, &pg)?,
                None => nt_xent(&a, &b, 0.2, &pg)?,
            };
            let g = l.backward()?;
            let mut flat = vec![l.to_scalar::<f32>()? as f64];
            for v in [&a, &b] {
                flat.extend(g.get(v).unwrap().flatten_all()?.to_vec1::<f32>()?.into_iter().map(f64::from));
            }
            Ok(flat)
        })
        .unwrap()
        .concat()
    };
    let want = run32(None);
    for tile in [1, 5, 64] {
        // f32: the sums run in another order (1e-5 relative, the project's f32 tolerance).
        assert_close(&run32(Some(tile)), &want, 1e-5, &format!("f32 tile {tile}"));
    }
}

/// A pairwise loss of one's own: logits `−scale·|q − k|²`, no target (a log-partition term,
/// as in the uniformity loss), plus one with targets.
fn neg_sq_distance(q: &Tensor, k: &Tensor, scale: &Tensor) -> Result<Tensor> {
    let qq = q.sqr()?.sum_keepdim(1)?;
    let kk = k.sqr()?.sum_keepdim(1)?.t()?;
    let d2 = (qq.broadcast_add(&kk)? - (q.matmul(&k.t()?)? * 2.0)?)?;
    d2.broadcast_mul(&scale.neg()?)
}

#[test]
fn a_custom_scores_function_in_tiles_equals_its_untiled_composition() {
    let (m, n) = (6, 11);
    let q = Var::from_vec(rows(m, 3, 0.4), (m, 3), &Device::Cpu).unwrap();
    let k = Var::from_vec(rows(n, 3, 2.2), (n, 3), &Device::Cpu).unwrap();
    let s = Var::from_vec(vec![1.3f64], 1, &Device::Cpu).unwrap();
    let grads = |l: &Tensor| -> Vec<f64> {
        let g = l.backward().unwrap();
        let mut out = vec![l.to_scalar::<f64>().unwrap()];
        for v in [&q, &k, &s] {
            out.extend(g.get(v).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap());
        }
        out
    };
    let logits = neg_sq_distance(q.as_tensor(), k.as_tensor(), s.as_tensor()).unwrap();
    let m_ = logits.max_keepdim(D::Minus1).unwrap().detach();
    let lse = (logits.broadcast_sub(&m_).unwrap().exp().unwrap().sum_keepdim(D::Minus1).unwrap().log().unwrap() + m_).unwrap();
    let targets: Vec<usize> = (0..m).map(|i| (2 * i + 1) % n).collect();
    let idx = Tensor::from_vec(targets.iter().map(|&t| t as u32).collect::<Vec<_>>(), (m, 1), &Device::Cpu).unwrap();
    let untiled_partition = grads(&lse.sum_all().unwrap());
    let untiled_ce = grads(&(lse - logits.gather(&idx, 1).unwrap()).unwrap().sum_all().unwrap());
    for tile in [1, 4, 11, 30] {
        let l =
            tiled_cross_entropy(q.as_tensor(), k.as_tensor(), s.as_tensor(), Pairs::default(), neg_sq_distance, tile).unwrap();
        assert_close(&grads(&l), &untiled_partition, TOL, &format!("log-partition, tile {tile}"));
        let pairs = Pairs { target: Some(targets.clone()), ..Default::default() };
        let l = tiled_cross_entropy(q.as_tensor(), k.as_tensor(), s.as_tensor(), pairs, neg_sq_distance, tile).unwrap();
        assert_close(&grads(&l), &untiled_ce, TOL, &format!("cross-entropy, tile {tile}"));
    }
}

#[test]
fn tiled_nt_xent_gradients_match_central_finite_differences() {
    // 3 samples, dimension 2, temperature learned: every input and the temperature.
    let (n, d, t) = (3, 2, 0.6);
    let (z1, z2) = (rows(n, d, 0.5), rows(n, d, 2.5));
    let value = |z1: &[f64], z2: &[f64], t: f64| -> f64 {
        run_threads(1, |pg| {
            let a = Tensor::from_vec(z1.to_vec(), (n, d), &Device::Cpu)?;
            let b = Tensor::from_vec(z2.to_vec(), (n, d), &Device::Cpu)?;
            nt_xent_tiled(&a, &b, Tensor::new(t, &Device::Cpu)?, 2, &pg)?.to_scalar::<f64>()
        })
        .unwrap()[0]
    };
    let got = run(1, n, d, &[z1.clone(), z2.clone()], t, |z, t, pg| nt_xent_tiled(&z[0], &z[1], t, 2, pg));
    let h = 1e-5;
    let mut numeric = vec![Vec::new(), Vec::new()];
    for (which, base) in [&z1, &z2].into_iter().enumerate() {
        for i in 0..base.len() {
            let (mut up, mut down) = (base.clone(), base.clone());
            up[i] += h;
            down[i] -= h;
            let (fu, fd) =
                if which == 0 { (value(&up, &z2, t), value(&down, &z2, t)) } else { (value(&z1, &up, t), value(&z1, &down, t)) };
            numeric[which].push((fu - fd) / (2.0 * h));
        }
    }
    let numeric_t = (value(&z1, &z2, t + h) - value(&z1, &z2, t - h)) / (2.0 * h);
    // Central differences: truncation h²·f''' ~ 1e-10 and rounding 1e-16/h ~ 1e-11 of the
    // gradient's scale. Measured (AMD EPYC, AVX-512): 1.4e-10 and 1.3e-10 for the views, 3.6e-10
    // for the temperature; 3e-9 is about ten times that and catches any wrong term (a missing
    // exclusion, positive or temperature factor changes gradients by 1e-2 or more).
    for (k, (g, num)) in got.grads.iter().zip(&numeric).enumerate() {
        assert_close(g, num, FD_TOL, &format!("view {k}"));
    }
    assert_close(&[got.grad_t], &[numeric_t], FD_TOL, "temperature");
}

#[test]
fn fused_kernel_results_do_not_depend_on_the_number_of_threads() {
    let (q, k) = (rows(40, 6, 0.1), rows(40, 6, 0.8));
    let pairs = nt_xent_pairs(20);
    let compute = |threads: usize| -> Vec<u64> {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| {
            let q = Var::from_vec(q.clone(), (40, 6), &Device::Cpu).unwrap();
            let k = Var::from_vec(k.clone(), (40, 6), &Device::Cpu).unwrap();
            let t = Var::from_vec(vec![0.3f64], (), &Device::Cpu).unwrap();
            let l = scaled_dot_cross_entropy(q.as_tensor(), k.as_tensor(), &t.as_tensor().into(), pairs.clone(), 8).unwrap();
            let g = l.backward().unwrap();
            let mut bits = vec![l.to_scalar::<f64>().unwrap().to_bits()];
            for v in [&q, &k, &t] {
                bits.extend(g.get(v).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap().iter().map(|x| x.to_bits()));
            }
            bits
        })
    };
    let one = compute(1);
    assert_eq!(compute(3), one, "3 threads differ from 1 in some bit");
    assert_eq!(compute(2), one, "2 threads differ from 1 in some bit");
}

/// The fused kernel's row loops at every SIMD level this CPU has, forward and backward, f64 and
/// f32: the copies of the forced level run (counted by the dispatch arm that ran: at least one
/// per block, none at another level), every level gives the same bits, and each equals the
/// block path (f64 1e-10, f32 1e-5, the f32 against the f64 block path; measured 1.3e-16 and
/// 1.3e-6).
#[test]
fn the_fused_kernel_at_every_simd_level_gives_the_same_bits_and_counts_the_copy_that_ran() {
    use allgrad_nn::{force_simd, simd_paths, SimdLevel};
    let levels = [SimdLevel::Baseline, SimdLevel::Avx2, SimdLevel::Avx512];
    let at = |l: SimdLevel, p: allgrad_nn::SimdPaths| match l {
        SimdLevel::Avx512 => p.avx512,
        SimdLevel::Avx2 => p.avx2,
        SimdLevel::Baseline => p.baseline,
    };
    // 30 rows against 38 keys, tile 8: 4 x 5 blocks, the last of each side partial; targets,
    // excluded and boosted columns.
    let (m, n, d) = (30, 38, 6);
    let (q0, k0) = (rows(m, d, 0.4), rows(n, d, 1.3));
    let mut pairs = nt_xent_pairs(n / 2);
    for list in [&mut pairs.target, &mut pairs.exclude] {
        list.as_mut().unwrap().truncate(m);
    }
    pairs.boost.as_mut().unwrap().0.truncate(m);
    let run = |dtype: DType, fused: bool| -> Vec<f64> {
        let q = Var::from_tensor(&Tensor::from_vec(q0.clone(), (m, d), &Device::Cpu).unwrap().to_dtype(dtype).unwrap()).unwrap();
        let k = Var::from_tensor(&Tensor::from_vec(k0.clone(), (n, d), &Device::Cpu).unwrap().to_dtype(dtype).unwrap()).unwrap();
        let t = Var::from_tensor(&Tensor::new(&[0.35f64], &Device::Cpu).unwrap().to_dtype(dtype).unwrap()).unwrap();
        let l = if fused {
            scaled_dot_cross_entropy(q.as_tensor(), k.as_tensor(), &Temperature::Learned(t.as_tensor().clone()), pairs.clone(), 8)
        } else {
            tiled_cross_entropy(q.as_tensor(), k.as_tensor(), t.as_tensor(), pairs.clone(), ScaledDot, 8)
        }
        .unwrap();
        let g = l.backward().unwrap();
        let mut out = vec![l.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap()];
        for v in [&q, &k, &t] {
            out.extend(g.get(v).unwrap().to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap());
        }
        out
    };
    let want = run(DType::F64, false);
    for (dtype, tol) in [(DType::F64, TOL), (DType::F32, 1e-5)] {
        let mut first: Option<(SimdLevel, Vec<u64>)> = None;
        for level in levels.into_iter().filter(|&l| l <= SimdLevel::detected()) {
            let _forced = force_simd(level).unwrap();
            let before = simd_paths();
            let paths = tiled_paths();
            let got = run(dtype, true);
            let after = simd_paths();
            let taken = tiled_paths().since(paths);
            assert_eq!(
                (taken.fused_forward, taken.fused_backward),
                (1, 1),
                "{dtype:?} at {}: the fused kernel ran",
                level.name()
            );
            for other in levels {
                let runs = at(other, after) - at(other, before);
                let what = format!("{dtype:?} forced to {}: {runs} copies counted at {}", level.name(), other.name());
                // 4 row blocks x 5 column blocks, forward and backward.
                assert!(if other == level { runs >= 40 } else { runs == 0 }, "{what}");
            }
            assert_close(&got[..1], &want[..1], tol, &format!("{dtype:?} at {}: loss", level.name()));
            assert_close(&got[1..], &want[1..], tol, &format!("{dtype:?} at {}: gradients", level.name()));
            let bits: Vec<u64> = got.iter().map(|v| v.to_bits()).collect();
            match &first {
                None => first = Some((level, bits)),
                Some((l0, b0)) => assert!(bits == *b0, "{dtype:?}: {} and {} give different bits", l0.name(), level.name()),
            }
        }
    }
}

#[test]
fn a_nan_embedding_makes_the_tiled_loss_nan_on_every_path() {
    let mut q = rows(4, 3, 0.0);
    q[4] = f64::NAN;
    let q = Var::from_vec(q, (4, 3), &Device::Cpu).unwrap();
    let k = Var::from_vec(rows(4, 3, 1.0), (4, 3), &Device::Cpu).unwrap();
    let t = Var::from_vec(vec![0.5f64], 1, &Device::Cpu).unwrap();
    for tile in [1, 2, 4] {
        let pairs = Pairs { target: Some(vec![1, 2, 3, 0]), exclude: Some(vec![0, 1, 2, 3]), boost: None };
        for (path, (loss, _, _)) in three_paths(&q, &k, &t, &pairs, tile).unwrap().into_iter().enumerate() {
            assert!(loss.is_nan(), "path {path}, tile {tile}: loss {loss} from a NaN embedding");
        }
    }
}

#[test]
fn bad_inputs_are_errors_naming_what_is_wrong() {
    let q = Tensor::ones((3, 2), DType::F64, &Device::Cpu).unwrap();
    let k = Tensor::ones((5, 2), DType::F64, &Device::Cpu).unwrap();
    let err =
        |t: Temperature, pairs: Pairs, tile: usize| scaled_dot_cross_entropy(&q, &k, &t, pairs, tile).unwrap_err().to_string();
    assert!(err(0.5.into(), Pairs::default(), 0).contains("tile must be at least 1"));
    assert!(err((-0.5).into(), Pairs::default(), 2).contains("loss.temperature must be positive, got -0.5"));
    let e = err(0.5.into(), Pairs { target: Some(vec![0, 1, 5]), ..Default::default() }, 2);
    assert!(e.contains("pairs.target[2] = 5 is not a column of the 5 keys"), "{e}");
    let wide = Tensor::ones((5, 3), DType::F64, &Device::Cpu).unwrap();
    let e = scaled_dot_cross_entropy(&q, &wide, &0.5.into(), Pairs::default(), 2).unwrap_err().to_string();
    assert!(e.contains("differ in width"), "{e}");
    let e = tiled_cross_entropy(&q, &k, &q, Pairs::default(), |q: &Tensor, _: &Tensor, _: &Tensor| Ok(q.clone()), 3)
        .unwrap_err()
        .to_string();
    assert!(e.contains("returned shape [3, 2] for 3 queries and 3 keys; expected [3, 3]"), "{e}");
}

#[test]
fn a_scores_function_that_captures_a_var_is_an_error_rather_than_a_missing_gradient() {
    let q = Var::from_vec(rows(4, 3, 0.0), (4, 3), &Device::Cpu).unwrap();
    let k = Var::from_vec(rows(5, 3, 1.0), (5, 3), &Device::Cpu).unwrap();
    let none = Tensor::zeros(1, DType::F64, &Device::Cpu).unwrap();
    // A learned scale captured by the closure instead of passed as its params.
    let scale = Var::from_vec(vec![2.0f64], 1, &Device::Cpu).unwrap();
    let captured = scale.as_tensor().clone();
    let scores = move |q: &Tensor, k: &Tensor, _: &Tensor| q.matmul(&k.t()?)?.broadcast_mul(&captured);
    let e = tiled_cross_entropy(q.as_tensor(), k.as_tensor(), &none, Pairs::default(), scores, 2).unwrap_err().to_string();
    assert!(e.contains("captured Var") && e.contains("pass it through params"), "{e}");
    // A captured constant (no gradient wanted) is fine, and the scale passed as params gets
    // its gradient.
    let constant = scale.as_tensor().detach();
    let scores = move |q: &Tensor, k: &Tensor, _: &Tensor| q.matmul(&k.t()?)?.broadcast_mul(&constant);
    tiled_cross_entropy(q.as_tensor(), k.as_tensor(), &none, Pairs::default(), scores, 2).unwrap();
    let scores = |q: &Tensor, k: &Tensor, s: &Tensor| q.matmul(&k.t()?)?.broadcast_mul(s);
    let l = tiled_cross_entropy(q.as_tensor(), k.as_tensor(), scale.as_tensor(), Pairs::default(), scores, 2).unwrap();
    assert!(l.backward().unwrap().get(&scale).is_some(), "the scale passed as params got no gradient");
}

/// NT-Xent of this rank's anchors against the gathered candidates and then `extra` keys as
/// negatives, composed of plain ops over the whole logits matrix: the reference of the queue.
fn nt_xent_with_negatives_reference(z1: &Tensor, z2: &Tensor, extra: &Tensor, t: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    let b = z1.dim(0)?;
    let sizes = pg.all_gather_slice(&[b as i64])?;
    let offset: usize = sizes[..pg.rank()].iter().map(|s| *s as usize).sum();
    let total: usize = sizes.iter().map(|s| *s as usize).sum();
    let (z1, z2) = (l2_normalize(z1)?, l2_normalize(z2)?);
    let keys = Tensor::cat(&[&all_gather(&z1, pg)?, &all_gather(&z2, pg)?, extra], 0)?;
    let anchors = Tensor::cat(&[&z1, &z2], 0)?;
    let logits = Temperature::Learned(t.clone()).divide(&anchors.matmul(&keys.t()?)?)?;
    let n = keys.dim(0)?;
    let mut mask = vec![0f64; 2 * b * n];
    let mut positive = Vec::new();
    for a in 0..2 * b {
        let (me, pos) = if a < b { (offset + a, total + offset + a) } else { (total + offset + a - b, offset + a - b) };
        mask[a * n + me] = f64::NEG_INFINITY;
        positive.push(pos as u32);
    }
    let masked = (&logits + Tensor::from_vec(mask, (2 * b, n), &Device::Cpu)?)?;
    let pos = logits.gather(&Tensor::from_vec(positive, (2 * b, 1), &Device::Cpu)?, 1)?.squeeze(1)?;
    (logsumexp(&masked)? - pos)?.sum_all()? * (pg.world_size() as f64 / (2 * total) as f64)
}

#[test]
fn queued_negatives_equal_the_whole_matrix_loss_with_them_appended_and_the_queue_takes_the_batch() {
    let inputs = nt_xent_inputs();
    let queued = rows(2 * N, DIM, 3.3); // one past batch of 2N keys, normalised below
    let past = l2_normalize(&Tensor::from_vec(queued, (2 * N, DIM), &Device::Cpu).unwrap()).unwrap();
    for w in [1, 2, 3] {
        let want = run(w, N, DIM, &inputs, 0.25, |z, t, pg| nt_xent_with_negatives_reference(&z[0], &z[1], &past, t, pg));
        for tile in [1, 7, 3 * N] {
            let got = run(w, N, DIM, &inputs, 0.25, |z, t, pg| {
                let mut q = KeyQueue::new(2)?;
                q.push(&past)?;
                let l = nt_xent_tiled_queued(&z[0], &z[1], t, tile, &mut q, pg)?;
                // The queue now holds the past batch, then this batch's gathered candidates.
                let keys = q.keys()?.expect("a queue with keys");
                let cand = Tensor::cat(&[&all_gather(&l2_normalize(&z[0])?, pg)?, &all_gather(&l2_normalize(&z[1])?, pg)?], 0)?;
                let diff = (keys.narrow(0, 2 * N, 2 * N)? - cand)?.abs()?.max_all()?.to_scalar::<f64>()?;
                assert!(q.len() == 2 && diff == 0.0, "the queue did not take this batch's candidates ({diff:e})");
                Ok(l)
            });
            assert_same(&got, &want, TOL, &format!("W={w} tile={tile}"));
        }
    }
}

#[test]
fn queued_info_nce_with_hard_negatives_equals_the_untiled_loss_on_candidates_and_queue() {
    // Reference: the untiled supervised InfoNCE whose hard negatives are this batch's followed
    // by the queued keys (every anchor scores both), with the weight on its own hard negative.
    let sup = vec![rows(N, DIM, 0.3), rows(N, DIM, 2.1), rows(N, DIM, 4.4)];
    let past = l2_normalize(&Tensor::from_vec(rows(2 * N, DIM, 5.5), (2 * N, DIM), &Device::Cpu).unwrap()).unwrap();
    for w in [1, 3] {
        let want = run(w, N, DIM, &sup, 0.07, |z, t, pg| {
            let b = z[0].dim(0)?;
            let (offset, total) = {
                let sizes = pg.all_gather_slice(&[b as i64])?;
                (sizes[..pg.rank()].iter().map(|s| *s as usize).sum::<usize>(), sizes.iter().map(|s| *s as usize).sum::<usize>())
            };
            let keys =
                Tensor::cat(&[&all_gather(&l2_normalize(&z[1])?, pg)?, &all_gather(&l2_normalize(&z[2])?, pg)?, &past], 0)?;
            let logits = Temperature::Learned(t.clone()).divide(&l2_normalize(&z[0])?.matmul(&keys.t()?)?)?;
            let n = keys.dim(0)?;
            let mut boost = vec![0f64; b * n];
            for i in 0..b {
                boost[i * n + total + offset + i] = 0.6;
            }
            let logits = (logits + Tensor::from_vec(boost, (b, n), &Device::Cpu)?)?;
            let idx = Tensor::from_vec((0..b).map(|i| (offset + i) as u32).collect::<Vec<_>>(), (b, 1), &Device::Cpu)?;
            (logsumexp(&logits)? - logits.gather(&idx, 1)?.squeeze(1)?)?.sum_all()? * (pg.world_size() as f64 / total as f64)
        });
        for tile in [1, 7, 50] {
            let got = run(w, N, DIM, &sup, 0.07, |z, t, pg| {
                let mut q = KeyQueue::new(1)?;
                q.push(&past)?;
                info_nce_tiled_queued(&z[0], &z[1], Some(&z[2]), t, 0.6, tile, &mut q, pg)
            });
            assert_same(&got, &want, TOL, &format!("W={w} tile={tile}"));
        }
    }
}
