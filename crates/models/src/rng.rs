//! Keyed random streams: random numbers that depend only on a key, never on the rank or on
//! the order in which samples are processed (DESIGN §3). Candle's CPU RNG cannot be seeded,
//! so values are drawn here and uploaded.

use rand::{Rng, SeedableRng};

/// A generator for the stream named by `key` (e.g. `[seed, epoch, index, view]`).
pub fn stream(key: &[u64]) -> rand::rngs::StdRng {
    // SplitMix64 over the key words: well mixed, so nearby keys give unrelated streams.
    let mut h: u64 = 0x243F_6A88_85A3_08D3;
    for k in key {
        h = splitmix(h ^ splitmix(*k));
    }
    rand::rngs::StdRng::seed_from_u64(h)
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Hashes a string (a parameter name) into a key word.
pub fn name_key(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// `n` standard normal samples from `rng` (Box-Muller, in f64).
pub fn normals(rng: &mut impl Rng, n: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        let u1: f64 = rng.gen_range(f64::MIN_POSITIVE..1.0);
        let u2: f64 = rng.gen();
        let r = (-2.0 * u1.ln()).sqrt();
        let t = std::f64::consts::TAU * u2;
        out.push(r * t.cos());
        out.push(r * t.sin());
    }
    out.truncate(n);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_depend_on_the_key_only() {
        let a: Vec<u32> = (0..4).map(|_| stream(&[1, 2, 3]).gen()).collect();
        assert!(a.iter().all(|x| *x == a[0]));
        let b: u32 = stream(&[1, 2, 4]).gen();
        assert_ne!(a[0], b);
    }

    #[test]
    fn normals_have_unit_variance() {
        let v = normals(&mut stream(&[9]), 20_000);
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 0.03 && (var - 1.0).abs() < 0.05, "{mean} {var}");
    }
}
