//! Collective algorithms over a [`Mesh`], on typed buffers.
//!
//! Small messages take a latency-optimal direct path (one round: everyone sends to everyone
//! who needs it, then each rank reduces in rank order 0..W). Large ones take bandwidth-optimal
//! rings: all_reduce = reduce-scatter + all-gather around the ring, each chunk reduced once
//! along a fixed chain and then copied; broadcast = a segmented, pipelined chain. Either way
//! every rank ends with bitwise-identical results.

use std::ops::Range;

use crate::error::{DistError, DistResult};
use crate::mesh::{Mesh, OpCode, RecvOp, SendOp};
use crate::reduce::{dtype_code, Elem, ReduceOp};
use crate::wire::{Header, KIND_DATA};

/// Messages up to this many bytes (times the number of peers) take the direct path.
const DIRECT_BYTES: usize = 256 << 10;
/// Segment size of the pipelined broadcast chain.
const SEGMENT_BYTES: usize = 1 << 20;

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
    fn header<T: Elem>(&self, step: u32, bytes: usize) -> Header {
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

fn bytes<T: Elem>(x: &[T]) -> &[u8] {
    bytemuck::cast_slice(x)
}
fn bytes_mut<T: Elem>(x: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(x)
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

/// Borrows `a` shared and `b` exclusively from one buffer; the ranges must not overlap.
fn split2<T>(buf: &mut [T], a: Range<usize>, b: Range<usize>) -> (&[T], &mut [T]) {
    debug_assert!(a.end <= b.start || b.end <= a.start);
    if a.start < b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.end - a.start], &mut lo[b])
    }
}

impl Mesh {
    fn right(&self) -> usize {
        (self.rank + 1) % self.size()
    }
    fn left(&self) -> usize {
        (self.rank + self.size() - 1) % self.size()
    }
    fn modw(&self, x: isize) -> usize {
        x.rem_euclid(self.size() as isize) as usize
    }

    /// Reduces in rank order: `out = x_0 op x_1 op ... op x_{W-1}`, where `own` is this
    /// rank's contribution and `others` holds the peers' in rank order (skipping this rank).
    fn combine_in_rank_order<T: Elem>(&self, op: ReduceOp, own: &[T], others: &[T], out: &mut [T]) {
        let n = own.len();
        let part = |j: usize| -> &[T] {
            match j.cmp(&self.rank) {
                std::cmp::Ordering::Equal => own,
                std::cmp::Ordering::Less => &others[j * n..(j + 1) * n],
                std::cmp::Ordering::Greater => &others[(j - 1) * n..j * n],
            }
        };
        out.copy_from_slice(part(0));
        for j in 1..self.size() {
            T::combine(op, out, part(j));
        }
        if op == ReduceOp::Avg {
            T::divide(out, self.size());
        }
    }

    /// Every rank sends `own` to every peer and receives each peer's `n` elements; returns
    /// the peers' data in rank order (this rank skipped).
    fn direct_all_to_all_same<T: Elem>(&mut self, c: &Call, step: u32, own: &[T]) -> DistResult<Vec<T>> {
        let (w, r, n) = (self.size(), self.rank, own.len());
        let mut others = vec![T::zeroed(); n * (w - 1)];
        let mut sends: Vec<SendOp> = (0..w)
            .filter(|p| *p != r)
            .map(|p| SendOp { peer: p, header: c.header::<T>(step, n * T::DTYPE.size_in_bytes()), data: bytes(own) })
            .collect();
        let peers: Vec<usize> = (0..w).filter(|p| *p != r).collect();
        let mut recvs: Vec<RecvOp> = others
            .chunks_mut(n.max(1))
            .take(w - 1)
            .zip(&peers)
            .map(|(chunk, p)| RecvOp {
                peer: *p,
                expect: c.header::<T>(step, chunk.len().min(n) * T::DTYPE.size_in_bytes()),
                data: if n == 0 { &mut [] } else { bytes_mut(chunk) },
                acc: None,
            })
            .collect();
        if n == 0 {
            // chunks_mut(1) over an empty buffer yields nothing: build the empty receives.
            recvs = peers.iter().map(|p| RecvOp { peer: *p, expect: c.header::<T>(step, 0), data: &mut [], acc: None }).collect();
        }
        self.exchange(&mut sends, &mut recvs, c.what)?;
        Ok(others)
    }

