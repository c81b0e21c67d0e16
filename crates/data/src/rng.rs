//! Keyed random streams: random numbers that depend only on a key such as
//! `[seed, epoch, global index, view]`, never on the rank, the worker thread or the position
//! of a sample in its batch (DESIGN §3). The same construction as `allgrad-models`' streams,
//! kept here so that this crate depends on Candle only.

use rand::{Rng, SeedableRng};

/// The generator type of every keyed stream.
pub type KeyedRng = rand::rngs::StdRng;

/// A generator for the stream named by `key`. Equal keys give equal streams; keys that differ
/// in any word give unrelated streams.
pub fn stream(key: &[u64]) -> KeyedRng {
    // SplitMix64 over the key words: well mixed, so nearby keys give unrelated streams.
    let mut h: u64 = 0x243F_6A88_85A3_08D3;
    for k in key {
        h = splitmix(h ^ splitmix(*k));
    }
    KeyedRng::seed_from_u64(h)
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform draw from `[lo, hi)` (exactly `lo` when `hi <= lo`; never panics).
pub fn uniform(rng: &mut impl Rng, lo: f64, hi: f64) -> f64 {
    lo + (hi - lo).max(0.0) * rng.gen::<f64>()
}

/// A uniform integer from `0..n` (0 when `n` is 0; never panics).
pub fn below(rng: &mut impl Rng, n: usize) -> usize {
    if n <= 1 {
        0
    } else {
        rng.gen_range(0..n)
    }
}

/// True with probability `p` (one draw, also when `p` is 0 or 1, so that a stream's later
/// draws do not depend on `p`).
pub fn bernoulli(rng: &mut impl Rng, p: f64) -> bool {
    rng.gen::<f64>() < p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_depend_on_the_key_only() {
        let a: Vec<u64> = (0..4).map(|_| stream(&[1, 2, 3, 0]).gen()).collect();
        assert!(a.iter().all(|x| *x == a[0]));
        assert_ne!(a[0], stream(&[1, 2, 3, 1]).gen::<u64>());
        assert_ne!(a[0], stream(&[1, 2, 4, 0]).gen::<u64>());
        assert_ne!(stream(&[0, 1]).gen::<u64>(), stream(&[1, 0]).gen::<u64>());
    }

    #[test]
    fn helpers_stay_in_range_and_never_panic() {
        let mut r = stream(&[7]);
        for _ in 0..1000 {
            let u = uniform(&mut r, 0.25, 0.5);
            assert!((0.25..0.5).contains(&u));
            assert!(below(&mut r, 3) < 3);
        }
        assert_eq!(uniform(&mut r, 1.0, 1.0), 1.0);
        assert_eq!(below(&mut r, 0), 0);
        assert!(!bernoulli(&mut r, 0.0));
        assert!(bernoulli(&mut r, 1.0));
    }
}
