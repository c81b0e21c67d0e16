//! Collective algorithms over a [`Mesh`], on typed buffers.
//!
//! Small messages take a latency-optimal direct path (one round: everyone sends to everyone
//! who needs it, then each rank reduces in rank order 0..W). Large ones take bandwidth-optimal
//! rings: all_reduce = reduce-scatter + all-gather around the ring, each chunk reduced once
//! along a fixed chain and then copied; broadcast = a segmented, pipelined chain. Either way
//! every rank ends with bitwise-identical results. When every member of the group runs on this
//! host, large all_reduce, all_gather and reduce_scatter calls go through shared memory
//! instead (`shm::ops`). Groups of ALLGRAD_TREE_FROM ranks or more (default 32) replace the
//! one-round direct paths of all_reduce, all_gather, reduce_scatter and barrier by a binomial
//! tree (`tree`), whose frames per call grow with log2(W) per rank instead of W, and run
//! all_to_all's sizes, and its data when the blocks are small, through Bruck's log2(W)
//! rounds (`bruck`).
//!
//! Longer than the project's ~500-line aim on purpose: the direct and ring variant of every
//! collective share the `Call` state and the buffer helpers, and they are read side by side to
//! keep their reduction order (and so the bitwise equality across ranks) the same.

use std::ops::Range;

use crate::cpu::bruck::BRUCK_BLOCK_BYTES;
use crate::cpu::call::{ranges, split_even, Call};
use crate::cpu::mesh::{Mesh, RecvOp, SendOp};
use crate::error::{DistError, DistResult};
use crate::reduce::{Elem, ReduceOp};
use crate::wire::Header;

/// Messages up to this many bytes (times the number of peers) take the direct path.
const DIRECT_BYTES: usize = 256 << 10;
/// Segment size of the pipelined broadcast chain.
const SEGMENT_BYTES: usize = 1 << 20;

fn bytes<T: Elem>(x: &[T]) -> &[u8] {
    bytemuck::cast_slice(x)
}
fn bytes_mut<T: Elem>(x: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(x)
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

/// Splits `buf` into consecutive mutable blocks of the given ranges (which tile it in order).
fn blocks_mut<'a, T>(buf: &'a mut [T], blocks: &[Range<usize>]) -> Vec<&'a mut [T]> {
    let mut out = Vec::with_capacity(blocks.len());
    let mut rest = buf;
    for b in blocks {
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(b.len());
        out.push(head);
        rest = tail;
    }
    out
}

