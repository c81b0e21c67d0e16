//! The class shard of a rank: which contiguous range of global class ids it holds, and the
//! initial centres of those classes, drawn per class so that they do not depend on W.

use allgrad_rng::{normals, stream};
use serde::{Deserialize, Serialize};

/// Key word of the centre initialisation streams (`[seed, CENTRE_KEY, class]`).
const CENTRE_KEY: u64 = 0xCE47_2E5F_ACE0_0001;

/// A contiguous range of rows of a parameter sharded by rows across ranks: this rank holds
/// global rows `start .. start + len` of `total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowRange {
    /// First global row held here.
    pub start: usize,
    /// Rows held here.
    pub len: usize,
    /// Rows of the whole (unsharded) parameter.
    pub total: usize,
}

impl RowRange {
    /// Rank `rank`'s part of `total` rows split over `world` ranks: contiguous, the first
    /// `total % world` ranks one row longer (`total % world` need not be 0).
    pub fn split(total: usize, rank: usize, world: usize) -> RowRange {
        let (base, extra) = (total / world.max(1), total % world.max(1));
        let start = rank * base + rank.min(extra);
        RowRange { start, len: base + usize::from(rank < extra), total }
    }

    /// One past the last global row held here.
    pub fn end(&self) -> usize {
        self.start + self.len
    }

    /// The local row of global row `row`, if this range holds it.
    pub fn local(&self, row: usize) -> Option<usize> {
        (row >= self.start && row < self.end()).then(|| row - self.start)
    }
}

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
    fn uneven_split_covers_every_class_once_in_rank_order() {
        for (total, world) in [(10, 3), (7, 4), (12, 4), (5, 1), (3, 3)] {
            let ranges: Vec<RowRange> = (0..world).map(|r| RowRange::split(total, r, world)).collect();
            let mut next = 0;
            for r in &ranges {
                assert_eq!(r.start, next, "{total} over {world}: {ranges:?}");
                next = r.end();
            }
            assert_eq!(next, total);
            let (lo, hi) = (ranges.iter().map(|r| r.len).min().unwrap(), ranges.iter().map(|r| r.len).max().unwrap());
            assert!(hi - lo <= 1, "{ranges:?}");
        }
        let r = RowRange::split(10, 1, 3);
        assert_eq!((r.start, r.len, r.local(3), r.local(6), r.local(7)), (4, 3, None, Some(2), None));
    }

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
