//! The distributed losses pass the world-size-invariance check: one rank with the whole batch
//! and W thread-ranks with it split give the same loss and the same input gradients (f64).

use allgrad_dist::testing::check_world_size_invariance;
use allgrad_models::losses::{cross_correlation, nt_xent};
use candle_core::{Device, Tensor};

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
