//! Binomial-tree algorithms for large groups (at least ALLGRAD_TREE_FROM ranks, default
//! [`DEFAULT_TREE_FROM`](crate::settings::DEFAULT_TREE_FROM)): the check that every rank makes the same call (the header exchange of the
//! shared-memory and NCCL paths, and the barrier), and all_reduce, all_gather,
//! reduce_scatter, broadcast and reduce of small messages.
//!
//! The full-mesh versions in `collectives` send every peer a frame: W - 1 frames out and
//! W - 1 in per rank and call, W(W - 1) in all, 1,047,552 per call at W = 1,024. Through the
//! tree a rank sends and receives at most 2 ceil(log2(W)) frames (its parent and its children,
//! up and down), 2(W - 1) are sent in all, in 2 log2(W) rounds instead of one; the round count
//! costs latency on small groups, which keep the full mesh.
//!
//! The tree is rooted at group rank 0: rank r's parent is r without its lowest set bit, its
//! children are r + 1, r + 2, r + 4, ... below that bit and below W, so the subtree of rank r
//! is the consecutive ranks r .. r + lowbit(r). Values go up, each rank combining its own
//! with its children's subtrees in rank order (so a reduction is over ranks 0..W-1 in order,
//! with an association fixed by W), and the root's result comes down: every rank ends with
//! the root's bits.
//!
//! Every frame carries its call's header, checked by its receiver as on every path. Ranks
//! whose calls differ fail with [`DistError::Mismatch`] at the first tree edge between them,
//! naming both calls and both ranks; the rank that found it aborts the group, and every other
//! rank fails with its message, passed on in the ABORT frames of the ranks that failed before
//! it (at most 2 log2(W) hops). No rank returns from a call before every rank has sent its
//! header up the tree, so a check is also a barrier, and data moved elsewhere afterwards
//! (shared memory, NCCL) never moves on mismatched calls.

use std::ops::Range;

use crate::cpu::call::{ranges, Call};
use crate::cpu::mesh::{Mesh, RecvOp, SendOp};
#[allow(unused_imports)] // named in the rustdoc above
use crate::error::DistError;
use crate::error::DistResult;
use crate::reduce::{Elem, ReduceOp};
use crate::wire::Header;

/// The tree all_reduce takes messages up to this many bytes per rank of the group (4 MiB at
/// W = 1,024); larger ones take the ring, whose 2(W - 1) steps are then long enough to pay
/// for their latency.
const TREE_BYTES_PER_RANK: usize = 4 << 10;

/// The lowest set bit of `r` (`r` > 0).
fn lowbit(r: usize) -> usize {
    r & r.wrapping_neg()
}

/// The ranks of the subtree of `r` in a tree of `w` ranks.
fn subtree(r: usize, w: usize) -> Range<usize> {
    if r == 0 {
        0..w
    } else {
        r..(r + lowbit(r)).min(w)
    }
}

/// Rank `r`'s parent (none for the root) and children, in increasing order.
pub(crate) fn tree_links(r: usize, w: usize) -> (Option<usize>, Vec<usize>) {
    let parent = (r != 0).then(|| r - lowbit(r));
    let below = if r == 0 { usize::MAX } else { lowbit(r) };
    let mut kids = Vec::new();
    let mut d = 1usize;
    while d < below && r + d < w {
        kids.push(r + d);
        d <<= 1;
    }
    (parent, kids)
}

fn bytes<T: Elem>(x: &[T]) -> &[u8] {
    bytemuck::cast_slice(x)
}
fn bytes_mut<T: Elem>(x: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(x)
}

impl Mesh {
    /// Whether this group checks calls and runs small collectives through the tree.
    pub(crate) fn uses_tree(&self) -> bool {
        self.size() >= self.tree_from.max(2)
    }

    /// Whether an all_reduce of `bytes` bytes (`n` elements) takes the tree.
    pub(crate) fn tree_all_reduce_fits(&self, bytes: usize, n: usize) -> bool {
        self.uses_tree() && (bytes <= TREE_BYTES_PER_RANK * self.size() || n < self.size())
    }

    /// Checks header `h` (without payload) against the parent's and the children's: up the
    /// tree, then down. Every rank returns only once every rank has sent.
    pub(crate) fn tree_agree(&mut self, h: Header, what: &str) -> DistResult<()> {
        let (parent, kids) = tree_links(self.rank, self.size());
        let mut recvs: Vec<RecvOp> = kids.iter().map(|&k| RecvOp { peer: k, expect: h, data: &mut [], acc: None }).collect();
        self.exchange(&mut [], &mut recvs, what)?;
        if let Some(p) = parent {
            let mut sends = [SendOp { peer: p, header: h, data: &[] }];
            let mut recvs = [RecvOp { peer: p, expect: h, data: &mut [], acc: None }];
            self.exchange(&mut sends, &mut recvs, what)?;
        }
        let mut sends: Vec<SendOp> = kids.iter().map(|&k| SendOp { peer: k, header: h, data: &[] }).collect();
        self.exchange(&mut sends, &mut [], what)
    }

