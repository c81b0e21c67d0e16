//! The same-host fast path: when every member of a group runs on this host, large
//! all_reduce, all_gather and reduce_scatter calls move their data through one shared-memory
//! segment per group instead of loopback TCP, which costs a kernel copy on each side.
//!
//! Setup, once per group (init and `new_group`), over the group's TCP mesh:
//! 1. every rank sends every other its host id (boot id, host name and mount namespace,
//!    hashed), whether it wants shared memory (ALLGRAD_SHM is not `0`) and, from rank 0, a
//!    random nonce and the slot size. Shared memory is used only if every member agrees.
//! 2. rank 0 creates `/dev/shm/<job prefix><hash of job token, group and nonce>` (O_EXCL, mode
//!    0600, its memory reserved up front), maps it and says whether that worked;
//! 3. the others open it, check owner, mode, size and header, map it, and everyone tells
//!    everyone whether it succeeded. Rank 0 then removes the name, so nothing is left behind
//!    whatever happens to the processes afterwards (only rank 0 killed within these few
//!    milliseconds would leave the file). If any step fails locally the group simply keeps
//!    using TCP.
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
//! sleeps on a futex with a short timeout, and meanwhile watches the abort word of the segment
//! (raised by a member that fails), its TCP connections (an ABORT frame, or a peer that died
//! and whose connections closed) and the group's deadline; any of them poisons the group as on
//! the TCP path.

use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

use crate::collectives::{split_even, Call};
use crate::error::{DistError, DistResult};
use crate::mesh::{Mesh, OpCode, RecvOp, SendOp, SHM_STEP};
use crate::reduce::{Elem, ReduceOp};
use crate::shm::{segment_bytes, Region, Segment, SLOT_ALIGN};
use crate::shm_job::{shm_job_prefix, SHM_DIR};
use crate::wire::{Header, KIND_DATA};

/// Collectives of at least this many bytes (the all_reduce buffer, the all_gather output, the
/// reduce_scatter input) take the shared-memory path when the group has one.
pub(crate) const SHM_MIN_BYTES: usize = 64 << 10;
/// Default bytes of one rank's slot (ALLGRAD_SHM_SLOT_BYTES overrides).
pub(crate) const DEFAULT_SLOT_BYTES: usize = 1 << 20;
/// Largest segment a group maps (two sets of W + 1 slots); slots shrink to fit.
pub(crate) const MAX_SEGMENT_BYTES: usize = 256 << 20;
/// How long a waiter spins before it starts yielding its CPU.
const SPIN: Duration = Duration::from_micros(20);
/// How long a waiter yields (staying awake when nothing else wants the CPU) before it sleeps.
const YIELD_FOR: Duration = Duration::from_millis(1);
/// Longest single sleep: the waiter then looks at its connections and the deadline.
const NAP: Duration = Duration::from_millis(2);
/// How often a waiter looks at its TCP connections for a failed or dead peer.
const PEER_CHECK: Duration = Duration::from_millis(5);

/// Whether and how a process's groups use shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ShmConfig {
    pub enabled: bool,
    pub slot_bytes: usize,
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig { enabled: true, slot_bytes: DEFAULT_SLOT_BYTES }
    }
}

impl ShmConfig {
    /// ALLGRAD_SHM (`0` turns the fast path off, `1` or unset leaves it on) and
    /// ALLGRAD_SHM_SLOT_BYTES (bytes per rank and piece, a multiple of 4096 is used).
    pub fn from_env() -> DistResult<ShmConfig> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// As [`ShmConfig::from_env`], reading variables through `get`.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> DistResult<ShmConfig> {
        let mut cfg = ShmConfig::default();
        if let Some(v) = get("ALLGRAD_SHM") {
            cfg.enabled = match v.trim() {
                "" | "1" => true,
                "0" => false,
                _ => return Err(DistError::Env(format!("ALLGRAD_SHM={v:?} is neither 0 (TCP only) nor 1 (default)"))),
            };
        }
        if let Some(v) = get("ALLGRAD_SHM_SLOT_BYTES") {
            cfg.slot_bytes = v.trim().parse::<usize>().ok().filter(|b| *b >= SLOT_ALIGN).ok_or_else(|| {
                DistError::Env(format!("ALLGRAD_SHM_SLOT_BYTES={v:?} is not a number of bytes of at least {SLOT_ALIGN}"))
            })?;
        }
        Ok(cfg)
    }
}