    /// One ring pass of reduce-scatter over `chunks` of `buf`: at step `s` rank r sends chunk
    /// `r + shift - s` to the right and combines chunk `r + shift - s - 1` from the left. Rank r
    /// ends owning the full reduction of chunk `r + shift + 1`. Steps are numbered from `step0`.
    fn ring_reduce_scatter<T: Elem>(
        &mut self,
        c: &Call,
        op: ReduceOp,
        buf: &mut [T],
        chunks: &[Range<usize>],
        shift: isize,
        step0: u32,
    ) -> DistResult<()> {
        let w = self.size() as isize;
        let r = self.rank as isize;
        let max = chunks.iter().map(|c| c.len()).max().unwrap_or(0);
        let mut scratch = vec![T::zeroed(); max];
        let combine = move |acc: &mut [u8], x: &[u8]| T::combine(op, bytemuck::cast_slice_mut(acc), bytemuck::cast_slice(x));
        let esz = T::DTYPE.size_in_bytes();
        for s in 0..(w - 1) {
            let send_i = self.modw(r + shift - s);
            let recv_i = self.modw(r + shift - s - 1);
            let (send, acc) = split2(buf, chunks[send_i].clone(), chunks[recv_i].clone());
            let step = step0 + s as u32;
            let rlen = acc.len();
            let mut sends = [SendOp { peer: self.right(), header: c.header::<T>(step, send.len() * esz), data: bytes(send) }];
            let mut recvs = [RecvOp {
                peer: self.left(),
                expect: c.header::<T>(step, rlen * esz),
                data: bytes_mut(&mut scratch[..rlen]),
                acc: Some((bytes_mut(acc), &combine, esz)),
            }];
            self.exchange(&mut sends, &mut recvs, c.what)?;
        }
        Ok(())
    }

    /// One ring pass of all-gather: rank r starts owning chunk `r + offset`; at step `s` it
    /// sends chunk `r + offset - s` right and receives chunk `r + offset - s - 1` from the left.
    fn ring_all_gather<T: Elem>(
        &mut self,
        c: &Call,
        buf: &mut [T],
        chunks: &[Range<usize>],
        offset: isize,
        step0: u32,
    ) -> DistResult<()> {
        let w = self.size() as isize;
        let r = self.rank as isize;
        let esz = T::DTYPE.size_in_bytes();
        for s in 0..(w - 1) {
            let send_i = self.modw(r + offset - s);
            let recv_i = self.modw(r + offset - s - 1);
            let (send, recv) = split2(buf, chunks[send_i].clone(), chunks[recv_i].clone());
            let step = step0 + s as u32;
            let mut sends = [SendOp { peer: self.right(), header: c.header::<T>(step, send.len() * esz), data: bytes(send) }];
            let mut recvs =
                [RecvOp { peer: self.left(), expect: c.header::<T>(step, recv.len() * esz), data: bytes_mut(recv), acc: None }];
            self.exchange(&mut sends, &mut recvs, c.what)?;
        }
        Ok(())
    }

