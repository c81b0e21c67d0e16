//! The same-host fast path: when every member of a group runs on this host, large
//! all_reduce, all_gather and reduce_scatter calls move their data through one shared-memory
//! segment per group instead of loopback TCP, which costs a kernel copy on each side.
//!
//! How a group decides to use it and maps the segment: `setup`.
//!
//! The data moves in pieces of one slot per rank, with barriers between the phases.
//! all_reduce: each rank copies its piece into its slot; barrier; rank r reduces sub-chunk r
//! over slots 0..W-1 in rank order (so every rank gets bitwise the same result, as on the
//! direct TCP path) into the result area; barrier; everyone copies the reduced sub-chunks of
//! the others out. all_gather: copy in; barrier; copy the others' blocks out. reduce_scatter:
//! each rank copies the same stretch of every block into its slot; barrier; rank r reduces its
//! block's stretch. The segment holds two sets of slots used alternately (a piece written
//! after barrier e uses set e % 2, is read after barrier e + 1 and its result after e + 2), so
//! copying one piece out overlaps with the next and a piece costs one barrier.
//!
//! The first barrier of every collective is an exchange of its header (op, dtype, reduce op,
//! call number, shape digest), without payload, with every peer over TCP, sent once this rank
//! has written its first piece: ranks that called different collectives fail exactly as on the
//! TCP path, naming both calls, before any rank reads the segment. The other barriers are
//! atomic words of the segment (a counter of arrivals and a generation number).
//!
//! A rank waiting at a barrier spins briefly, then yields its CPU for up to a millisecond
//! (waking a sleeping thread, often a halted virtual CPU, costs more than a short wait), then
//! sleeps on a futex with a short timeout (when the group has more members than the host has
//! CPUs, it sleeps at once: spinning would take the CPU from the members it waits for), and meanwhile watches the abort word of the segment
//! (raised by a member that fails), its TCP connections (an ABORT frame, or a peer that died
//! and whose connections closed; a window of them at each look, [`PeerWatch`](crate::cpu::mesh::PeerWatch)) and the
//! group's deadline; any of them poisons the group as on the TCP path.

use std::ops::Range;
use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

use crate::cpu::call::{ranges, split_even, Call};
use crate::cpu::mesh::{Mesh, SHM_STEP};
use crate::cpu::segment::{Region, Segment};
use crate::error::{DistError, DistResult};
use crate::reduce::{Elem, ReduceOp};

/// Collectives of at least this many bytes (the all_reduce buffer, the all_gather output, the
/// reduce_scatter input) take the shared-memory path when the group has one.
pub(crate) const SHM_MIN_BYTES: usize = 64 << 10;
/// How long a waiter spins before it starts yielding its CPU.
const SPIN: Duration = Duration::from_micros(20);
/// How long a waiter yields (staying awake when nothing else wants the CPU) before it sleeps.
const YIELD_FOR: Duration = Duration::from_millis(1);
/// Longest single sleep: the waiter then looks at its connections and the deadline.
const NAP: Duration = Duration::from_millis(2);
/// How often a waiter looks at its TCP connections for a failed or dead peer.
const PEER_CHECK: Duration = Duration::from_millis(5);

impl Mesh {
    /// Whether a collective of `bytes` bytes takes the shared-memory path.
    pub(crate) fn use_shm(&self, bytes: usize) -> bool {
        self.shm.is_some() && bytes >= SHM_MIN_BYTES
    }

    fn seg(&self) -> &Segment {
        self.shm.as_ref().expect("a shared-memory collective on a group without a segment")
    }

    fn seg_mut(&mut self) -> &mut Segment {
        self.shm.as_mut().expect("a shared-memory collective on a group without a segment")
    }

    /// The set of slots the next piece uses: a piece written into its slots after barrier e
    /// uses set e % 2, is read after barrier e + 1, and its result after barrier e + 2; the
    /// next piece of the same set starts after barrier e + 2 at the earliest, once every rank
    /// is done with the previous one (see the module docs).
    fn next_set(&self) -> usize {
        (self.seg().phase() % 2) as usize
    }

    /// Exchanges this call's header, without payload, with every peer: the same checks as
    /// the TCP path (mismatched calls fail on every rank, naming both) before any rank reads
    /// the segment. As every rank sends its header only once it has written its first piece,
    /// the exchange is also the first barrier of the collective.
    fn shm_enter<T: Elem>(&mut self, c: &Call) -> DistResult<()> {
        let h = c.header::<T>(SHM_STEP, 0);
        // The segment writes before the send happen before the peers' reads after their
        // receive (the kernel orders the two; the fences keep the compiler and CPU from
        // moving the accesses across the calls).
        fence(Ordering::SeqCst);
        self.exchange_header(h, c.what)?;
        fence(Ordering::SeqCst);
        self.seg_mut().passed_elsewhere();
        Ok(())
    }

