//! # allgrad-rng
//!
//! Keyed random streams: random numbers that depend only on a key such as
//! `[seed, epoch, global sample index, view]`, never on the rank, the worker thread or the
//! position of a sample in its batch. This is what makes a run on W ranks equal a run on one
//! rank (ARCHITECTURE.md, "Why W ranks equal one"), and what makes a resumed run equal an uninterrupted one.
//!
//! Every random choice in allgrad goes through this crate, so the guarantee rests on one
//! implementation:
//!
//! - [`stream`] turns a key into a ChaCha12 generator ([`KeyedRng`], from `rand_chacha`
//!   pinned to an exact version in the workspace; its output is specified by the ChaCha
//!   algorithm and does not change between versions, unlike `rand::rngs::StdRng`, which is
//!   documented as free to change).
//! - The samplers ([`unit()`], [`uniform`], [`below`], [`bernoulli`], [`shuffle`], [`normals`])
//!   are written here rather than taken from `rand`'s distributions, whose algorithms may
//!   change in a minor release: the numbers a key yields are fixed by this crate's code and
//!   the pinned generator alone. `tests::pinned_values` holds them to stored values.
//! - [`name_key`] and [`hash128`] are the one string hash (FNV-1a, 64-bit) of the workspace:
//!   parameter names into key words, and names of shared-memory segments.

#![warn(missing_docs)]

use rand::{RngCore, SeedableRng};

/// The generator type of every keyed stream.
pub type KeyedRng = rand_chacha::ChaCha12Rng;

/// A generator for the stream named by `key`. Equal keys give equal streams; keys that differ
/// in any word (or in length) give unrelated streams.
pub fn stream(key: &[u64]) -> KeyedRng {
    // SplitMix64 over the key words into a 256-bit ChaCha seed: well mixed, so nearby keys
    // give unrelated streams.
    let h = chain(key);
    let mut seed = [0u8; 32];
    for (i, chunk) in seed.chunks_exact_mut(8).enumerate() {
        chunk.copy_from_slice(&splitmix(h.wrapping_add(i as u64)).to_le_bytes());
    }
    KeyedRng::from_seed(seed)
}

/// A uniform 64-bit hash of `key`, without building a generator: the same SplitMix64 chain
/// that seeds [`stream`], for choices made per item in bulk (a Partial-FC class sampled at a
/// step) where seeding one ChaCha stream per item would cost more than the choice itself.
pub fn key_hash(key: &[u64]) -> u64 {
    splitmix(chain(key))
}

