//! One collective call as the algorithms see it ([`Call`]: its op, reduction, sequence number
//! and the digest of what must agree across ranks, and the header its frames carry), and how
//! a call's elements split over the ranks ([`split_even`], [`ranges`]). Every algorithm family
//! shares them: the direct and ring paths (`collectives`), the binomial tree (`tree`) and
//! shared memory (`shm`).

use std::ops::Range;

use crate::cpu::mesh::OpCode;
use crate::reduce::{dtype_code, Elem, ReduceOp};
use crate::wire::{Header, KIND_DATA};

/// Per-call state the algorithms need besides the mesh.
pub(crate) struct Call<'a> {
    pub op: OpCode,
    pub redop: Option<ReduceOp>,
    pub seq: u64,
    /// Digest of whatever must agree across ranks (shape, root, splits...).
    pub meta: u64,
    /// This rank's call, for error messages.
    pub what: &'a str,
}

impl Call<'_> {
    pub(crate) fn header<T: Elem>(&self, step: u32, bytes: usize) -> Header {
        Header {
            kind: KIND_DATA,
            op: self.op as u8,
            dtype: dtype_code(T::DTYPE),
            redop: self.redop.map(|r| r.code()).unwrap_or(0),
            seq: self.seq,
            step,
            len: bytes as u64,
            meta: self.meta,
        }
    }
}

/// Splits `n` elements into `w` near-equal consecutive ranges (the first `n % w` one longer).
pub(crate) fn split_even(n: usize, w: usize) -> Vec<Range<usize>> {
    let (base, extra) = (n / w, n % w);
    let mut start = 0;
    (0..w)
        .map(|i| {
            let len = base + usize::from(i < extra);
            let r = start..start + len;
            start += len;
            r
        })
        .collect()
}

/// Consecutive ranges of the given lengths.
pub(crate) fn ranges(counts: &[usize]) -> Vec<Range<usize>> {
    let mut start = 0;
    counts
        .iter()
        .map(|c| {
            let r = start..start + c;
            start += c;
            r
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_split_covers_everything() {
        for n in [0, 1, 5, 7, 64] {
            for w in 1..=4 {
                let s = split_even(n, w);
                assert_eq!(s.len(), w);
                assert_eq!(s.iter().map(|r| r.len()).sum::<usize>(), n);
                assert!(s.windows(2).all(|p| p[0].end == p[1].start));
                let (lo, hi) = (s.iter().map(|r| r.len()).min().unwrap(), s.iter().map(|r| r.len()).max().unwrap());
                assert!(hi - lo <= 1);
            }
        }
    }
}