/// Views `words` of scratch as `n` elements of `T`.
fn typed<T: Elem>(words: &mut [u64], n: usize) -> &mut [T] {
    &mut bytemuck::cast_slice_mut::<u64, T>(words)[..n]
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

    /// Sends `send(p)` to every peer p and receives `n` elements from each into `others`
    /// (peers in rank order, this rank skipped).
    fn direct_exchange<'d, T: Elem>(
        &mut self,
        c: &Call,
        step: u32,
        send: impl Fn(usize) -> &'d [T],
        n: usize,
        others: &mut [T],
    ) -> DistResult<()> {
        let (w, r) = (self.size(), self.rank);
        let esz = T::DTYPE.size_in_bytes();
        let peers: Vec<usize> = (0..w).filter(|p| *p != r).collect();
        let mut sends: Vec<SendOp> = peers
            .iter()
            .map(|&p| {
                let d = send(p);
                SendOp { peer: p, header: c.header::<T>(step, std::mem::size_of_val(d)), data: bytes(d) }
            })
            .collect();
        let blocks: Vec<Range<usize>> = (0..peers.len()).map(|i| i * n..(i + 1) * n).collect();
        let mut recvs: Vec<RecvOp> = blocks_mut(&mut others[..n * peers.len()], &blocks)
            .into_iter()
            .zip(&peers)
            .map(|(b, &p)| RecvOp { peer: p, expect: c.header::<T>(step, n * esz), data: bytes_mut(b), acc: None })
            .collect();
        self.exchange(&mut sends, &mut recvs, c.what)
    }

    /// One ring pass of reduce-scatter in place over `chunks` of `buf`: at step `s` rank r
    /// sends chunk `r + shift - s` to the right and combines chunk `r + shift - s - 1` from the
    /// left. Rank r ends owning the full reduction of chunk `r + shift + 1`.
    fn ring_reduce_scatter<T: Elem>(
        &mut self,
        c: &Call,
        op: ReduceOp,
        buf: &mut [T],
        chunks: &[Range<usize>],
        shift: isize,
    ) -> DistResult<()> {
        let (w, r) = (self.size() as isize, self.rank as isize);
        let esz = T::DTYPE.size_in_bytes();
        let max = chunks.iter().map(|c| c.len()).max().unwrap_or(0);
        let mut raw = self.take_scratch(max * esz);
        let combine = move |acc: &mut [u8], x: &[u8]| T::combine(op, bytemuck::cast_slice_mut(acc), bytemuck::cast_slice(x));
        for s in 0..(w - 1) {
            let send_i = self.modw(r + shift - s);
            let recv_i = self.modw(r + shift - s - 1);
            let (send, acc) = split2(buf, chunks[send_i].clone(), chunks[recv_i].clone());
            let rlen = acc.len();
            let scratch = typed::<T>(&mut raw, rlen);
            let mut sends = [SendOp { peer: self.right(), header: c.header::<T>(s as u32, send.len() * esz), data: bytes(send) }];
            let mut recvs = [RecvOp {
                peer: self.left(),
                expect: c.header::<T>(s as u32, rlen * esz),
                data: bytes_mut(scratch),
                acc: Some((bytes_mut(acc), &combine, esz)),
            }];
            self.exchange(&mut sends, &mut recvs, c.what)?;
        }
        self.put_scratch(raw);
        Ok(())
    }

    /// Ring reduce-scatter of a read-only `input`: rank r ends with the reduction of chunk r
    /// in `out`. Partial sums travel in two chunk-sized buffers, so the input is never copied
    /// whole.
    fn ring_reduce_scatter_into<T: Elem>(
        &mut self,
        c: &Call,
        op: ReduceOp,
        input: &[T],
        chunks: &[Range<usize>],
        out: &mut [T],
    ) -> DistResult<()> {
        let (w, r) = (self.size() as isize, self.rank as isize);
        let esz = T::DTYPE.size_in_bytes();
        let max = chunks.iter().map(|c| c.len()).max().unwrap_or(0);
        let words = (max * esz).div_ceil(8);
        let mut raw = self.take_scratch(3 * words * 8);
        let (a_words, rest) = raw.split_at_mut(words);
        let (b_words, s_words) = rest.split_at_mut(words);
        let (mut a, mut b) = (typed::<T>(a_words, max), typed::<T>(b_words, max));
        let scratch = typed::<T>(s_words, max);
        let combine = move |acc: &mut [u8], x: &[u8]| T::combine(op, bytemuck::cast_slice_mut(acc), bytemuck::cast_slice(x));
        for s in 0..(w - 1) {
            let send_i = self.modw(r - 1 - s);
            let recv_i = self.modw(r - 2 - s);
            let send: &[T] = if s == 0 { &input[chunks[send_i].clone()] } else { &a[..chunks[send_i].len()] };
            let rlen = chunks[recv_i].len();
            let last = s == w - 2;
            let acc: &mut [T] = if last { &mut out[..rlen] } else { &mut b[..rlen] };
            acc.copy_from_slice(&input[chunks[recv_i].clone()]);
            let mut sends = [SendOp { peer: self.right(), header: c.header::<T>(s as u32, send.len() * esz), data: bytes(send) }];
            let mut recvs = [RecvOp {
                peer: self.left(),
                expect: c.header::<T>(s as u32, rlen * esz),
                data: bytes_mut(&mut scratch[..rlen]),
                acc: Some((bytes_mut(acc), &combine, esz)),
            }];
            self.exchange(&mut sends, &mut recvs, c.what)?;
            std::mem::swap(&mut a, &mut b);
        }
        if op == ReduceOp::Avg {
            T::divide(out, self.size());
        }
        self.put_scratch(raw);
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
        let (w, r) = (self.size() as isize, self.rank as isize);
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
        let n = buf.len();
        let esz = T::DTYPE.size_in_bytes();
        if self.use_shm(n * esz) {
            self.paths.shared_memory += 1;
            return self.shm_all_reduce(c, op, buf).map_err(|e| self.fail(e));
        }
        if self.tree_all_reduce_fits(n * esz, n) {
            self.paths.tree += 1;
            return self.tree_all_reduce(c, op, buf);
        }
        if n * esz * (w - 1) <= DIRECT_BYTES || n < w {
            self.paths.direct += 1;
            let mut raw = self.take_scratch(n * w * esz);
            let all = typed::<T>(&mut raw, n * w);
            let (own, others) = all.split_at_mut(n);
            own.copy_from_slice(buf);
            let own: &[T] = own;
            self.direct_exchange(c, 0, |_| own, n, others)?;
            self.combine_in_rank_order(op, own, others, buf);
            self.put_scratch(raw);
            return Ok(());
        }
        self.paths.ring += 1;
        let chunks = split_even(n, w);
        self.ring_reduce_scatter(c, op, buf, &chunks, 0)?;
        if op == ReduceOp::Avg {
            T::divide(&mut buf[chunks[(self.rank + 1) % w].clone()], w);
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

    /// Gathers every rank's `own` block (sizes in elements given by `counts`) into `out`, in
    /// rank order.
    pub(crate) fn all_gather_v<T: Elem>(
        &mut self,
        c: &Call,
        own: &[T],
        counts: &[usize],
        step0: u32,
        out: &mut [T],
    ) -> DistResult<()> {
        let (w, r) = (self.size(), self.rank);
        let blocks = ranges(counts);
        out[blocks[r].clone()].copy_from_slice(own);
        if w == 1 {
            return Ok(());
        }
        let esz = T::DTYPE.size_in_bytes();
        if self.use_shm(out.len() * esz) {
            return self.shm_all_gather_v(c, own, counts, out).map_err(|e| self.fail(e));
        }
        if self.uses_tree() && out.len() * esz <= DIRECT_BYTES {
            return self.tree_all_gather_v(c, counts, step0, out);
        }
        if out.len() * esz <= DIRECT_BYTES {
            let mut sends: Vec<SendOp> = (0..w)
                .filter(|p| *p != r)
                .map(|p| SendOp { peer: p, header: c.header::<T>(step0, own.len() * esz), data: bytes(own) })
                .collect();
            let mut recvs: Vec<RecvOp> = blocks_mut(out, &blocks)
                .into_iter()
                .enumerate()
                .filter(|(p, _)| *p != r)
                .map(|(p, b)| RecvOp { peer: p, expect: c.header::<T>(step0, b.len() * esz), data: bytes_mut(b), acc: None })
                .collect();
            return self.exchange(&mut sends, &mut recvs, c.what);
        }
        self.ring_all_gather(c, out, &blocks, 0, step0)
    }

    /// Reduces `input` (blocks of `counts[j]` elements, one per rank) and writes this rank's
    /// reduced block to `out`.
    pub(crate) fn reduce_scatter_v<T: Elem>(
        &mut self,
        c: &Call,
        op: ReduceOp,
        input: &[T],
        counts: &[usize],
        out: &mut [T],
    ) -> DistResult<()> {
        let (w, r) = (self.size(), self.rank);
        let blocks = ranges(counts);
        if w == 1 {
            out.copy_from_slice(input);
            return Ok(());
        }
        let esz = T::DTYPE.size_in_bytes();
        let n = blocks[r].len();
        if self.use_shm(input.len() * esz) && self.shm.as_ref().is_some_and(|s| s.slot_bytes() / esz >= w) {
            return self.shm_reduce_scatter_v(c, op, input, counts, out).map_err(|e| self.fail(e));
        }
        if self.uses_tree() && input.len() * esz <= DIRECT_BYTES {
            // The whole input all-reduced through the tree, this rank's block kept.
            self.paths.tree += 1;
            let mut all = input.to_vec();
            self.tree_all_reduce(c, op, &mut all)?;
            out.copy_from_slice(&all[blocks[r].clone()]);
            return Ok(());
        }
        if input.len() * esz <= DIRECT_BYTES {
            let mut raw = self.take_scratch(n * (w - 1) * esz);
            let others = typed::<T>(&mut raw, n * (w - 1));
            self.direct_exchange(c, 0, |p| &input[blocks[p].clone()], n, others)?;
            self.combine_in_rank_order(op, &input[blocks[r].clone()], others, out);
            self.put_scratch(raw);
            return Ok(());
        }
        self.ring_reduce_scatter_into(c, op, input, &blocks, out)
    }

    /// Copies `root`'s buffer into every rank's `buf`.
    pub(crate) fn broadcast<T: Elem>(&mut self, c: &Call, buf: &mut [T], root: usize) -> DistResult<()> {
        let (w, r) = (self.size(), self.rank);
        if w == 1 {
            return Ok(());
        }
        let esz = T::DTYPE.size_in_bytes();
        let nbytes = buf.len() * esz;
        if self.uses_tree() && nbytes <= DIRECT_BYTES {
            self.rooted_paths.broadcast_tree += 1;
            return self.tree_broadcast(c, buf, root);
        }
        if nbytes <= DIRECT_BYTES || w == 2 {
            self.rooted_paths.broadcast_direct += 1;
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
        self.rooted_paths.broadcast_chain += 1;
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
        let n = buf.len();
        let nbytes = n * esz;
        if self.tree_all_reduce_fits(nbytes, n) {
            self.rooted_paths.reduce_tree += 1;
            return self.tree_reduce(c, op, buf, root);
        }
        if nbytes * (w - 1) <= DIRECT_BYTES || n < w {
            self.rooted_paths.reduce_direct += 1;
            if r == root {
                let mut raw = self.take_scratch(n * w * esz);
                let all = typed::<T>(&mut raw, n * w);
                let (own, others) = all.split_at_mut(n);
                own.copy_from_slice(buf);
                let peers: Vec<usize> = (0..w).filter(|p| *p != r).collect();
                let blocks: Vec<Range<usize>> = (0..w - 1).map(|i| i * n..(i + 1) * n).collect();
                let mut recvs: Vec<RecvOp> = blocks_mut(others, &blocks)
                    .into_iter()
                    .zip(&peers)
                    .map(|(b, &p)| RecvOp { peer: p, expect: c.header::<T>(0, nbytes), data: bytes_mut(b), acc: None })
                    .collect();
                self.exchange(&mut [], &mut recvs, c.what)?;
                self.combine_in_rank_order(op, own, others, buf);
                self.put_scratch(raw);
            } else {
                let mut sends = [SendOp { peer: root, header: c.header::<T>(0, nbytes), data: bytes(buf) }];
                self.exchange(&mut sends, &mut [], c.what)?;
            }
            return Ok(());
        }
        // Ring reduce-scatter, then every rank sends the chunk it owns to the root.
        self.rooted_paths.reduce_ring += 1;
        let chunks = split_even(n, w);
        let mine = chunks[r].clone();
        let mut reduced = vec![T::zeroed(); mine.len()];
        self.ring_reduce_scatter_into(c, op, buf, &chunks, &mut reduced)?;
        let step = (w - 1) as u32;
        if r == root {
            buf[mine].copy_from_slice(&reduced);
            let mut recvs: Vec<RecvOp> = blocks_mut(buf, &chunks)
                .into_iter()
                .enumerate()
                .filter(|(p, _)| *p != r)
                .map(|(p, b)| RecvOp { peer: p, expect: c.header::<T>(step, b.len() * esz), data: bytes_mut(b), acc: None })
                .collect();
            self.exchange(&mut [], &mut recvs, c.what)?;
        } else {
            let mut sends = [SendOp { peer: root, header: c.header::<T>(step, reduced.len() * esz), data: bytes(&reduced) }];
            self.exchange(&mut sends, &mut [], c.what)?;
        }
        Ok(())
    }

    /// Sends block j of `input` (`send_counts[j]` elements) to rank j; returns the blocks
    /// received from every rank, in rank order, and their sizes. Groups that take the tree
    /// exchange the sizes in Bruck's log2(W) rounds, and small blocks too (`bruck`); the
    /// others, and large blocks, send every peer its block directly.
    pub(crate) fn all_to_all_v<T: Elem>(
        &mut self,
        c: &Call,
        input: &[T],
        send_counts: &[usize],
        max_bytes: u64,
    ) -> DistResult<(Vec<T>, Vec<usize>)> {
        let (w, r) = (self.size(), self.rank);
        let in_blocks = ranges(send_counts);
        let esz = T::DTYPE.size_in_bytes() as u64;
        if w == 1 {
            self.check_all_to_all_total(send_counts, esz, max_bytes)?;
            return Ok((input.to_vec(), send_counts.to_vec()));
        }
        let (recv_counts, bruck, step) = if self.uses_tree() {
            let sizes = self.bruck_sizes::<T>(c, send_counts)?;
            self.check_all_to_all_total(&sizes.recv_counts, esz, max_bytes)?;
            if sizes.largest <= BRUCK_BLOCK_BYTES {
                self.pairwise_paths.all_to_all_bruck += 1;
                let out = self.bruck_data(c, input, send_counts, &sizes)?;
                return Ok((out, sizes.recv_counts));
            }
            (sizes.recv_counts, true, sizes.data_step)
        } else {
            let mine: Vec<u64> = send_counts.iter().map(|x| *x as u64).collect();
            let got = self.exchange_counts(c, 0, &mine)?;
            let got: Vec<usize> = got.into_iter().map(|x| x as usize).collect();
            self.check_all_to_all_total(&got, esz, max_bytes)?;
            (got, false, 1)
        };
        if bruck {
            self.pairwise_paths.all_to_all_bruck_sizes += 1;
        } else {
            self.pairwise_paths.all_to_all_direct += 1;
        }
        let out_blocks = ranges(&recv_counts);
        let mut out = vec![T::zeroed(); recv_counts.iter().sum()];
        out[out_blocks[r].clone()].copy_from_slice(&input[in_blocks[r].clone()]);
        let esz = esz as usize;
        let mut sends: Vec<SendOp> = (0..w)
            .filter(|p| *p != r)
            .map(|p| SendOp {
                peer: p,
                header: c.header::<T>(step, in_blocks[p].len() * esz),
                data: bytes(&input[in_blocks[p].clone()]),
            })
            .collect();
        let mut recvs: Vec<RecvOp> = blocks_mut(&mut out, &out_blocks)
            .into_iter()
            .enumerate()
            .filter(|(p, _)| *p != r)
            .map(|(p, b)| RecvOp { peer: p, expect: c.header::<T>(step, b.len() * esz), data: bytes_mut(b), acc: None })
            .collect();
        self.exchange(&mut sends, &mut recvs, c.what)?;
        Ok((out, recv_counts))
    }

    /// Refuses an all_to_all whose blocks to receive (`recv_counts` elements of `esz` bytes,
    /// announced by the peers) add up to more than `max_bytes`, before anything is allocated.
    fn check_all_to_all_total(&mut self, recv_counts: &[usize], esz: u64, max_bytes: u64) -> DistResult<()> {
        let total = recv_counts.iter().try_fold(0u64, |a, b| a.checked_add(*b as u64)).and_then(|t| t.checked_mul(esz));
        match total {
            Some(t) if t <= max_bytes => Ok(()),
            _ => Err(self.fail(DistError::Protocol {
                peer: usize::MAX,
                group: self.group.clone(),
                detail: format!(
                    "all_to_all would receive {recv_counts:?} elements of {esz} bytes, over the limit of {max_bytes} bytes \
                     (ALLGRAD_MAX_MESSAGE_BYTES)"
                ),
            })),
        }
    }

    /// Sends `input` to rank `dst` and returns what rank `src` sent here, talking to those two
    /// peers only: one round for the element counts (so blocks may differ in size), one for
    /// the data. `unit` divides every block's length (a tensor's row length; 0 when rows are
    /// empty). When `dst` is this rank the input is returned as it is.
    pub(crate) fn permute<T: Elem>(
        &mut self,
        c: &Call,
        input: &[T],
        dst: usize,
        src: usize,
        unit: usize,
        max_bytes: u64,
    ) -> DistResult<Vec<T>> {
        let r = self.rank;
        if dst == r && src == r {
            return Ok(input.to_vec());
        }
        let mine = [input.len() as u64];
        let mut got = 0u64;
        let header = |step| Header { dtype: 0, redop: 0, ..c.header::<u8>(step, 8) };
        let mut sends = [SendOp { peer: dst, header: header(0), data: bytemuck::cast_slice(&mine) }];
        let mut recvs = [RecvOp { peer: src, expect: header(0), data: bytemuck::bytes_of_mut(&mut got), acc: None }];
        self.exchange(&mut sends, &mut recvs, c.what)?;
        let esz = T::DTYPE.size_in_bytes() as u64;
        let fits = got.checked_mul(esz).is_some_and(|b| b <= max_bytes);
        if !fits || (unit > 0 && !got.is_multiple_of(unit as u64)) {
            return Err(self.fail(DistError::Protocol {
                peer: src,
                group: self.group.clone(),
                detail: format!(
                    "permute: rank {src} announced {got} elements of {esz} bytes, which is not a whole number of rows of \
                     {unit} or is over the limit of {max_bytes} bytes (ALLGRAD_MAX_MESSAGE_BYTES)"
                ),
            }));
        }
        let mut out = vec![T::zeroed(); got as usize];
        let esz = esz as usize;
        let mut sends = [SendOp { peer: dst, header: c.header::<T>(1, input.len() * esz), data: bytes(input) }];
        let expect = c.header::<T>(1, out.len() * esz);
        let mut recvs = [RecvOp { peer: src, expect, data: bytes_mut(&mut out), acc: None }];
        self.exchange(&mut sends, &mut recvs, c.what)?;
        Ok(out)
    }

    /// Every rank waits for every other.
    pub(crate) fn barrier(&mut self, c: &Call) -> DistResult<()> {
        let (w, r) = (self.size(), self.rank);
        let h = Header { dtype: 0, ..c.header::<u8>(0, 0) };
        if w == 1 {
            return Ok(());
        }
        if self.uses_tree() {
            self.pairwise_paths.barrier_tree += 1;
            return self.tree_agree(h, c.what);
        }
        self.pairwise_paths.barrier_direct += 1;
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