    /// Sends header `h` (without payload) to the parent once every child's has come and
    /// matched: the first half of [`Mesh::tree_agree`], which no rank waits through. Bruck's
    /// all_to_all starts with it: every call of a tree group starts by hearing from its
    /// children, so a call that starts otherwise (Bruck's first round hears from rank r - 1)
    /// could wait on a rank that waits on it when the ranks' calls differ; after this step
    /// they fail at the first tree edge between the calls, naming both.
    pub(crate) fn tree_up(&mut self, h: Header, what: &str) -> DistResult<()> {
        let (parent, kids) = tree_links(self.rank, self.size());
        let mut recvs: Vec<RecvOp> = kids.iter().map(|&k| RecvOp { peer: k, expect: h, data: &mut [], acc: None }).collect();
        let mut sends: Vec<SendOp> = parent.iter().map(|&p| SendOp { peer: p, header: h, data: &[] }).collect();
        // The children first: a rank sends up only what its whole subtree agreed on.
        self.exchange(&mut [], &mut recvs, what)?;
        self.exchange(&mut sends, &mut [], what)
    }

    /// In-place all_reduce through the tree: the subtrees' partial results go up and are
    /// combined in rank order, the root's result comes down.
    pub(crate) fn tree_all_reduce<T: Elem>(&mut self, c: &Call, op: ReduceOp, buf: &mut [T]) -> DistResult<()> {
        let (w, n) = (self.size(), buf.len());
        let esz = T::DTYPE.size_in_bytes();
        let (parent, kids) = tree_links(self.rank, w);
        let mut raw = self.take_scratch(kids.len() * n * esz);
        let parts = &mut bytemuck::cast_slice_mut::<u64, T>(&mut raw)[..kids.len() * n];
        let mut recvs = Vec::with_capacity(kids.len());
        let mut rest = &mut parts[..];
        for &k in &kids {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(n);
            recvs.push(RecvOp { peer: k, expect: c.header::<T>(0, n * esz), data: bytes_mut(head), acc: None });
            rest = tail;
        }
        self.exchange(&mut [], &mut recvs, c.what)?;
        drop(recvs);
        // Own value first, then the children's subtrees in rank order.
        for i in 0..kids.len() {
            T::combine(op, buf, &parts[i * n..(i + 1) * n]);
        }
        self.put_scratch(raw);
        match parent {
            Some(p) => {
                let mut sends = [SendOp { peer: p, header: c.header::<T>(0, n * esz), data: bytes(buf) }];
                self.exchange(&mut sends, &mut [], c.what)?;
                let mut recvs = [RecvOp { peer: p, expect: c.header::<T>(1, n * esz), data: bytes_mut(buf), acc: None }];
                self.exchange(&mut [], &mut recvs, c.what)?;
            }
            None if op == ReduceOp::Avg => T::divide(buf, w),
            None => {}
        }
        let mut sends: Vec<SendOp> =
            kids.iter().map(|&k| SendOp { peer: k, header: c.header::<T>(1, n * esz), data: bytes(buf) }).collect();
        self.exchange(&mut sends, &mut [], c.what)
    }

    /// Copies `root`'s `buf` to every rank down a binomial tree rooted at `root` (ranks
    /// renumbered from the root): log2(W) rounds, at most log2(W) frames out per rank where
    /// the direct path has the root send W - 1.
    pub(crate) fn tree_broadcast<T: Elem>(&mut self, c: &Call, buf: &mut [T], root: usize) -> DistResult<()> {
        let w = self.size();
        let h = c.header::<T>(0, std::mem::size_of_val(buf));
        let (parent, kids) = tree_links((self.rank + w - root) % w, w);
        let from_root = |x: usize| (x + root) % w;
        if let Some(p) = parent {
            let mut recvs = [RecvOp { peer: from_root(p), expect: h, data: bytes_mut(buf), acc: None }];
            self.exchange(&mut [], &mut recvs, c.what)?;
        }
        let mut sends: Vec<SendOp> = kids.iter().map(|&k| SendOp { peer: from_root(k), header: h, data: bytes(buf) }).collect();
        self.exchange(&mut sends, &mut [], c.what)
    }

