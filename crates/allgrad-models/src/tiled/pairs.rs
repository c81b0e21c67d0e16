//! Which key columns are special for each query row: its positive, a column left out, a column
//! with a constant added.

use std::ops::Range;

use candle_core::Result;

use crate::error::fail;
use crate::ModelError;

/// The special columns of each query row of a tiled cross-entropy (`[m]` rows against `[n]`
/// key columns). Everything not named here is an ordinary negative.
///
/// Row `i`'s loss is `logsumexp_{j allowed} s_ij − s_{i, target_i}`: the allowed columns are all
/// but `exclude_i`; `boost_i` has `boost` added to its logit (in the softmax and, when it is
/// the target, in the positive's logit too).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Pairs {
    /// Per row, the column of its positive (the cross-entropy target). `None`: no positive
    /// term, the row's loss is its log-sum-exp alone (a uniformity or log-partition term).
    pub target: Option<Vec<usize>>,
    /// Per row, a column left out of its softmax (NT-Xent: the anchor's own embedding).
    pub exclude: Option<Vec<usize>>,
    /// Per row, a column whose logit gets `boost` added (supervised SimCSE: the anchor's own
    /// hard negative).
    pub boost: Option<(Vec<usize>, f64)>,
}

impl Pairs {
    /// Checks every list against `m` rows and `n` columns: lengths, columns in range, no
    /// target that is also excluded, a finite boost.
    pub fn check(&self, m: usize, n: usize) -> Result<()> {
        let bad = |what: String| fail(ModelError::TiledInput(what));
        let lists =
            [("target", self.target.as_ref()), ("exclude", self.exclude.as_ref()), ("boost", self.boost.as_ref().map(|b| &b.0))];
        for (name, list) in lists {
            let Some(list) = list else { continue };
            if list.len() != m {
                return bad(format!("pairs.{name} has {} entries for {m} query rows", list.len()));
            }
            if let Some((row, col)) = list.iter().enumerate().find(|(_, c)| **c >= n) {
                return bad(format!("pairs.{name}[{row}] = {col} is not a column of the {n} keys"));
            }
        }
        if let (Some(t), Some(x)) = (&self.target, &self.exclude) {
            if let Some(row) = (0..m).find(|&i| t[i] == x[i]) {
                return bad(format!("row {row}'s target column {} is also its excluded column", t[row]));
            }
        }
        if let Some((_, w)) = &self.boost {
            if !w.is_finite() {
                return bad(format!("pairs.boost weight must be finite, got {w}"));
            }
        }
        Ok(())
    }

    /// Row `row`'s target column when it lies in `cols`, as an offset into them.
    #[inline]
    pub(crate) fn target_in(&self, row: usize, cols: &Range<usize>) -> Option<usize> {
        in_range(self.target.as_ref()?[row], cols)
    }

    /// Row `row`'s excluded column when it lies in `cols`, as an offset into them.
    #[inline]
    pub(crate) fn exclude_in(&self, row: usize, cols: &Range<usize>) -> Option<usize> {
        in_range(self.exclude.as_ref()?[row], cols)
    }

    /// Row `row`'s boosted column when it lies in `cols` (offset), and the boost.
    #[inline]
    pub(crate) fn boost_in(&self, row: usize, cols: &Range<usize>) -> Option<(usize, f64)> {
        let (list, w) = self.boost.as_ref()?;
        in_range(list[row], cols).map(|c| (c, *w))
    }
}

#[inline]
fn in_range(col: usize, cols: &Range<usize>) -> Option<usize> {
    cols.contains(&col).then(|| col - cols.start)
}

/// The blocks of `0..n` of `tile` elements each, the last one shorter when `tile` does not
/// divide `n`.
pub(crate) fn blocks(n: usize, tile: usize) -> Vec<Range<usize>> {
    let tile = tile.max(1);
    (0..n).step_by(tile).map(|s| s..(s + tile).min(n)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cover_the_range_with_a_shorter_last_one() {
        assert_eq!(blocks(7, 3), vec![0..3, 3..6, 6..7]);
        assert_eq!(blocks(2, 5), vec![0..2]);
        assert_eq!(blocks(0, 5), Vec::<Range<usize>>::new());
    }

    #[test]
    fn bad_pairs_are_refused_naming_the_list_row_and_numbers() {
        let p = Pairs { target: Some(vec![1, 5]), ..Default::default() };
        let e = p.check(2, 4).unwrap_err().to_string();
        assert!(e.contains("pairs.target[1] = 5") && e.contains("4 keys"), "{e}");
        let p = Pairs { exclude: Some(vec![0]), ..Default::default() };
        assert!(p.check(2, 4).unwrap_err().to_string().contains("pairs.exclude has 1 entries for 2 query rows"));
        let p = Pairs { target: Some(vec![1, 2]), exclude: Some(vec![0, 2]), ..Default::default() };
        assert!(p.check(2, 4).unwrap_err().to_string().contains("row 1's target column 2 is also its excluded column"));
        let p = Pairs { boost: Some((vec![1, 2], f64::NAN)), ..Default::default() };
        assert!(p.check(2, 4).unwrap_err().to_string().contains("finite"));
    }
}
