//! Open-set verification, as face benchmarks do it: pairs of images of the same or of
//! different identities (identities never seen in training), scored by the cosine of their
//! embeddings.
//!
//! - 10-fold accuracy at the best threshold (the LFW protocol): a balanced pair list (every
//!   positive pair and as many negative pairs, drawn by a keyed stream) in 10 folds; for each
//!   fold the threshold that is best on the other nine is applied to it; the mean accuracy.
//! - TPR at FAR 1e-3 (the IJB style): over ALL pairs, the threshold that at most a fraction
//!   1e-3 of the negative pairs pass, and the fraction of positive pairs above it.

use allgrad_rng::{shuffle, stream};

/// Key word of the pair draws.
const PAIR_KEY: u64 = 0x7E21_F1CA_7100_0003;

/// The verification figures.
#[derive(Clone, Debug, PartialEq)]
pub struct Verification {
    /// Mean 10-fold accuracy at the best threshold.
    pub accuracy: f64,
    /// True-accept rate at a false-accept rate of 1e-3.
    pub tpr_at_far_1e3: f64,
    /// Positive pairs (all of them).
    pub positives: usize,
    /// Negative pairs (all of them).
    pub negatives: usize,
}

/// Verification of L2-normalised embeddings (`emb[i]`, rows of equal width) with identities
/// `labels[i]`; `seed` keys the negative pairs of the balanced list.
pub fn verify(emb: &[Vec<f32>], labels: &[usize], seed: u64) -> Verification {
    let n = emb.len();
    let (mut pos, mut neg) = (Vec::new(), Vec::new());
    for i in 0..n {
        for j in i + 1..n {
            let s: f32 = emb[i].iter().zip(&emb[j]).map(|(a, b)| a * b).sum();
            if labels[i] == labels[j] {
                pos.push(s);
            } else {
                neg.push(s);
            }
        }
    }
    let tpr = tpr_at_far(&pos, &neg, 1e-3);
    let mut rng = stream(&[seed, PAIR_KEY]);
    let mut negs = neg.clone();
    shuffle(&mut rng, &mut negs);
    negs.truncate(pos.len());
    let mut pairs: Vec<(f32, bool)> = pos.iter().map(|s| (*s, true)).chain(negs.iter().map(|s| (*s, false))).collect();
    shuffle(&mut rng, &mut pairs);
    Verification { accuracy: kfold_accuracy(&pairs, 10), tpr_at_far_1e3: tpr, positives: pos.len(), negatives: neg.len() }
}

/// The fraction of `pos` above the threshold that at most `far` of `neg` pass (score >
/// threshold accepts).
pub fn tpr_at_far(pos: &[f32], neg: &[f32], far: f64) -> f64 {
    if pos.is_empty() || neg.is_empty() {
        return f64::NAN;
    }
    let mut neg = neg.to_vec();
    neg.sort_by(|a, b| b.total_cmp(a));
    let allowed = (far * neg.len() as f64).floor() as usize;
    let threshold = neg[allowed.min(neg.len() - 1)];
    pos.iter().filter(|s| **s > threshold).count() as f64 / pos.len() as f64
}

/// The threshold with the highest accuracy on `pairs` (accept when score > threshold), midway
/// between the two scores where the accuracy is reached.
pub fn best_threshold(pairs: &[(f32, bool)]) -> f32 {
    let mut sorted = pairs.to_vec();
    sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
    // Threshold below everything: all accepted; correct = positives.
    let mut correct = sorted.iter().filter(|p| p.1).count() as i64;
    let (mut best, mut best_t) = (correct, sorted.first().map_or(0.0, |p| p.0 - 1.0));
    for k in 0..sorted.len() {
        // Raising the threshold to sorted[k] rejects pair k.
        correct += if sorted[k].1 { -1 } else { 1 };
        let ties = k + 1 < sorted.len() && sorted[k + 1].0 == sorted[k].0;
        if !ties && correct > best {
            best = correct;
            // Midway to the next score: the held-out fold's pairs fall on either side alike.
            best_t = match sorted.get(k + 1) {
                Some(next) => (sorted[k].0 + next.0) / 2.0,
                None => sorted[k].0,
            };
        }
    }
    best_t
}

/// Mean accuracy over `folds` consecutive folds of `pairs`, each at the best threshold of the
/// others.
pub fn kfold_accuracy(pairs: &[(f32, bool)], folds: usize) -> f64 {
    let n = pairs.len();
    if n < folds {
        return f64::NAN;
    }
    let mut total = 0.0;
    for f in 0..folds {
        let (lo, hi) = (f * n / folds, (f + 1) * n / folds);
        let train: Vec<(f32, bool)> = pairs[..lo].iter().chain(&pairs[hi..]).copied().collect();
        let t = best_threshold(&train);
        let hits = pairs[lo..hi].iter().filter(|(s, same)| (*s > t) == *same).count();
        total += hits as f64 / (hi - lo) as f64;
    }
    total / folds as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_threshold_separates_and_tpr_counts_above_the_far_quantile() {
        let pairs = [(0.9, true), (0.8, true), (0.7, false), (0.6, true), (0.2, false), (0.1, false)];
        let t = best_threshold(&pairs);
        // Best: accept 0.9, 0.8, 0.7, 0.6 (5 of 6 right) -> a threshold in [0.2, 0.6).
        assert!((0.2..0.6).contains(&t), "threshold {t}");
        let neg: Vec<f32> = (0..2000).map(|k| k as f32 / 2000.0).collect();
        // FAR 1e-3 of 2000: 2 negatives may pass; the threshold is the third highest, 0.9985.
        assert_eq!(tpr_at_far(&[0.999, 0.9986, 0.5, 0.9984], &neg, 1e-3), 0.5);
    }

    #[test]
    fn separable_embeddings_verify_perfectly_and_random_ones_at_chance() {
        let ids = 12;
        let mut emb = Vec::new();
        let mut labels = Vec::new();
        let noise = allgrad_rng::normals(&mut stream(&[1]), ids * 4 * 16);
        for id in 0..ids {
            for k in 0..4 {
                let v: Vec<f32> =
                    (0..16).map(|d| f32::from(u8::from(d == id)) + 0.05 * noise[(id * 4 + k) * 16 + d] as f32).collect();
                let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
                emb.push(v.iter().map(|x| x / norm).collect::<Vec<f32>>());
                labels.push(id);
            }
        }
        let good = verify(&emb, &labels, 0);
        assert_eq!((good.positives, good.negatives), (ids * 6, 48 * 47 / 2 - ids * 6));
        assert_eq!((good.accuracy, good.tpr_at_far_1e3), (1.0, 1.0));
        let shuffled: Vec<usize> = (0..labels.len()).map(|i| (i * 7) % ids).collect();
        let bad = verify(&emb, &shuffled, 0);
        assert!(bad.accuracy < 0.7, "accuracy with labels unrelated to the embeddings: {}", bad.accuracy);
    }
}
