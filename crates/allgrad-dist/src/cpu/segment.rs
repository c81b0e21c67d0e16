//! A shared-memory segment for the ranks of one group that run on the same host: the
//! mapping, its control words and raw copies in and out of it. All of this crate's unsafe
//! code for shared memory lives here; the algorithms that use it are in `shm::ops`, the setup
//! of a group's segment in `shm::setup`.
//!
//! Layout (every offset a multiple of 64):
//!
//! ```text
//! 0     header: magic, layout version, group size W, slot bytes, total length
//! 64    arrived     ranks that reached the current barrier (the last one resets it)
//! 128   generation  barriers completed; futex word that waiters sleep on
//! 192   sleepers    waiters currently asleep on `generation` (wake only when > 0)
//! 256   abort       0, or 1 + the group rank of a member that failed
//! 320   epoch[r]    the barrier rank r last reached, one cache line each (diagnostics)
//! CTRL  set 0: W input slots of S bytes, then a result area of S bytes
//!       set 1: the same
//! ```
//!
//! Which region may be read or written when is decided by the protocol in `shm::ops` (every
//! write to a region and every read of it are separated by a barrier); the control words are
//! only ever accessed as atomics. Other processes write the data regions, so this module never
//! hands out a `&[T]` or `&mut [T]` over them: data moves by raw-pointer copies only, and the
//! reductions read a region through a small private buffer ([`Segment::combine_from`]).
//! Every byte offset is computed with overflow checks, and the rank, the regions and the
//! alignment are checked in every build: a bad argument is an error, never a panic or an
//! access outside the mapping.

use std::ffi::CString;
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use crate::error::{DistError, DistResult};
use crate::reduce::{Elem, ReduceOp};

const MAGIC: u64 = u64::from_le_bytes(*b"AGRDSHM\0");
const LAYOUT_VERSION: u32 = 1;
const OFF_ARRIVED: usize = 64;
const OFF_GENERATION: usize = 128;
const OFF_SLEEPERS: usize = 192;
const OFF_ABORT: usize = 256;
const OFF_EPOCH: usize = 320;
/// Slots are multiples of this (a page), so every slot starts page- and element-aligned.
pub(crate) const SLOT_ALIGN: usize = 4096;

/// Bytes of the control area for `w` ranks.
fn control_bytes(w: usize) -> usize {
    (OFF_EPOCH + 64 * w).next_multiple_of(SLOT_ALIGN)
}

/// Total length of a segment for `w` ranks with slots of `slot` bytes.
pub(crate) fn segment_bytes(w: usize, slot: usize) -> Option<usize> {
    slot.checked_mul(w + 1)?.checked_mul(2)?.checked_add(control_bytes(w))
}

/// One mapping of a group's segment.
pub(crate) struct Segment {
    base: *mut u8,
    len: usize,
    w: usize,
    rank: usize,
    slot: usize,
    /// Barriers on the segment's words this rank has passed (the same count on every member).
    epoch: u32,
    /// Barriers of any kind passed, counting the TCP exchanges that act as one (decides which
    /// set of slots the next piece uses).
    phase: u64,
    /// Whether a waiter may spin and yield before it sleeps: only when every member can have
    /// a CPU of its own (see `shm::ops`).
    pub(crate) busy_wait: bool,
}

// SAFETY: the segment owns its mapping (unmapped only in Drop) and holds no thread-bound
// state; every access to the shared bytes goes through `&self`/`&mut self` methods below.
unsafe impl Send for Segment {}

/// Where a region lives: one of the two sets, and a slot of it (`w` is the result area).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Region {
    pub set: usize,
    pub slot: usize,
}

impl Segment {
    /// Creates the segment file at `path` (it must not exist; mode 0600), reserves its memory,
    /// maps it and writes the header. The file stays until [`unlink`] removes it.
    pub fn create(path: &Path, w: usize, rank: usize, slot: usize) -> io::Result<Segment> {
        let len = checked_layout(w, rank, slot)?;
        let c = cpath(path)?;
        // SAFETY: `c` is a NUL-terminated path that outlives the call.
        let fd = unsafe {
            libc::open(c.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC, 0o600)
        };
        let fd = Fd::new(fd)?;
        // SAFETY: a plain syscall on a file descriptor this function owns.
        check(unsafe { libc::ftruncate(fd.0, len as libc::off_t) })?;
        reserve(&fd, len)?;
        let mut seg = Segment::map(&fd, len, w, rank, slot)?;
        seg.write_header();
        Ok(seg)
    }