/// The slot size a group of `w` uses for a wish of `want` bytes: a multiple of the page size,
/// with the whole segment within [`MAX_SEGMENT_BYTES`].
fn slot_for(w: usize, want: usize) -> usize {
    let control = segment_bytes(w, 0).unwrap_or(usize::MAX);
    let cap = MAX_SEGMENT_BYTES.saturating_sub(control) / (2 * (w + 1));
    (want.min(cap) / SLOT_ALIGN * SLOT_ALIGN).max(SLOT_ALIGN)
}

// ------------------------------------------------------------------ setup

const OFFER_LEN: usize = 48;

/// What each rank says about itself in the first setup round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Offer {
    host: [u8; 16],
    nonce: u128,
    slot: u64,
    wants: bool,
}

impl Offer {
    fn encode(&self) -> [u8; OFFER_LEN] {
        let mut b = [0u8; OFFER_LEN];
        b[0..16].copy_from_slice(&self.host);
        b[16..32].copy_from_slice(&self.nonce.to_le_bytes());
        b[32..40].copy_from_slice(&self.slot.to_le_bytes());
        b[40] = self.wants as u8;
        b
    }
    fn decode(b: &[u8]) -> Offer {
        Offer {
            host: b[0..16].try_into().unwrap(),
            nonce: u128::from_le_bytes(b[16..32].try_into().unwrap()),
            slot: u64::from_le_bytes(b[32..40].try_into().unwrap()),
            wants: b[40] == 1,
        }
    }
}

/// This host, as seen by this process: the kernel's boot id, the host name and the mount
/// namespace (containers on one kernel with their own /dev/shm differ). `None` where there is
/// no boot id to read.
fn host_id() -> Option<[u8; 16]> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let mnt = std::fs::read_link("/proc/self/ns/mnt").map(|p| p.display().to_string()).unwrap_or_default();
    Some(allgrad_rng::hash128(&[boot.trim().as_bytes(), name.trim().as_bytes(), mnt.as_bytes()]))
}

/// The segment's file. After the job's prefix, its name hashes the job token with the group
/// and rank 0's 128-bit random nonce: unpredictable to other users, and (with 128 unknown
/// random bits hashed in) revealing nothing more of the token than the prefix does. The name
/// starts with the job's [`shm_job_prefix`], so the launcher can remove a file left
/// by a rank that died during setup.
pub(crate) fn segment_path(token: &str, group: &str, nonce: u128) -> PathBuf {
    let h = allgrad_rng::hash128(&[&nonce.to_le_bytes(), token.as_bytes(), group.as_bytes(), &nonce.to_le_bytes()]);
    let hex: String = h.iter().map(|b| format!("{b:02x}")).collect();
    PathBuf::from(SHM_DIR).join(format!("{}{hex}", shm_job_prefix(token)))
}

/// Removes the segment's name when dropped (on success and on every error path alike).
struct Unlink(Option<PathBuf>);

impl Drop for Unlink {
    fn drop(&mut self) {
        if let Some(p) = &self.0 {
            crate::shm::unlink(p);
        }
    }
}

impl Mesh {
    /// One setup round: sends `mine` to the peers in `to` and receives `len` bytes from each
    /// peer in `from`; returns what arrived, by group rank.
    fn setup_round(&mut self, step: u32, to: &[usize], mine: &[u8], from: &[usize], len: usize) -> DistResult<Vec<Vec<u8>>> {
        let header =
            |len: usize| Header { kind: KIND_DATA, op: OpCode::Setup as u8, step, len: len as u64, ..Default::default() };
        let mut got: Vec<Vec<u8>> =
            (0..self.size()).map(|p| if from.contains(&p) { vec![0u8; len] } else { Vec::new() }).collect();
        let mut sends: Vec<SendOp> = to.iter().map(|&p| SendOp { peer: p, header: header(mine.len()), data: mine }).collect();
        let mut recvs: Vec<RecvOp> = got
            .iter_mut()
            .enumerate()
            .filter(|(p, _)| from.contains(p))
            .map(|(p, b)| RecvOp { peer: p, expect: header(len), data: b, acc: None })
            .collect();
        self.exchange(&mut sends, &mut recvs, "setting up the group")?;
        Ok(got)
    }

