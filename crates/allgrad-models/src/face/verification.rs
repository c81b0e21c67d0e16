//! Open-set verification, as face benchmarks do it: pairs of images of the same or of
//! different identities (identities never seen in training), scored by the cosine of their
//! embeddings.
//!
//! - 10-fold accuracy at the best threshold (the LFW protocol): a balanced pair list (every
//!   positive pair and as many negative pairs, drawn by a keyed stream) in 10 folds; for each
//!   fold the threshold that is best on the other nine is applied to it; the mean accuracy.
//! - TPR at FAR 1e-3 (the IJB style): over ALL pairs, the threshold that at most a fraction
//!   1e-3 of the negative pairs pass, and the fraction of positive pairs above it.
//!
//! And the benchmarks' own pairs (the `.bin` files of LFW, CFP-FP, AgeDB-30, ...) scored as
//! insightface's `verification.py` scores them ([`insightface_accuracy`]): the embeddings of
//! each image and of its mirror image added and L2-normalised ([`flip_sum_normalised`]), the
//! squared distance of each pair, thresholds 0, 0.01, ..., 3.99 (a pair is "same" when its
//! distance is below), 10 folds of consecutive pairs in file order (scikit-learn's `KFold`
//! without shuffling: the first `n % 10` folds one pair longer), each fold scored at the
//! threshold (the first, in grid order, of the best) of the other nine; the mean and the
//! population standard deviation of the ten accuracies.

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

/// Each image's embedding plus its mirror image's, L2-normalised, in f64 (insightface adds the
/// two network outputs in f64 and normalises with scikit-learn's `normalize`, which leaves a
/// zero row as it is).
pub fn flip_sum_normalised(plain: &[Vec<f32>], flipped: &[Vec<f32>]) -> Vec<Vec<f64>> {
    plain
        .iter()
        .zip(flipped)
        .map(|(a, b)| {
            let v: Vec<f64> = a.iter().zip(b).map(|(x, y)| f64::from(*x) + f64::from(*y)).collect();
            let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
            let norm = if norm == 0.0 { 1.0 } else { norm };
            v.into_iter().map(|x| x / norm).collect()
        })
        .collect()
}

/// The figures of a verification `.bin` under insightface's protocol.
#[derive(Clone, Debug, PartialEq)]
pub struct BinAccuracy {
    /// Mean accuracy over the folds.
    pub accuracy: f64,
    /// Population standard deviation of the folds' accuracies (NumPy's `np.std`).
    pub std: f64,
    /// Each fold's accuracy.
    pub folds: Vec<f64>,
    /// Each fold's threshold (chosen on the other folds).
    pub thresholds: Vec<f64>,
}

/// insightface's 10-fold accuracy (see the module docs) of embeddings `emb` (two rows per pair,
/// pair `i` rows `2i` and `2i + 1`) with `issame[i]` whether pair `i` matches. Needs at least
/// `folds` pairs (`NaN` figures otherwise).
pub fn insightface_accuracy(emb: &[Vec<f64>], issame: &[bool], folds: usize) -> BinAccuracy {
    let n = issame.len().min(emb.len() / 2);
    let dist: Vec<f64> = (0..n).map(|i| emb[2 * i].iter().zip(&emb[2 * i + 1]).map(|(a, b)| (a - b) * (a - b)).sum()).collect();
    let thresholds: Vec<f64> = (0..400).map(|k| k as f64 * 0.01).collect();
    if n < folds || folds < 2 {
        return BinAccuracy { accuracy: f64::NAN, std: f64::NAN, folds: Vec::new(), thresholds: Vec::new() };
    }
    let accuracy = |t: f64, pairs: &mut dyn Iterator<Item = usize>| {
        let (mut right, mut count) = (0usize, 0usize);
        for i in pairs {
            right += usize::from((dist[i] < t) == issame[i]);
            count += 1;
        }
        right as f64 / count as f64
    };
    // scikit-learn's KFold: fold f holds n / folds pairs, one more for the first n % folds.
    let mut bounds = vec![0usize];
    for f in 0..folds {
        bounds.push(bounds[f] + n / folds + usize::from(f < n % folds));
    }
    let (mut accs, mut chosen) = (Vec::with_capacity(folds), Vec::with_capacity(folds));
    for f in 0..folds {
        let (lo, hi) = (bounds[f], bounds[f + 1]);
        let mut best = (f64::NEG_INFINITY, 0.0);
        for &t in &thresholds {
            let a = accuracy(t, &mut (0..lo).chain(hi..n));
            if a > best.0 {
                best = (a, t);
            }
        }
        accs.push(accuracy(best.1, &mut (lo..hi)));
        chosen.push(best.1);
    }
    let mean = numpy_sum(&accs) / folds as f64;
    let squares: Vec<f64> = accs.iter().map(|a| (a - mean) * (a - mean)).collect();
    let std = (numpy_sum(&squares) / folds as f64).sqrt();
    BinAccuracy { accuracy: mean, std, folds: accs, thresholds: chosen }
}

/// A sum in NumPy's order (its pairwise summation of a contiguous f64 array: eight running
/// sums combined as a tree, the remainder added after; halves above 128 values), so that the
/// mean and standard deviation are NumPy's to the last bit, not only to the printed digits.
/// Hand-written: no crate sums in NumPy's order.
fn numpy_sum(a: &[f64]) -> f64 {
    fn pairwise(a: &[f64]) -> f64 {
        let n = a.len();
        if n < 8 {
            a.iter().fold(0.0, |s, x| s + x)
        } else if n <= 128 {
            let mut r = [0.0; 8];
            r.copy_from_slice(&a[..8]);
            let whole = n - n % 8;
            for i in (8..whole).step_by(8) {
                for (acc, x) in r.iter_mut().zip(&a[i..i + 8]) {
                    *acc += x;
                }
            }
            let mut res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
            for x in &a[whole..] {
                res += x;
            }
            res
        } else {
            let half = n / 2;
            let half = half - half % 8;
            pairwise(&a[..half]) + pairwise(&a[half..])
        }
    }
    0.0 + pairwise(a)
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