/// SplitMix64 over the key words (and their count): well mixed, so nearby keys differ.
fn chain(key: &[u64]) -> u64 {
    let mut h: u64 = 0x243F_6A88_85A3_08D3 ^ key.len() as u64;
    for k in key {
        h = splitmix(h ^ splitmix(*k));
    }
    h
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform draw from `[0, 1)` with 53 random bits (one `u64` of the stream).
pub fn unit(rng: &mut impl RngCore) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// A uniform draw from `[lo, hi)` (exactly `lo` when `hi <= lo`; never panics; one `u64`).
pub fn uniform(rng: &mut impl RngCore, lo: f64, hi: f64) -> f64 {
    lo + (hi - lo).max(0.0) * unit(rng)
}

/// A uniform integer from `0..n` (0 when `n <= 1`, drawing nothing; never panics).
///
/// Lemire's multiply-and-reject method: unbiased, and almost always one `u64`.
pub fn below(rng: &mut impl RngCore, n: usize) -> usize {
    if n <= 1 {
        return 0;
    }
    let n = n as u64;
    let threshold = n.wrapping_neg() % n; // (2^64 - n) mod n
    loop {
        let m = (rng.next_u64() as u128) * (n as u128);
        if (m as u64) >= threshold {
            return (m >> 64) as usize;
        }
    }
}

/// True with probability `p` (one draw, also when `p` is 0 or 1, so that a stream's later
/// draws do not depend on `p`).
pub fn bernoulli(rng: &mut impl RngCore, p: f64) -> bool {
    unit(rng) < p
}

/// Shuffles `items` in place (Fisher-Yates from the back, with [`below`]).
pub fn shuffle<T>(rng: &mut impl RngCore, items: &mut [T]) {
    for i in (1..items.len()).rev() {
        let j = below(rng, i + 1);
        items.swap(i, j);
    }
}

/// `n` standard normal samples (Box-Muller in f64, two per pair of draws).
pub fn normals(rng: &mut impl RngCore, n: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        // 1 - unit is in (0, 1]: the logarithm is finite.
        let u1 = 1.0 - unit(rng);
        let u2 = unit(rng);
        let r = (-2.0 * u1.ln()).sqrt();
        let t = std::f64::consts::TAU * u2;
        out.push(r * t.cos());
        out.push(r * t.sin());
    }
    out.truncate(n);
    out
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0100_0000_01b3;

fn fnv1a(basis: u64, parts: &[&[u8]]) -> u64 {
    let mut h = basis;
    for part in parts {
        // The length first, so that ("ab", "c") and ("a", "bc") differ.
        for b in (part.len() as u64).to_le_bytes().iter().chain(part.iter()) {
            h = (h ^ *b as u64).wrapping_mul(FNV_PRIME);
        }
    }
    h
}

/// Hashes a string (a parameter or class name) into a key word for [`stream`] (FNV-1a).
pub fn name_key(name: &str) -> u64 {
    name.bytes().fold(FNV_OFFSET, |h, b| (h ^ b as u64).wrapping_mul(FNV_PRIME))
}

/// A 128-bit digest of several byte strings (two FNV-1a lanes with different bases, each
/// part prefixed with its length). Not cryptographic: for names that must not collide by
/// accident (shared-memory segments), never for authentication.
pub fn hash128(parts: &[&[u8]]) -> [u8; 16] {
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&fnv1a(FNV_OFFSET, parts).to_le_bytes());
    out[8..].copy_from_slice(&fnv1a(0x6c62_272e_07bb_0142, parts).to_le_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_depend_on_the_key_only() {
        let a: Vec<u64> = (0..4).map(|_| stream(&[1, 2, 3, 0]).next_u64()).collect();
        assert!(a.iter().all(|x| *x == a[0]));
        assert_ne!(a[0], stream(&[1, 2, 3, 1]).next_u64());
        assert_ne!(a[0], stream(&[1, 2, 4, 0]).next_u64());
        assert_ne!(stream(&[0, 1]).next_u64(), stream(&[1, 0]).next_u64());
        assert_ne!(stream(&[0]).next_u64(), stream(&[0, 0]).next_u64());
    }

    /// The first values of fixed keys, computed independently by `scripts/reference/ref_keyed_rng.py`
    /// (plain-Python SplitMix64 + ChaCha12 + Lemire + Fisher-Yates). A change here changes
    /// every run's numbers: it must be deliberate, and the commit that makes it must say so.
    #[test]
    fn pinned_values() {
        let mut r = stream(&[0]);
        let got: Vec<u64> = (0..3).map(|_| r.next_u64()).collect();
        assert_eq!(got, PINNED_U64, "keyed stream [0] changed");
        let mut r = stream(&[7, 1, 2]);
        assert_eq!(below(&mut r, 1000), PINNED_BELOW);
        let mut v: Vec<u32> = (0..10).collect();
        shuffle(&mut stream(&[42]), &mut v);
        assert_eq!(v, PINNED_SHUFFLE);
    }
    const PINNED_U64: [u64; 3] = [15922581182341462080, 9064745168046822197, 3006844951103438348];
    const PINNED_BELOW: usize = 794;
    const PINNED_SHUFFLE: [u32; 10] = [1, 8, 2, 0, 7, 5, 9, 4, 6, 3];

    #[test]
    fn samplers_stay_in_range_and_never_panic() {
        let mut r = stream(&[7]);
        for _ in 0..10_000 {
            let u = uniform(&mut r, 0.25, 0.5);
            assert!((0.25..0.5).contains(&u));
            assert!(below(&mut r, 3) < 3);
            assert!((0.0..1.0).contains(&unit(&mut r)));
        }
        assert_eq!(uniform(&mut r, 1.0, 1.0), 1.0);
        assert_eq!(uniform(&mut r, 2.0, 1.0), 2.0);
        assert_eq!(below(&mut r, 0), 0);
        assert!(!bernoulli(&mut r, 0.0));
        assert!(bernoulli(&mut r, 1.0));
    }

    #[test]
    fn below_is_unbiased_and_shuffle_is_a_permutation() {
        // Chi-square over 7 buckets, 70,000 draws: the 99.9% critical value for 6 degrees
        // of freedom is 22.46.
        let mut r = stream(&[3]);
        let mut counts = [0f64; 7];
        for _ in 0..70_000 {
            counts[below(&mut r, 7)] += 1.0;
        }
        let chi2: f64 = counts.iter().map(|c| (c - 10_000.0).powi(2) / 10_000.0).sum();
        assert!(chi2 < 22.46, "chi2 {chi2} counts {counts:?}");
        let mut v: Vec<usize> = (0..100).collect();
        shuffle(&mut r, &mut v);
        let mut s = v.clone();
        s.sort();
        assert_eq!(s, (0..100).collect::<Vec<_>>());
        assert_ne!(v, s);
    }

    #[test]
    fn normals_have_unit_variance() {
        let v = normals(&mut stream(&[9]), 20_000);
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 0.03 && (var - 1.0).abs() < 0.05, "{mean} {var}");
    }

    #[test]
    fn hashes_separate_parts() {
        assert_ne!(hash128(&[b"ab", b"c"]), hash128(&[b"a", b"bc"]));
        assert_eq!(hash128(&[b"x"]), hash128(&[b"x"]));
        assert_ne!(name_key("layer1.weight"), name_key("layer1.bias"));
        // FNV-1a's published test vector for "a".
        assert_eq!(name_key("a"), 0xaf63_dc4c_8601_ec8c);
    }
}