    /// In-place all_reduce.
    pub(crate) fn all_reduce<T: Elem>(&mut self, c: &Call, op: ReduceOp, buf: &mut [T]) -> DistResult<()> {
        let w = self.size();
        if w == 1 {
            return Ok(());
        }
        let nbytes = std::mem::size_of_val(buf);
        if nbytes * (w - 1) <= DIRECT_BYTES || buf.len() < w {
            let own = buf.to_vec();
            let others = self.direct_all_to_all_same(c, 0, &own)?;
            self.combine_in_rank_order(op, &own, &others, buf);
            return Ok(());
        }
        let chunks = split_even(buf.len(), w);
        self.ring_reduce_scatter(c, op, buf, &chunks, 0, 0)?;
        let owned = chunks[(self.rank + 1) % w].clone();
        if op == ReduceOp::Avg {
            T::divide(&mut buf[owned], w);
        }
        self.ring_all_gather(c, buf, &chunks, 1, (w - 1) as u32)
    }

    /// Exchanges one u64 with every peer (`mine[p]` goes to peer p); returns what each peer
    /// sent (this rank's own slot holds `mine[rank]`).
    pub(crate) fn exchange_counts(&mut self, c: &Call, step: u32, mine: &[u64]) -> DistResult<Vec<u64>> {
        let (w, r) = (self.size(), self.rank);
        let mut got = vec![0u64; w];
        got[r] = mine[r];
        let words: Vec<[u64; 1]> = mine.iter().map(|m| [*m]).collect();
        let header = |step| Header { dtype: 0, redop: 0, ..c.header::<u8>(step, 8) };
        let mut sends: Vec<SendOp> = (0..w)
            .filter(|p| *p != r)
            .map(|p| SendOp { peer: p, header: header(step), data: bytemuck::cast_slice(&words[p]) })
            .collect();
        let mut recvs: Vec<RecvOp> = got
            .iter_mut()
            .enumerate()
            .filter(|(p, _)| *p != r)
            .map(|(p, slot)| RecvOp { peer: p, expect: header(step), data: bytemuck::bytes_of_mut(slot), acc: None })
            .collect();
        self.exchange(&mut sends, &mut recvs, c.what)?;
        Ok(got)
    }

    /// Gathers every rank's `own` block (sizes in elements given by `counts`) in rank order.
    pub(crate) fn all_gather_v<T: Elem>(&mut self, c: &Call, own: &[T], counts: &[usize], step0: u32) -> DistResult<Vec<T>> {
        let (w, r) = (self.size(), self.rank);
        let total: usize = counts.iter().sum();
        let blocks = ranges(counts);
        let mut out = vec![T::zeroed(); total];
        out[blocks[r].clone()].copy_from_slice(own);
        if w == 1 {
            return Ok(out);
        }
        let esz = T::DTYPE.size_in_bytes();
        if total * esz <= DIRECT_BYTES {
            let mut sends: Vec<SendOp> = (0..w)
                .filter(|p| *p != r)
                .map(|p| SendOp { peer: p, header: c.header::<T>(step0, own.len() * esz), data: bytes(own) })
                .collect();
            let mut recvs = Vec::with_capacity(w - 1);
            let mut rest: &mut [T] = &mut out;
            let mut consumed = 0;
            for (p, b) in blocks.iter().enumerate() {
                let (_, tail) = rest.split_at_mut(b.start - consumed);
                let (this, tail) = tail.split_at_mut(b.len());
                consumed = b.end;
                rest = tail;
                if p != r {
                    recvs.push(RecvOp { peer: p, expect: c.header::<T>(step0, b.len() * esz), data: bytes_mut(this), acc: None });
                }
            }
            self.exchange(&mut sends, &mut recvs, c.what)?;
            return Ok(out);
        }
        self.ring_all_gather(c, &mut out, &blocks, 0, step0)?;
        Ok(out)
    }

