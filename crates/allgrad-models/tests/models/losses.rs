//! The distributed losses pass the world-size-invariance check: one rank with the whole batch
//! and W thread-ranks with it split give the same loss and the same input gradients (f64).
//! The cross-correlation summed with a raw all_reduce (identity backward) does not: its
//! data-parallel gradient is exactly 1/W of one process's.

use allgrad_dist::testing::check_world_size_invariance;
use allgrad_dist::{all_reduce, run_threads, ReduceOp};
use allgrad_models::losses::{cross_correlation, global_rows, nt_xent, redundancy_reduction, standardise_global, LossConfig};
use candle_core::{Device, Tensor, Var};

fn features() -> Tensor {
    // Rows are samples; asymmetric, fixed values.
    let v: Vec<f64> = (0..12 * 6).map(|i| ((i * 37 % 23) as f64 - 11.0) / 7.0).collect();
    Tensor::from_vec(v, (12, 6), &Device::Cpu).unwrap()
}

#[test]
fn nt_xent_is_world_size_invariant() {
    // The second view is a fixed function of the first, row by row.
    let reports = check_world_size_invariance(&features(), &[2, 3, 4], |x, pg| nt_xent(x, &(x.sin()? + x)?, 0.3, pg)).unwrap();
    for r in reports {
        r.assert_close(1e-10).unwrap();
    }
}

#[test]
fn cross_correlation_is_world_size_invariant() {
    let reports =
        check_world_size_invariance(&features(), &[2, 3, 4], |x, pg| cross_correlation(x, &(x.cos()? * 2.0)?, 0.01, pg)).unwrap();
    for r in reports {
        r.assert_close(1e-10).unwrap();
    }
}

#[test]
fn scaled_cross_correlation_through_the_loss_config_is_world_size_invariant() {
    let cfg = LossConfig::CrossCorrelation { lambda: 0.02, scale: 0.125, tile: None };
    let reports = check_world_size_invariance(&features(), &[2, 3, 4], |x, pg| cfg.compute(x, &(x.cos()? * 2.0)?, pg)).unwrap();
    for r in reports {
        r.assert_close(1e-10).unwrap();
    }
}

/// The cross-correlation loss of a replicated linear map `z = x A` (two views: `x` and
/// `x²/3 + x`), with the sum of `c` over ranks either differentiable or raw: a raw
/// all_reduce's backward is the identity, as when `c` is summed with a plain collective that
/// autograd does not see. Returns the data-parallel gradient of `A` (each rank's gradient of
/// its loss / W, summed over ranks) and the loss.
fn linear_barlow_grad(w: usize, raw: bool) -> (Vec<f64>, f64) {
    let x = features(); // [12, 6]
    let a: Vec<f64> = (0..6 * 4).map(|i| ((i * 13 % 11) as f64 - 5.0) / 9.0).collect();
    let out = run_threads(w, |pg| {
        let rows = 12 / w;
        let xr = x.narrow(0, pg.rank() * rows, rows)?;
        let a = Var::from_vec(a.clone(), (6, 4), &Device::Cpu)?;
        let z1 = xr.matmul(a.as_tensor())?;
        let z2 = ((xr.sqr()? / 3.0)? + &xr)?.matmul(a.as_tensor())?;
        let n = global_rows(rows, &pg)? as f64;
        let (z1n, z2n) = (standardise_global(&z1, n, &pg)?, standardise_global(&z2, n, &pg)?);
        let local = (z1n.t()?.matmul(&z2n)? / n)?;
        let c = if raw {
            // Forward: the global sum. Backward: the identity (only this rank's term).
            let summed = all_reduce(&local, ReduceOp::Sum, &pg)?.detach();
            (&local + (summed - &local)?.detach())?
        } else {
            all_reduce(&local, ReduceOp::Sum, &pg)?
        };
        let loss = redundancy_reduction(&c, 0.05)?;
        let g = (&loss / w as f64)?.backward()?;
        let mut grad = g.get(&a).unwrap().flatten_all()?.to_vec1::<f64>()?;
        pg.all_reduce_slice(&mut grad, ReduceOp::Sum)?;
        Ok((grad, loss.to_scalar::<f64>()?))
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

#[test]
fn raw_all_reduce_of_the_cross_correlation_gives_one_over_w_of_the_gradient() {
    let (truth, loss1) = linear_barlow_grad(1, false);
    let scale = truth.iter().fold(0f64, |m, g| m.max(g.abs()));
    assert!(scale > 1e-3, "degenerate reference gradient");
    for w in [2, 3, 4] {
        let (ours, loss) = linear_barlow_grad(w, false);
        let (raw, raw_loss) = linear_barlow_grad(w, true);
        // Same forward: the raw variant's loss is right, only its gradient is wrong.
        assert!((loss - loss1).abs() < 1e-12 && (raw_loss - loss1).abs() < 1e-12, "W={w}: losses {loss} {raw_loss} vs {loss1}");
        for ((t, o), r) in truth.iter().zip(&ours).zip(&raw) {
            assert!((o - t).abs() <= 1e-12 * scale, "W={w}: differentiable all_reduce gave {o}, one process {t}");
            assert!((r * w as f64 - t).abs() <= 1e-12 * scale, "W={w}: raw all_reduce gave {r}, expected {t}/{w}");
        }
    }
}
