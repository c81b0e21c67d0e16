//! `check_world_size_invariance` refuses losses whose input gradient is lost: none at all (a
//! detached input), or all zero on a rank where the single process has a non-zero one (a
//! collective without a backward); a correct loss still passes.

use allgrad_dist::testing::check_world_size_invariance;
use allgrad_dist::{all_gather, ProcessGroup};
use candle_core::{Device, Result, Tensor};

/// Rows with distinct, non-zero values in [-2, 2] (no generator: a plain formula).
fn input(rows: usize, cols: usize) -> Tensor {
    let v: Vec<f64> = (0..rows * cols).map(|i| ((i * 37 % 23) as f64 - 11.5) / 5.75).collect();
    Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap()
}

/// Each rank's rows against all rows: depends on every rank's input.
fn gathered_square(all: &Tensor, x: &Tensor) -> Result<Tensor> {
    x.matmul(&all.t()?)?.sqr()?.mean_all()
}

#[test]
fn a_loss_that_detaches_its_input_fails_naming_the_input() {
    let detached = |x: &Tensor, pg: &ProcessGroup| gathered_square(&all_gather(&x.detach(), pg)?, &x.detach());
    let err = check_world_size_invariance(&input(8, 3), &[2], detached).unwrap_err().to_string();
    assert!(err.contains("no gradient with respect to its input"), "{err}");
    assert!(err.contains("rank 0 of 1"), "{err}");
}

#[test]
fn a_loss_that_loses_the_input_only_on_several_ranks_fails_naming_the_rank() {
    // The plain (non-differentiable) all_gather at W > 1 and the input itself at W = 1.
    let plain = |x: &Tensor, pg: &ProcessGroup| {
        let all = if pg.world_size() > 1 { pg.all_gather(x)? } else { x.clone() };
        gathered_square(&all, &all.narrow(0, 0, x.dim(0)?)?.detach())
    };
    let err = check_world_size_invariance(&input(8, 3), &[2], plain).unwrap_err().to_string();
    assert!(err.contains("no gradient with respect to its input on rank 0 of 2"), "{err}");
}

#[test]
fn an_all_zero_gradient_where_the_reference_has_one_fails_naming_the_rank() {
    // As above, but `Σx - Σx` keeps a gradient that is all zero.
    let zeroed = |x: &Tensor, pg: &ProcessGroup| {
        let all = if pg.world_size() > 1 { pg.all_gather(x)? } else { x.clone() };
        gathered_square(&all, &all.narrow(0, 0, x.dim(0)?)?.detach())? + (x.sum_all()? - x.sum_all()?)?
    };
    let err = check_world_size_invariance(&input(8, 3), &[2, 4], zeroed).unwrap_err().to_string();
    assert!(err.contains("input gradient of rank 0 of 2"), "{err}");
    assert!(err.contains("all zero"), "{err}");
}

#[test]
fn the_differentiable_gather_still_passes() {
    let right = |x: &Tensor, pg: &ProcessGroup| gathered_square(&all_gather(x, pg)?, x);
    // Equal parts (8 rows), so the mean of the ranks' means is the global mean.
    for r in check_world_size_invariance(&input(8, 3), &[1, 2, 4], right).unwrap() {
        assert!(r.max_grad > 0.0);
        r.assert_close(1e-10).unwrap();
    }
}