    /// Reduces `input` (blocks of `counts[j]` elements, one per rank) and returns this rank's
    /// reduced block.
    pub(crate) fn reduce_scatter_v<T: Elem>(
        &mut self,
        c: &Call,
        op: ReduceOp,
        input: &[T],
        counts: &[usize],
    ) -> DistResult<Vec<T>> {
        let (w, r) = (self.size(), self.rank);
        let blocks = ranges(counts);
        if w == 1 {
            let mut out = input.to_vec();
            if op == ReduceOp::Avg {
                T::divide(&mut out, 1);
            }
            return Ok(out);
        }
        let esz = T::DTYPE.size_in_bytes();
        let mine = blocks[r].clone();
        if input.len() * esz <= DIRECT_BYTES {
            let n = mine.len();
            let mut others = vec![T::zeroed(); n * (w - 1)];
            let mut sends: Vec<SendOp> = (0..w)
                .filter(|p| *p != r)
                .map(|p| SendOp {
                    peer: p,
                    header: c.header::<T>(0, blocks[p].len() * esz),
                    data: bytes(&input[blocks[p].clone()]),
                })
                .collect();
            let peers: Vec<usize> = (0..w).filter(|p| *p != r).collect();
            let mut recvs: Vec<RecvOp> = if n == 0 {
                peers.iter().map(|p| RecvOp { peer: *p, expect: c.header::<T>(0, 0), data: &mut [], acc: None }).collect()
            } else {
                others
                    .chunks_mut(n)
                    .zip(&peers)
                    .map(|(ch, p)| RecvOp { peer: *p, expect: c.header::<T>(0, n * esz), data: bytes_mut(ch), acc: None })
                    .collect()
            };
            self.exchange(&mut sends, &mut recvs, c.what)?;
            let mut out = vec![T::zeroed(); n];
            self.combine_in_rank_order(op, &input[mine], &others, &mut out);
            return Ok(out);
        }
        let mut work = input.to_vec();
        self.ring_reduce_scatter(c, op, &mut work, &blocks, -1, 0)?;
        let mut out = work[mine].to_vec();
        if op == ReduceOp::Avg {
            T::divide(&mut out, w);
        }
        Ok(out)
    }

    /// Copies `root`'s buffer into every rank's `buf`.
    pub(crate) fn broadcast<T: Elem>(&mut self, c: &Call, buf: &mut [T], root: usize) -> DistResult<()> {
        let (w, r) = (self.size(), self.rank);
        if w == 1 {
            return Ok(());
        }
        let esz = T::DTYPE.size_in_bytes();
        let nbytes = buf.len() * esz;
        if nbytes <= DIRECT_BYTES || w == 2 {
            if r == root {
                let mut sends: Vec<SendOp> = (0..w)
                    .filter(|p| *p != r)
                    .map(|p| SendOp { peer: p, header: c.header::<T>(0, nbytes), data: bytes(buf) })
                    .collect();
                self.exchange(&mut sends, &mut [], c.what)?;
            } else {
                let mut recvs = [RecvOp { peer: root, expect: c.header::<T>(0, nbytes), data: bytes_mut(buf), acc: None }];
                self.exchange(&mut [], &mut recvs, c.what)?;
            }
            return Ok(());
        }
        // Pipelined chain root -> root+1 -> ... -> root-1, one segment per step.
        let pos = (r + w - root) % w;
        let seg = (SEGMENT_BYTES / esz).max(1);
        let segs: Vec<Range<usize>> = (0..buf.len()).step_by(seg).map(|s| s..(s + seg).min(buf.len())).collect();
        let n = segs.len();
        for k in 0..=n {
            let recv_k = (pos > 0 && k < n).then_some(k);
            let send_k = if pos == 0 { (k < n).then_some(k) } else { (pos < w - 1 && k >= 1).then(|| k - 1) };
            match (send_k, recv_k) {
                (None, None) => {}
                (Some(sk), None) => {
                    let d = &buf[segs[sk].clone()];
                    let mut sends =
                        [SendOp { peer: self.right(), header: c.header::<T>(sk as u32, d.len() * esz), data: bytes(d) }];
                    self.exchange(&mut sends, &mut [], c.what)?;
                }
                (None, Some(rk)) => {
                    let d = &mut buf[segs[rk].clone()];
                    let h = c.header::<T>(rk as u32, d.len() * esz);
                    let mut recvs = [RecvOp { peer: self.left(), expect: h, data: bytes_mut(d), acc: None }];
                    self.exchange(&mut [], &mut recvs, c.what)?;
                }
                (Some(sk), Some(rk)) => {
                    let (d_s, d_r) = split2(buf, segs[sk].clone(), segs[rk].clone());
                    let mut sends =
                        [SendOp { peer: self.right(), header: c.header::<T>(sk as u32, d_s.len() * esz), data: bytes(d_s) }];
                    let h = c.header::<T>(rk as u32, d_r.len() * esz);
                    let mut recvs = [RecvOp { peer: self.left(), expect: h, data: bytes_mut(d_r), acc: None }];
                    self.exchange(&mut sends, &mut recvs, c.what)?;
                }
            }
        }
        Ok(())
    }

