//! Partial FC: the classes whose centres take part in a step.
//!
//! At step `t` the sampled set is every class that is the label of some sample of the global
//! batch (the positives) plus each other class `c` with probability `rate`, decided by
//! `key_hash([seed, key, t, c]) < rate · 2^64`. The decision for a class depends only on
//! (seed, step, class id), never on which rank holds the class, so the sampled set, and with
//! it the loss and every update, does not depend on W. (insightface's Partial FC v2 instead
//! samples a fixed count per rank, which depends on the split.) The number of sampled
//! negatives therefore varies a little from step to step around `rate · (C − positives)`.

use allgrad_rng::key_hash;

use super::shard::RowRange;

/// Key word of the sampling hashes.
const SAMPLE_KEY: u64 = 0x5A3F_1E0C_0000_0002;

/// Whether negative class `class` is sampled at `step` with probability `rate`.
pub fn negative_sampled(seed: u64, step: u64, class: u64, rate: f64) -> bool {
    if rate >= 1.0 {
        return true;
    }
    // Top 53 bits as a uniform draw in [0, 1).
    let u = (key_hash(&[seed, SAMPLE_KEY, step, class]) >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
    u < rate
}

/// The local rows (sorted) of `range` sampled at `step`: the classes in `labels` (the
/// global batch's labels) and the negatives [`negative_sampled`] picks.
pub fn sampled_rows(range: RowRange, labels: &[usize], seed: u64, step: u64, rate: f64) -> Vec<u32> {
    let mut keep = vec![false; range.len];
    for &l in labels {
        if let Some(r) = range.local(l) {
            keep[r] = true;
        }
    }
    (0..range.len)
        .filter(|&r| keep[r] || negative_sampled(seed, step, (range.start + r) as u64, rate))
        .map(|r| r as u32)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampled_set_contains_the_positives_and_does_not_depend_on_the_split() {
        let labels = [3, 17, 17, 40, 99];
        let global = |w: usize| -> Vec<usize> {
            (0..w)
                .flat_map(|r| {
                    let range = RowRange::split(100, r, w);
                    sampled_rows(range, &labels, 9, 4, 0.1).into_iter().map(move |l| range.start + l as usize)
                })
                .collect()
        };
        let one = global(1);
        for w in [2, 3, 4] {
            assert_eq!(global(w), one, "W={w}");
        }
        for l in labels {
            assert!(one.contains(&l), "positive {l} not sampled");
        }
        let negatives = one.len() - 4;
        assert!((3..=25).contains(&negatives), "{negatives} negatives of 96 at rate 0.1");
    }

    #[test]
    fn the_rate_is_met_and_steps_draw_different_sets() {
        let range = RowRange::split(100_000, 0, 1);
        let a = sampled_rows(range, &[], 1, 0, 0.1);
        let frac = a.len() as f64 / 100_000.0;
        assert!((frac - 0.1).abs() < 0.005, "sampled fraction {frac}");
        assert_ne!(a, sampled_rows(range, &[], 1, 1, 0.1), "step 1 draws the same set as step 0");
        assert_eq!(sampled_rows(RowRange::split(50, 0, 1), &[], 1, 0, 1.0).len(), 50, "rate 1 keeps every class");
    }
}