    /// Opens a segment another rank created, checking that it is a regular file of this user,
    /// private to it, of the expected size and header, before trusting its contents.
    pub fn open(path: &Path, w: usize, rank: usize, slot: usize) -> io::Result<Segment> {
        let len = checked_layout(w, rank, slot)?;
        let c = cpath(path)?;
        // SAFETY: `c` is a NUL-terminated path that outlives the call.
        let fd = Fd::new(unsafe { libc::open(c.as_ptr(), libc::O_RDWR | libc::O_NOFOLLOW | libc::O_CLOEXEC) })?;
        // SAFETY: fstat writes a `stat` into the zeroed struct it is given.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        check(unsafe { libc::fstat(fd.0, &mut st) })?;
        let bad = |why: String| io::Error::new(io::ErrorKind::InvalidData, format!("{}: {why}", path.display()));
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(bad("not a regular file".into()));
        }
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        if st.st_uid != me {
            return Err(bad(format!("owned by uid {}, not {me}", st.st_uid)));
        }
        if st.st_mode & 0o077 != 0 {
            return Err(bad(format!("mode {:o} is open to other users", st.st_mode & 0o777)));
        }
        if st.st_size as u64 != len as u64 {
            return Err(bad(format!("{} bytes, expected {len}", st.st_size)));
        }
        let seg = Segment::map(&fd, len, w, rank, slot)?;
        if !seg.header_matches() {
            return Err(bad("header does not match this group's layout".into()));
        }
        Ok(seg)
    }

    fn map(fd: &Fd, len: usize, w: usize, rank: usize, slot: usize) -> io::Result<Segment> {
        // Pages are faulted in on first touch, not all at once (MAP_POPULATE): a rank touches
        // its own slots and 1/W of the others', while populating the whole segment (up to
        // 256 MiB, 65,536 pages) cost every rank the same work and page tables whatever W,
        // W times over on a host of W ranks; the creator's posix_fallocate already reserved
        // the memory, so a first touch cannot fail.
        let flags = libc::MAP_SHARED;
        // SAFETY: a fresh shared mapping of `len` bytes of a file at least that long; the
        // kernel picks the address.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, flags, fd.0, 0) };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        // Constructed first, so that the mapping is released on the error below too.
        let seg = Segment { base: p.cast(), len, w, rank, slot, epoch: 0, phase: 0, busy_wait: true };
        // Every region and control word is aligned because the base is (page-aligned on every
        // system this runs on); checked in every build, as the safety of the atomics and of
        // the element copies rests on it.
        if !(seg.base as usize).is_multiple_of(SLOT_ALIGN) {
            return Err(io::Error::other(format!("mapping at {:p} is not aligned to {SLOT_ALIGN} bytes", seg.base)));
        }
        Ok(seg)
    }

    fn write_header(&mut self) {
        let words = [MAGIC, LAYOUT_VERSION as u64 | ((self.w as u64) << 32), self.slot as u64, self.len as u64];
        // SAFETY: the header (32 bytes at offset 0) is inside the mapping, and only the creator
        // writes it, before any other rank has been told the segment exists.
        unsafe { std::ptr::copy_nonoverlapping(words.as_ptr().cast::<u8>(), self.base, 32) };
    }

    fn header_matches(&self) -> bool {
        let mut words = [0u64; 4];
        // SAFETY: reads 32 bytes at offset 0 of the mapping into a local array; the creator
        // wrote them before telling this rank the segment exists (over the mesh).
        unsafe { std::ptr::copy_nonoverlapping(self.base, words.as_mut_ptr().cast::<u8>(), 32) };
        words == [MAGIC, LAYOUT_VERSION as u64 | ((self.w as u64) << 32), self.slot as u64, self.len as u64]
    }

    /// Bytes per slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot
    }

    /// Barriers of any kind passed so far.
    pub fn phase(&self) -> u64 {
        self.phase
    }

    /// Counts a barrier that happened elsewhere (an exchange with every peer over TCP).
    pub fn passed_elsewhere(&mut self) {
        self.phase += 1;
    }

    fn word(&self, off: usize) -> &AtomicU32 {
        // Offsets are constants or OFF_EPOCH + 64 * rank with rank < w (checked when the
        // segment is made); checked again in every build, as the reference below rests on it.
        assert!(off + 4 <= control_bytes(self.w) && off.is_multiple_of(64), "control word at {off} outside the control area");
        // SAFETY: `off` is a 64-aligned offset inside the control area of the live mapping
        // (borrowed from `self`, so it cannot outlive it); control words are only ever
        // accessed atomically, by every mapping, and AtomicU32 has the layout of u32.
        unsafe { &*(self.base.add(off) as *const AtomicU32) }
    }

    fn generation(&self) -> &AtomicU32 {
        self.word(OFF_GENERATION)
    }

    /// Arrives at the next barrier; returns the generation that completes it.
    pub fn arrive(&mut self) -> u32 {
        let target = self.epoch.wrapping_add(1);
        self.word(OFF_EPOCH + 64 * self.rank).store(target, Ordering::Release);
        // AcqRel: the last arriver's store to `generation` then publishes every rank's writes
        // made before its own arrival.
        let before = self.word(OFF_ARRIVED).fetch_add(1, Ordering::AcqRel);
        if before as usize + 1 == self.w {
            self.word(OFF_ARRIVED).store(0, Ordering::Relaxed);
            self.generation().store(target, Ordering::SeqCst);
            if self.word(OFF_SLEEPERS).load(Ordering::SeqCst) > 0 {
                futex_wake(self.generation());
            }
        }
        self.epoch = target;
        self.phase += 1;
        target
    }

    /// Whether the barrier completing at `target` is done (everyone's writes before it are then
    /// visible to this rank).
    pub fn passed(&self, target: u32) -> bool {
        self.generation().load(Ordering::Acquire) == target
    }

    /// Sleeps until the barrier completing at `target` is done, another rank raises the abort
    /// word, or `timeout` passes (spurious wakeups are possible).
    pub fn sleep(&self, target: u32, timeout: Duration) {
        let sleepers = self.word(OFF_SLEEPERS);
        sleepers.fetch_add(1, Ordering::SeqCst);
        // Checked after announcing ourselves, so a rank completing the barrier now either sees
        // the sleeper and wakes it, or completed it before this load.
        if !self.passed(target) && self.aborted_by().is_none() {
            futex_wait(self.generation(), target.wrapping_sub(1), timeout);
        }
        sleepers.fetch_sub(1, Ordering::SeqCst);
    }

    /// Group ranks that have not yet reached the barrier completing at `target`.
    pub fn missing(&self, target: u32) -> Vec<usize> {
        (0..self.w).filter(|r| self.word(OFF_EPOCH + 64 * r).load(Ordering::Acquire) != target).collect()
    }

    /// Marks the segment as abandoned by group rank `rank` and wakes every sleeper.
    pub fn raise_abort(&self, rank: usize) {
        let _ = self.word(OFF_ABORT).compare_exchange(0, rank as u32 + 1, Ordering::SeqCst, Ordering::SeqCst);
        futex_wake(self.generation());
    }

    /// The group rank that raised the abort word, if one did.
    pub fn aborted_by(&self) -> Option<usize> {
        match self.word(OFF_ABORT).load(Ordering::SeqCst) {
            0 => None,
            r => Some(r as usize - 1),
        }
    }

    /// Byte offset in the mapping of `count` elements of `T` at element `offset` of a region,
    /// checked (without overflow) against the layout and the alignment of `T`.
    fn range<T>(&self, at: Region, offset: usize, count: usize) -> DistResult<usize> {
        let esz = std::mem::size_of::<T>();
        let bad = |why: String| DistError::Invalid(format!("shared-memory access to {at:?}: {why}"));
        if at.set >= 2 || at.slot > self.w {
            return Err(bad(format!("no such region for {} ranks", self.w)));
        }
        let (Some(off), Some(bytes)) = (offset.checked_mul(esz), count.checked_mul(esz)) else {
            return Err(bad(format!("{count} elements of {esz} bytes at element {offset} overflow")));
        };
        if off.checked_add(bytes).is_none_or(|end| end > self.slot) {
            return Err(bad(format!("{bytes} bytes at {off} overflow a slot of {} bytes", self.slot)));
        }
        // Cannot overflow: the whole layout was checked to fit when the segment was made.
        let start = control_bytes(self.w) + (at.set * (self.w + 1) + at.slot) * self.slot + off;
        if !(self.base as usize + start).is_multiple_of(std::mem::align_of::<T>()) {
            return Err(bad(format!("byte {start} is not aligned for elements of {esz} bytes")));
        }
        Ok(start)
    }

    /// Copies `src` into a region, starting at element `offset`.
    pub fn write<T: bytemuck::Pod>(&mut self, at: Region, offset: usize, src: &[T]) -> DistResult<()> {
        let start = self.range::<T>(at, offset, src.len())?;
        // SAFETY: `range` checked the bytes lie inside the mapping; `src` is private memory, so
        // the two do not overlap. The protocol guarantees no other rank reads or writes these
        // bytes until the next barrier.
        unsafe { copy(src.as_ptr().cast::<u8>(), self.base.add(start), std::mem::size_of_val(src)) };
        Ok(())
    }

    /// Copies from a region, starting at element `offset`, into `dst`.
    pub fn read<T: bytemuck::Pod>(&self, at: Region, offset: usize, dst: &mut [T]) -> DistResult<()> {
        let start = self.range::<T>(at, offset, dst.len())?;
        // SAFETY: inside the mapping (checked); `dst` is private memory (no reference over the
        // mapping is ever made). The protocol guarantees no rank writes these bytes until the
        // next barrier. Any bit pattern is a valid `T` (Pod).
        unsafe { copy(self.base.add(start), dst.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(dst)) };
        Ok(())
    }

    /// `acc[i] = acc[i] op region[offset + i]`: reads the region in small pieces into a private
    /// buffer (a copy that stays in the L1 cache) and combines from there, so that no reference
    /// to memory other processes write is ever made.
    pub fn combine_from<T: Elem>(&self, at: Region, offset: usize, acc: &mut [T], op: ReduceOp) -> DistResult<()> {
        self.range::<T>(at, offset, acc.len())?;
        let mut buf = [T::zeroed(); COMBINE_CHUNK];
        for (k, part) in acc.chunks_mut(COMBINE_CHUNK).enumerate() {
            let tmp = &mut buf[..part.len()];
            self.read(at, offset + k * COMBINE_CHUNK, tmp)?;
            T::combine(op, part, tmp);
        }
        Ok(())
    }
}