    /// Reduces every rank's `buf` into `root`'s; other ranks' buffers are left unchanged.
    pub(crate) fn reduce<T: Elem>(&mut self, c: &Call, op: ReduceOp, buf: &mut [T], root: usize) -> DistResult<()> {
        let (w, r) = (self.size(), self.rank);
        if w == 1 {
            return Ok(());
        }
        let esz = T::DTYPE.size_in_bytes();
        let nbytes = buf.len() * esz;
        if nbytes * (w - 1) <= DIRECT_BYTES || buf.len() < w {
            if r == root {
                let n = buf.len();
                let mut others = vec![T::zeroed(); n * (w - 1)];
                let peers: Vec<usize> = (0..w).filter(|p| *p != r).collect();
                let mut recvs: Vec<RecvOp> = if n == 0 {
                    peers.iter().map(|p| RecvOp { peer: *p, expect: c.header::<T>(0, 0), data: &mut [], acc: None }).collect()
                } else {
                    others
                        .chunks_mut(n)
                        .zip(&peers)
                        .map(|(ch, p)| RecvOp { peer: *p, expect: c.header::<T>(0, nbytes), data: bytes_mut(ch), acc: None })
                        .collect()
                };
                self.exchange(&mut [], &mut recvs, c.what)?;
                let own = buf.to_vec();
                self.combine_in_rank_order(op, &own, &others, buf);
            } else {
                let mut sends = [SendOp { peer: root, header: c.header::<T>(0, nbytes), data: bytes(buf) }];
                self.exchange(&mut sends, &mut [], c.what)?;
            }
            return Ok(());
        }
        // Ring reduce-scatter on a copy, then every rank sends the chunk it owns to the root.
        let chunks = split_even(buf.len(), w);
        let mut work = buf.to_vec();
        self.ring_reduce_scatter(c, op, &mut work, &chunks, -1, 0)?;
        if op == ReduceOp::Avg {
            T::divide(&mut work[chunks[r].clone()], w);
        }
        let step = (w - 1) as u32;
        if r == root {
            buf[chunks[r].clone()].copy_from_slice(&work[chunks[r].clone()]);
            let mut recvs = Vec::with_capacity(w - 1);
            let mut rest: &mut [T] = buf;
            let mut consumed = 0;
            for (p, ch) in chunks.iter().enumerate() {
                let (_, tail) = rest.split_at_mut(ch.start - consumed);
                let (this, tail) = tail.split_at_mut(ch.len());
                consumed = ch.end;
                rest = tail;
                if p != r {
                    recvs.push(RecvOp { peer: p, expect: c.header::<T>(step, ch.len() * esz), data: bytes_mut(this), acc: None });
                }
            }
            self.exchange(&mut [], &mut recvs, c.what)?;
        } else {
            let d = &work[chunks[r].clone()];
            let mut sends = [SendOp { peer: root, header: c.header::<T>(step, d.len() * esz), data: bytes(d) }];
            self.exchange(&mut sends, &mut [], c.what)?;
        }
        Ok(())
    }

