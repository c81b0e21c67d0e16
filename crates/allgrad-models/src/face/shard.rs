//! The class shard of a rank: which contiguous range of global class ids it holds, and the
//! initial centres of those classes, drawn per class so that they do not depend on W.

use allgrad_rng::{normals, stream};

// A class shard is a `RowRange` of the centres (defined beside `Objective::shard_rows`).
pub use crate::RowRange;

/// Key word of the centre initialisation streams (`[seed, CENTRE_KEY, class]`).
const CENTRE_KEY: u64 = 0xCE47_2E5F_ACE0_0001;

/// The initial centres of the classes in `range`, `[range.len, dim]` row-major: class `c`'s
/// row is `std` times `dim` standard normals from the stream `[seed, CENTRE_KEY, c]`, so a
/// class starts with the same centre whichever rank holds it.
pub fn initial_centres(seed: u64, range: RowRange, dim: usize, std: f64) -> Vec<f64> {
    let mut out = Vec::with_capacity(range.len * dim);
    for c in range.start..range.end() {
        out.extend(normals(&mut stream(&[seed, CENTRE_KEY, c as u64]), dim).into_iter().map(|z| z * std));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn centres_of_a_class_do_not_depend_on_the_split() {
        let whole = initial_centres(5, RowRange::split(10, 0, 1), 4, 0.01);
        for world in [2, 3, 4] {
            let parts: Vec<f64> = (0..world).flat_map(|r| initial_centres(5, RowRange::split(10, r, world), 4, 0.01)).collect();
            assert_eq!(parts, whole, "W={world}");
        }
        assert_ne!(whole[..4], whole[4..8], "classes differ");
        assert_ne!(whole, initial_centres(6, RowRange::split(10, 0, 1), 4, 0.01), "the seed matters");
        let rms = (whole.iter().map(|v| v * v).sum::<f64>() / whole.len() as f64).sqrt();
        assert!((0.005..0.02).contains(&rms), "scale {rms}");
    }
}
