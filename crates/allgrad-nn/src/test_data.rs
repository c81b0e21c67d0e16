//! Data and comparisons for the kernels' unit tests.

use crate::cpu::Float;

/// `n` values in [-0.5, 0.5) from a xorshift generator seeded with `seed`.
pub(crate) fn data(n: usize, seed: u64) -> Vec<f64> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 11) as f64 / (1u64 << 53) as f64 - 0.5
        })
        .collect()
}

/// The norm-wise relative error of `a` against `b` (`allgrad_testkit::close::rel_err`).
pub(crate) fn max_rel<T: Float>(a: &[T], b: &[T]) -> f64 {
    let wide = |v: &[T]| -> Vec<f64> { v.iter().map(|x| x.to_f64()).collect() };
    allgrad_testkit::close::rel_err(&wide(a), &wide(b))
}