/// Elements per piece of [`Segment::combine_from`] (at most 4 KiB of f64).
const COMBINE_CHUNK: usize = 512;

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping created in `map`; no view can outlive `self`.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// Copies `n` bytes between non-overlapping buffers with plain 16-byte vector moves. The C
/// library's memcpy switches to a string instruction (`rep movsb`) from a few KiB up, which
/// some CPUs run several times slower than this loop for the alignments met here (page-aligned
/// segment, heap buffers).
///
/// # Safety
/// `src` must be valid for reads and `dst` for writes of `n` bytes, and they must not overlap.
#[cfg(target_arch = "x86_64")]
unsafe fn copy(src: *const u8, dst: *mut u8, n: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_storeu_si128};
    let mut i = 0;
    while i + 64 <= n {
        // SAFETY: bytes i..i + 64 are in bounds of both buffers (caller's contract); unaligned
        // 16-byte loads and stores (SSE2 is part of x86_64).
        unsafe {
            let s = src.add(i).cast::<__m128i>();
            let d = dst.add(i).cast::<__m128i>();
            let (a, b, c, e) =
                (_mm_loadu_si128(s), _mm_loadu_si128(s.add(1)), _mm_loadu_si128(s.add(2)), _mm_loadu_si128(s.add(3)));
            _mm_storeu_si128(d, a);
            _mm_storeu_si128(d.add(1), b);
            _mm_storeu_si128(d.add(2), c);
            _mm_storeu_si128(d.add(3), e);
        }
        i += 64;
    }
    // SAFETY: the remaining n - i < 64 bytes are in bounds (caller's contract).
    unsafe { std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), n - i) };
}