    /// The barrier before piece `k` can be read: the header exchange for the first piece, a
    /// barrier on the segment for the others.
    fn shm_piece_barrier<T: Elem>(&mut self, c: &Call, k: usize) -> DistResult<()> {
        if k == 0 {
            self.shm_enter::<T>(c)
        } else {
            self.shm_barrier(c.what)
        }
    }

    /// Waits until every member has reached this barrier; on failure the group is poisoned.
    fn shm_barrier(&mut self, what: &str) -> DistResult<()> {
        #[cfg(test)]
        if let Some(e) = self.injected_fault() {
            return Err(e);
        }
        let target = self.seg_mut().arrive();
        self.shm_wait(target, what).map_err(|e| self.fail(e))
    }

    fn shm_wait(&self, target: u32, what: &str) -> DistResult<()> {
        let seg = self.seg();
        let start = Instant::now();
        // With more members than CPUs, a waiter that spins or yields takes the CPU from the
        // members it waits for: it sleeps at once.
        let (spin, yield_for) = if seg.busy_wait { (SPIN, YIELD_FOR) } else { (Duration::ZERO, Duration::ZERO) };
        while start.elapsed() < spin {
            for _ in 0..64 {
                if seg.passed(target) {
                    return Ok(());
                }
                std::hint::spin_loop();
            }
        }
        let deadline = start + self.timeout;
        let mut next_check = start + PEER_CHECK;
        // A window of the connections at each look, moving on each time; the first rank to see
        // a dead peer raises the segment's abort word for all.
        let mut watch = self.peer_watch();
        let awake_until = start + yield_for;
        loop {
            if seg.passed(target) {
                return Ok(());
            }
            if let Some(p) = seg.aborted_by() {
                if seg.passed(target) {
                    return Ok(());
                }
                return Err(self.abort_reason(p, what));
            }
            let now = Instant::now();
            if now >= next_check {
                if let Some(e) = watch.look(self, what) {
                    // A peer that passed this barrier may have finished and left already.
                    fence(Ordering::SeqCst);
                    if seg.passed(target) {
                        return Ok(());
                    }
                    return Err(e);
                }
                next_check = now + PEER_CHECK;
            }
            if now >= deadline {
                let waiting: Vec<usize> = seg.missing(target).into_iter().map(|p| self.members[p]).collect();
                return Err(DistError::Timeout {
                    what: format!(
                        "in {what} on group {}, waiting for rank(s) {waiting:?} at a shared-memory barrier",
                        self.group
                    ),
                    timeout: self.timeout,
                });
            }
            if now < awake_until {
                std::thread::yield_now();
            } else {
                seg.sleep(
                    target,
                    NAP.min(deadline - now).min(next_check.saturating_duration_since(now)).max(Duration::from_micros(50)),
                );
            }
        }
    }