    /// Decides with the other members whether this group uses shared memory, and maps the
    /// segment if so. Fails only when the mesh does (a peer died or misbehaved).
    pub(crate) fn setup_shm(&mut self, token: &str, cfg: ShmConfig) -> DistResult<()> {
        let (w, r) = (self.size(), self.rank);
        if w < 2 {
            return Ok(());
        }
        let host = host_id();
        let dir_ok = std::path::Path::new(SHM_DIR).is_dir();
        let mine = Offer {
            host: host.unwrap_or_default(),
            nonce: if r == 0 { rand::random() } else { 0 },
            slot: slot_for(w, cfg.slot_bytes) as u64,
            wants: cfg.enabled && host.is_some() && dir_ok,
        };
        let peers: Vec<usize> = (0..w).filter(|p| *p != r).collect();
        let got = self.setup_round(0, &peers, &mine.encode(), &peers, OFFER_LEN)?;
        let offers: Vec<Offer> = (0..w).map(|p| if p == r { mine } else { Offer::decode(&got[p]) }).collect();
        if !offers.iter().all(|o| o.wants && o.host == mine.host) {
            tracing::debug!("{}: not every member is on this host or wants shared memory; TCP only", self.group);
            return Ok(());
        }
        let slot = usize::try_from(offers[0].slot).unwrap_or(0);
        if !slot.is_multiple_of(SLOT_ALIGN) || slot == 0 || segment_bytes(w, slot).is_none_or(|b| b > MAX_SEGMENT_BYTES) {
            // Every member sees the same offer from rank 0, so all of them stop here.
            tracing::debug!("{}: no shared-memory layout for {w} ranks of {slot} bytes; TCP only", self.group);
            return Ok(());
        }
        let path = segment_path(token, &self.group, offers[0].nonce);

        // Rank 0 creates the segment and says whether it could.
        let mut unlink = Unlink(None);
        let mut seg = None;
        let created = if r == 0 {
            match Segment::create(&path, w, r, slot) {
                Ok(s) => {
                    unlink.0 = Some(path.clone());
                    seg = Some(s);
                }
                Err(e) => tracing::debug!("{}: cannot create {}: {e}; TCP only", self.group, path.display()),
            }
            let status = [seg.is_some() as u8; 8];
            self.setup_round(1, &peers, &status, &[], 8)?;
            seg.is_some()
        } else {
            self.setup_round(1, &[], &[], &[0], 8)?[0][0] == 1
        };
        if !created {
            return Ok(());
        }

        // The others map it; everyone learns whether all did, then the name goes.
        if r != 0 {
            match Segment::open(&path, w, r, slot) {
                Ok(s) => seg = Some(s),
                Err(e) => tracing::debug!("{}: cannot map {}: {e}; TCP only", self.group, path.display()),
            }
        }
        let status = [seg.is_some() as u8; 8];
        let got = self.setup_round(2, &peers, &status, &peers, 8)?;
        drop(unlink);
        let all = seg.is_some() && peers.iter().all(|p| got[*p][0] == 1);
        if all {
            tracing::debug!("{}: large collectives go through shared memory ({slot}-byte slots)", self.group);
            self.shm = seg;
        }
        Ok(())
    }