    /// Reduces every rank's `buf` into `root`'s up the tree of [`Mesh::tree_all_reduce`]
    /// (rooted at rank 0, so the association is the same and a reduce gives the all_reduce's
    /// bits), then rank 0 hands the result to `root` when that is another rank. Other ranks'
    /// buffers are left unchanged.
    pub(crate) fn tree_reduce<T: Elem>(&mut self, c: &Call, op: ReduceOp, buf: &mut [T], root: usize) -> DistResult<()> {
        let (w, r, n) = (self.size(), self.rank, buf.len());
        let esz = T::DTYPE.size_in_bytes();
        let (parent, kids) = tree_links(r, w);
        // This rank's subtree's value, then one block per child.
        let mut raw = self.take_scratch((kids.len() + 1) * n * esz);
        let all = &mut bytemuck::cast_slice_mut::<u64, T>(&mut raw)[..(kids.len() + 1) * n];
        let (own, parts) = all.split_at_mut(n);
        {
            let mut recvs = Vec::with_capacity(kids.len());
            let mut rest = &mut parts[..];
            for &k in &kids {
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(n);
                recvs.push(RecvOp { peer: k, expect: c.header::<T>(0, n * esz), data: bytes_mut(head), acc: None });
                rest = tail;
            }
            self.exchange(&mut [], &mut recvs, c.what)?;
        }
        // The root accumulates in place; every other rank in scratch, its buffer untouched.
        let in_place = r == root && r == 0;
        let acc: &mut [T] = if in_place {
            &mut *buf
        } else {
            own.copy_from_slice(buf);
            own
        };
        for i in 0..kids.len() {
            T::combine(op, acc, &parts[i * n..(i + 1) * n]);
        }
        match parent {
            Some(p) => {
                let mut sends = [SendOp { peer: p, header: c.header::<T>(0, n * esz), data: bytes(acc) }];
                self.exchange(&mut sends, &mut [], c.what)?;
            }
            None => {
                if op == ReduceOp::Avg {
                    T::divide(acc, w);
                }
                if root != 0 {
                    let mut sends = [SendOp { peer: root, header: c.header::<T>(1, n * esz), data: bytes(acc) }];
                    self.exchange(&mut sends, &mut [], c.what)?;
                }
            }
        }
        self.put_scratch(raw);
        if r == root && r != 0 {
            let mut recvs = [RecvOp { peer: 0, expect: c.header::<T>(1, n * esz), data: bytes_mut(buf), acc: None }];
            self.exchange(&mut [], &mut recvs, c.what)?;
        }
        Ok(())
    }

    /// Gathers every rank's block (`counts` elements each, this rank's already in place in
    /// `out`) through the tree: each subtree's consecutive blocks go up, the whole result
    /// comes down. Frames use steps `2 step0` (up) and `2 step0 + 1` (down).
    pub(crate) fn tree_all_gather_v<T: Elem>(&mut self, c: &Call, counts: &[usize], step0: u32, out: &mut [T]) -> DistResult<()> {
        let (w, r) = (self.size(), self.rank);
        let esz = T::DTYPE.size_in_bytes();
        let blocks = ranges(counts);
        // Elements of the subtree of rank s.
        let span = |s: usize| {
            let t = subtree(s, w);
            blocks[t.start].start..blocks[t.end - 1].end
        };
        let (parent, kids) = tree_links(r, w);
        let (up, down) = (2 * step0, 2 * step0 + 1);
        {
            // The children's spans tile what follows this rank's block, in order.
            let mut rest = &mut out[blocks[r].end..];
            let mut recvs = Vec::with_capacity(kids.len());
            for &k in &kids {
                let len = span(k).len();
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(len);
                recvs.push(RecvOp { peer: k, expect: c.header::<T>(up, len * esz), data: bytes_mut(head), acc: None });
                rest = tail;
            }
            self.exchange(&mut [], &mut recvs, c.what)?;
        }
        if let Some(p) = parent {
            let mine = &out[span(r)];
            let mut sends = [SendOp { peer: p, header: c.header::<T>(up, std::mem::size_of_val(mine)), data: bytes(mine) }];
            self.exchange(&mut sends, &mut [], c.what)?;
            let mut recvs = [RecvOp { peer: p, expect: c.header::<T>(down, out.len() * esz), data: bytes_mut(out), acc: None }];
            self.exchange(&mut [], &mut recvs, c.what)?;
        }
        let mut sends: Vec<SendOp> =
            kids.iter().map(|&k| SendOp { peer: k, header: c.header::<T>(down, out.len() * esz), data: bytes(out) }).collect();
        self.exchange(&mut sends, &mut [], c.what)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_but_the_root_has_one_parent_and_subtrees_tile_the_group() {
        for w in 1..=70 {
            let mut seen_as_child = vec![0; w];
            for r in 0..w {
                let (parent, kids) = tree_links(r, w);
                assert_eq!(parent.is_none(), r == 0);
                if let Some(p) = parent {
                    assert!(tree_links(p, w).1.contains(&r), "w {w}: {r} is not a child of its parent {p}");
                }
                // This rank, then its children's subtrees, consecutively, cover its subtree.
                let mut next = r + 1;
                for &k in &kids {
                    seen_as_child[k] += 1;
                    assert_eq!(subtree(k, w).start, next, "w {w} r {r}");
                    next = subtree(k, w).end;
                }
                assert_eq!(next, subtree(r, w).end, "w {w} r {r}");
                assert!(kids.len() <= (usize::BITS - w.leading_zeros()) as usize);
            }
            assert_eq!(seen_as_child[0], 0);
            assert!(seen_as_child[1..].iter().all(|c| *c == 1), "w {w}");
        }
    }
}