    /// The error for member `p`, which raised the abort word. Its ABORT frame, with the
    /// reason, was sent just before and is read if it arrives within a moment.
    fn abort_reason(&self, p: usize, what: &str) -> DistError {
        let until = Instant::now() + Duration::from_millis(200);
        loop {
            if let Some(e) = self.pending_abort(p).or_else(|| self.peer_failure(what)) {
                return e;
            }
            if Instant::now() >= until {
                return DistError::PeerAborted {
                    peer: self.members[p],
                    group: self.group.clone(),
                    reason: format!("it failed during {what} (through shared memory)"),
                };
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// all_reduce through shared memory (see the module docs).
    pub(crate) fn shm_all_reduce<T: Elem>(&mut self, c: &Call, op: ReduceOp, buf: &mut [T]) -> DistResult<()> {
        let (w, r) = (self.size(), self.rank);
        let per = self.seg().slot_bytes() / std::mem::size_of::<T>();
        let mut pending: Option<(Range<usize>, usize)> = None;
        for (k, start) in (0..buf.len()).step_by(per).enumerate() {
            let piece = start..(start + per).min(buf.len());
            let set = self.next_set();
            self.seg_mut().write(Region { set, slot: r }, 0, &buf[piece.clone()])?;
            self.shm_piece_barrier::<T>(c, k)?;
            // Sub-chunk r of this piece, reduced over every slot in rank order 0..W-1.
            let mine = split_even(piece.len(), w)[r].clone();
            let out = &mut buf[piece.start + mine.start..piece.start + mine.end];
            let seg = self.seg();
            if r != 0 {
                seg.read(Region { set, slot: 0 }, mine.start, out)?;
            }
            for j in 1..w {
                seg.combine_from(Region { set, slot: j }, mine.start, out, op)?;
            }
            if op == ReduceOp::Avg {
                T::divide(out, w);
            }
            self.seg_mut().write(Region { set, slot: w }, mine.start, &buf[piece.start + mine.start..piece.start + mine.end])?;
            if let Some((done, dset)) = pending.take() {
                self.shm_copy_out(&mut buf[done], dset)?;
            }
            pending = Some((piece, set));
        }
        self.shm_barrier(c.what)?;
        if let Some((done, dset)) = pending {
            self.shm_copy_out(&mut buf[done], dset)?;
        }
        Ok(())
    }

    /// Copies the sub-chunks the other ranks reduced from the result area of `set`.
    fn shm_copy_out<T: Elem>(&self, piece: &mut [T], set: usize) -> DistResult<()> {
        let (w, r) = (self.size(), self.rank);
        let seg = self.seg();
        for (j, sub) in split_even(piece.len(), w).into_iter().enumerate() {
            if j != r {
                seg.read(Region { set, slot: w }, sub.start, &mut piece[sub])?;
            }
        }
        Ok(())
    }

    /// all_gather through shared memory: `out` (blocks of `counts[j]` elements) already holds
    /// this rank's own block.
    pub(crate) fn shm_all_gather_v<T: Elem>(&mut self, c: &Call, own: &[T], counts: &[usize], out: &mut [T]) -> DistResult<()> {
        let (w, r) = (self.size(), self.rank);
        let per = self.seg().slot_bytes() / std::mem::size_of::<T>();
        let starts = ranges(counts);
        let pieces = counts.iter().max().copied().unwrap_or(0).div_ceil(per).max(1);
        let part = |k: usize, len: usize| (k * per).min(len)..((k + 1) * per).min(len);
        for k in 0..pieces {
            let set = self.next_set();
            self.seg_mut().write(Region { set, slot: r }, 0, &own[part(k, own.len())])?;
            self.shm_piece_barrier::<T>(c, k)?;
            let seg = self.seg();
            for j in (0..w).filter(|j| *j != r) {
                let p = part(k, counts[j]);
                let base = starts[j].start;
                seg.read(Region { set, slot: j }, 0, &mut out[base + p.start..base + p.end])?;
            }
        }
        Ok(())
    }

    /// reduce_scatter through shared memory: each piece holds, in every rank's slot, the same
    /// stretch of every rank's block; rank r reduces its block's stretch over the slots in rank
    /// order.
    pub(crate) fn shm_reduce_scatter_v<T: Elem>(
        &mut self,
        c: &Call,
        op: ReduceOp,
        input: &[T],
        counts: &[usize],
        out: &mut [T],
    ) -> DistResult<()> {
        let (w, r) = (self.size(), self.rank);
        let per = self.seg().slot_bytes() / std::mem::size_of::<T>() / w;
        if per == 0 {
            return Err(DistError::Invalid(format!("a shared-memory reduce_scatter needs a slot of at least {w} elements")));
        }
        let blocks = ranges(counts);
        let pieces = counts.iter().max().copied().unwrap_or(0).div_ceil(per).max(1);
        let part = |k: usize, len: usize| (k * per).min(len)..((k + 1) * per).min(len);
        for k in 0..pieces {
            let set = self.next_set();
            for (j, b) in blocks.iter().enumerate() {
                let p = part(k, b.len());
                self.seg_mut().write(Region { set, slot: r }, j * per, &input[b.start + p.start..b.start + p.end])?;
            }
            self.shm_piece_barrier::<T>(c, k)?;
            let p = part(k, counts[r]);
            let acc = &mut out[p.clone()];
            let seg = self.seg();
            seg.read(Region { set, slot: 0 }, r * per, acc)?;
            for j in 1..w {
                seg.combine_from(Region { set, slot: j }, r * per, acc, op)?;
            }
            if op == ReduceOp::Avg {
                T::divide(acc, w);
            }
        }
        Ok(())
    }
}

// ------------------------------------------------------------------ test hooks

/// A failure a test injects at a shared-memory barrier of the rank (thread) that sets it.
#[cfg(test)]
#[derive(Clone, Copy, Debug)]
pub(crate) enum Fault {
    /// The rank fails as a program error would: ABORT frames, abort word raised.
    Abort,
    /// The rank vanishes as a killed process would: connections close, nothing else.
    Kill,
    /// The rank stops for longer than the group's timeout before it arrives.
    Stall,
    /// The rank stops for this long before it arrives (and so does not look at its
    /// connections meanwhile), then waits as usual.
    Pause(Duration),
}

#[cfg(test)]
thread_local! {
    /// (barriers to pass first, what happens at the next one).
    pub(crate) static FAULT: std::cell::Cell<Option<(u32, Fault)>> = const { std::cell::Cell::new(None) };
}

#[cfg(test)]
impl Mesh {
    fn injected_fault(&mut self) -> Option<DistError> {
        let (left, how) = FAULT.get()?;
        if left > 0 {
            FAULT.set(Some((left - 1, how)));
            return None;
        }
        FAULT.set(None);
        Some(match how {
            Fault::Abort => self.fail(DistError::Invalid("failure injected by a test".into())),
            Fault::Kill => {
                self.kill_for_test();
                DistError::Invalid("killed by a test".into())
            }
            Fault::Stall => {
                std::thread::sleep(self.timeout + Duration::from_millis(500));
                return None;
            }
            Fault::Pause(d) => {
                std::thread::sleep(d);
                return None;
            }
        })
    }
}