/// See the x86_64 version.
///
/// # Safety
/// `src` must be valid for reads and `dst` for writes of `n` bytes, and they must not overlap.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn copy(src: *const u8, dst: *mut u8, n: usize) {
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, n) };
}

/// Removes a segment's name (its memory lives on while mapped). Errors are ignored: another
/// member may have removed it first.
pub(crate) fn unlink(path: &Path) {
    if let Ok(c) = cpath(path) {
        // SAFETY: `c` is a NUL-terminated path that outlives the call.
        unsafe { libc::unlink(c.as_ptr()) };
    }
}

/// Reserves the file's memory: with ftruncate alone, the first touch of a page beyond the
/// tmpfs limit would kill the process (SIGBUS) mid-collective; this fails here instead.
#[cfg(target_os = "linux")]
fn reserve(fd: &Fd, len: usize) -> io::Result<()> {
    // SAFETY: a plain syscall on an open file descriptor.
    match unsafe { libc::posix_fallocate(fd.0, 0, len as libc::off_t) } {
        0 => Ok(()),
        e => Err(io::Error::from_raw_os_error(e)),
    }
}

#[cfg(not(target_os = "linux"))]
fn reserve(_: &Fd, _: usize) -> io::Result<()> {
    Ok(())
}

fn checked_layout(w: usize, rank: usize, slot: usize) -> io::Result<usize> {
    if rank >= w {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("rank {rank} is not below the group size {w}")));
    }
    let ok = w >= 2 && w < u32::MAX as usize && slot > 0 && slot.is_multiple_of(SLOT_ALIGN);
    match segment_bytes(w, slot) {
        Some(len) if ok && len <= isize::MAX as usize => Ok(len),
        _ => Err(io::Error::new(io::ErrorKind::InvalidInput, format!("no segment layout for {w} ranks of {slot} bytes"))),
    }
}