    // -------------------------------------------------------------- collectives

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
        let (w, r) = (self.size(), self.rank);
        let h = c.header::<T>(SHM_STEP, 0);
        let mut sends: Vec<SendOp> = (0..w).filter(|p| *p != r).map(|p| SendOp { peer: p, header: h, data: &[] }).collect();
        let mut recvs: Vec<RecvOp> =
            (0..w).filter(|p| *p != r).map(|p| RecvOp { peer: p, expect: h, data: &mut [], acc: None }).collect();
        // The segment writes before the send happen before the peers' reads after their
        // receive (the kernel orders the two; the fences keep the compiler and CPU from
        // moving the accesses across the calls).
        fence(Ordering::SeqCst);
        self.exchange(&mut sends, &mut recvs, c.what)?;
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
        while start.elapsed() < SPIN {
            for _ in 0..64 {
                if seg.passed(target) {
                    return Ok(());
                }
                std::hint::spin_loop();
            }
        }
        let deadline = start + self.timeout;
        let mut next_check = start + PEER_CHECK;
        let awake_until = start + YIELD_FOR;
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
                if let Some(e) = self.peer_failure(what) {
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
            self.seg_mut().write(Region { set, slot: r }, 0, &buf[piece.clone()]);
            self.shm_piece_barrier::<T>(c, k)?;
            // Sub-chunk r of this piece, reduced over every slot in rank order 0..W-1.
            let mine = split_even(piece.len(), w)[r].clone();
            let out = &mut buf[piece.start + mine.start..piece.start + mine.end];
            let seg = self.seg();
            if r != 0 {
                seg.read(Region { set, slot: 0 }, mine.start, out);
            }
            for j in 1..w {
                T::combine(op, out, seg.view(Region { set, slot: j }, mine.start, mine.len()));
            }
            if op == ReduceOp::Avg {
                T::divide(out, w);
            }
            self.seg_mut().write(Region { set, slot: w }, mine.start, &buf[piece.start + mine.start..piece.start + mine.end]);
            if let Some((done, dset)) = pending.take() {
                self.shm_copy_out(&mut buf[done], dset);
            }
            pending = Some((piece, set));
        }
        self.shm_barrier(c.what)?;
        if let Some((done, dset)) = pending {
            self.shm_copy_out(&mut buf[done], dset);
        }
        Ok(())
    }

    /// Copies the sub-chunks the other ranks reduced from the result area of `set`.
    fn shm_copy_out<T: Elem>(&self, piece: &mut [T], set: usize) {
        let (w, r) = (self.size(), self.rank);
        let seg = self.seg();
        for (j, sub) in split_even(piece.len(), w).into_iter().enumerate() {
            if j != r {
                seg.read(Region { set, slot: w }, sub.start, &mut piece[sub]);
            }
        }
    }

    /// all_gather through shared memory: `out` (blocks of `counts[j]` elements) already holds
    /// this rank's own block.
    pub(crate) fn shm_all_gather_v<T: Elem>(&mut self, c: &Call, own: &[T], counts: &[usize], out: &mut [T]) -> DistResult<()> {
        let (w, r) = (self.size(), self.rank);
        let per = self.seg().slot_bytes() / std::mem::size_of::<T>();
        let starts = crate::collectives::ranges(counts);
        let pieces = counts.iter().max().copied().unwrap_or(0).div_ceil(per).max(1);
        let part = |k: usize, len: usize| (k * per).min(len)..((k + 1) * per).min(len);
        for k in 0..pieces {
            let set = self.next_set();
            self.seg_mut().write(Region { set, slot: r }, 0, &own[part(k, own.len())]);
            self.shm_piece_barrier::<T>(c, k)?;
            let seg = self.seg();
            for j in (0..w).filter(|j| *j != r) {
                let p = part(k, counts[j]);
                let base = starts[j].start;
                seg.read(Region { set, slot: j }, 0, &mut out[base + p.start..base + p.end]);
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
        assert!(per > 0, "a shared-memory reduce_scatter needs a slot of at least W elements");
        let blocks = crate::collectives::ranges(counts);
        let pieces = counts.iter().max().copied().unwrap_or(0).div_ceil(per).max(1);
        let part = |k: usize, len: usize| (k * per).min(len)..((k + 1) * per).min(len);
        for k in 0..pieces {
            let set = self.next_set();
            for (j, b) in blocks.iter().enumerate() {
                let p = part(k, b.len());
                self.seg_mut().write(Region { set, slot: r }, j * per, &input[b.start + p.start..b.start + p.end]);
            }
            self.shm_piece_barrier::<T>(c, k)?;
            let p = part(k, counts[r]);
            let acc = &mut out[p.clone()];
            let seg = self.seg();
            seg.read(Region { set, slot: 0 }, r * per, acc);
            for j in 1..w {
                T::combine(op, acc, seg.view(Region { set, slot: j }, r * per, p.len()));
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
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offers_round_trip() {
        let o = Offer { host: [7; 16], nonce: u128::MAX - 5, slot: 1 << 20, wants: true };
        assert_eq!(Offer::decode(&o.encode()), o);
    }

    #[test]
    fn slots_are_pages_and_segments_bounded() {
        for w in [2, 3, 8, 64, 1000] {
            for want in [1, SLOT_ALIGN, 3 << 20, usize::MAX / 4] {
                let s = slot_for(w, want);
                assert!(s.is_multiple_of(SLOT_ALIGN) && s >= SLOT_ALIGN, "{w} {want}: {s}");
                assert!(segment_bytes(w, s).unwrap() <= MAX_SEGMENT_BYTES.max(segment_bytes(w, SLOT_ALIGN).unwrap()));
            }
        }
    }

    #[test]
    fn segment_names_depend_on_token_group_and_nonce_and_do_not_show_the_token() {
        let a = segment_path("secret-token", "world", 1);
        assert_ne!(a, segment_path("secret-token", "world", 2));
        assert_ne!(a, segment_path("other", "world", 1));
        assert_ne!(a, segment_path("secret-token", "world/1", 1));
        assert!(!a.to_string_lossy().contains("secret"));
        assert!(a.starts_with(SHM_DIR));
    }
}
