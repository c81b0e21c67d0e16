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

/// The largest difference between `a` and `b`, relative to `b`'s largest magnitude (at least 1).
pub(crate) fn max_rel<T: Float>(a: &[T], b: &[T]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(1.0f64, |m, v| m.max(v.to_f64().abs()));
    a.iter().zip(b).fold(0.0f64, |m, (x, y)| m.max((x.to_f64() - y.to_f64()).abs())) / scale
}