    /// Sends block j of `input` (`send_counts[j]` elements) to rank j; returns the blocks
    /// received from every rank, in rank order, and their sizes.
    pub(crate) fn all_to_all_v<T: Elem>(
        &mut self,
        c: &Call,
        input: &[T],
        send_counts: &[usize],
        max_bytes: u64,
    ) -> DistResult<(Vec<T>, Vec<usize>)> {
        let (w, r) = (self.size(), self.rank);
        let mine: Vec<u64> = send_counts.iter().map(|x| *x as u64).collect();
        let recv_counts = if w == 1 { mine } else { self.exchange_counts(c, 0, &mine)? };
        let esz = T::DTYPE.size_in_bytes() as u64;
        let total = recv_counts.iter().try_fold(0u64, |a, b| a.checked_add(*b)).and_then(|t| t.checked_mul(esz));
        let recv_counts = match total {
            Some(t) if t <= max_bytes => recv_counts.into_iter().map(|x| x as usize).collect::<Vec<_>>(),
            _ => {
                return Err(self.fail(DistError::Protocol {
                    peer: usize::MAX,
                    group: self.group.clone(),
                    detail: format!(
                        "all_to_all would receive {recv_counts:?} elements of {esz} bytes, over the limit of {max_bytes} bytes \
                         (ALLGRAD_MAX_MESSAGE_BYTES)"
                    ),
                }))
            }
        };
        let in_blocks = ranges(send_counts);
        let out_blocks = ranges(&recv_counts);
        let mut out = vec![T::zeroed(); recv_counts.iter().sum()];
        out[out_blocks[r].clone()].copy_from_slice(&input[in_blocks[r].clone()]);
        if w == 1 {
            return Ok((out, recv_counts));
        }
        let esz = esz as usize;
        let mut sends: Vec<SendOp> = (0..w)
            .filter(|p| *p != r)
            .map(|p| SendOp {
                peer: p,
                header: c.header::<T>(1, in_blocks[p].len() * esz),
                data: bytes(&input[in_blocks[p].clone()]),
            })
            .collect();
        let mut recvs = Vec::with_capacity(w - 1);
        let mut rest: &mut [T] = &mut out;
        let mut consumed = 0;
        for (p, b) in out_blocks.iter().enumerate() {
            let (_, tail) = rest.split_at_mut(b.start - consumed);
            let (this, tail) = tail.split_at_mut(b.len());
            consumed = b.end;
            rest = tail;
            if p != r {
                recvs.push(RecvOp { peer: p, expect: c.header::<T>(1, b.len() * esz), data: bytes_mut(this), acc: None });
            }
        }
        self.exchange(&mut sends, &mut recvs, c.what)?;
        Ok((out, recv_counts))
    }

    /// Every rank waits for every other.
    pub(crate) fn barrier(&mut self, c: &Call) -> DistResult<()> {
        let (w, r) = (self.size(), self.rank);
        let h = Header { dtype: 0, ..c.header::<u8>(0, 0) };
        let mut sends: Vec<SendOp> = (0..w).filter(|p| *p != r).map(|p| SendOp { peer: p, header: h, data: &[] }).collect();
        let mut recvs: Vec<RecvOp> =
            (0..w).filter(|p| *p != r).map(|p| RecvOp { peer: p, expect: h, data: &mut [], acc: None }).collect();
        self.exchange(&mut sends, &mut recvs, c.what)
    }
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

    #[test]
    fn split2_borrows_either_order() {
        let mut v: Vec<i32> = (0..10).collect();
        let (a, b) = split2(&mut v, 0..3, 5..7);
        assert_eq!(a, &[0, 1, 2]);
        b[0] = 50;
        let (a, b) = split2(&mut v, 5..7, 1..2);
        assert_eq!(a, &[50, 6]);
        assert_eq!(b, &mut [1]);
    }
}