fn cpath(path: &Path) -> io::Result<CString> {
    use std::os::unix::ffi::OsStrExt;
    CString::new(path.as_os_str().as_bytes()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in a path"))
}

fn check(r: libc::c_int) -> io::Result<()> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// A file descriptor closed on drop (the mapping outlives it).
struct Fd(libc::c_int);

impl Fd {
    fn new(fd: libc::c_int) -> io::Result<Fd> {
        if fd < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(Fd(fd))
        }
    }
}

impl Drop for Fd {
    fn drop(&mut self) {
        // SAFETY: closes a descriptor this value owns, once.
        unsafe { libc::close(self.0) };
    }
}

/// Sleeps while `word` holds `expected`, for at most `timeout`. Not FUTEX_PRIVATE: the word is
/// shared between processes.
#[cfg(target_os = "linux")]
fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as libc::c_long };
    // SAFETY: FUTEX_WAIT reads the aligned u32 behind `word` (alive for the call) and the
    // timespec on this stack; it never writes user memory. Errors (EAGAIN when the value
    // changed, ETIMEDOUT, EINTR) all mean: look again.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, expected, &ts as *const libc::timespec);
    }
}

#[cfg(target_os = "linux")]
fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE only uses the address of the aligned u32 as a key.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}

#[cfg(not(target_os = "linux"))]
fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    if word.load(Ordering::Acquire) == expected {
        std::thread::sleep(timeout.min(Duration::from_micros(200)));
    }
}

#[cfg(not(target_os = "linux"))]
fn futex_wake(_: &AtomicU32) {}

#[cfg(test)]
mod tests;
