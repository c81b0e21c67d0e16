//! The data plane of one process group: a TCP connection to every other member, and a
//! single-threaded engine that drives many sends and receives at once with `poll(2)`.
//!
//! Written by hand rather than with an async runtime: the engine is ~300 lines, needs no
//! executor thread, reduces incoming bytes in place while the rest of a message is still
//! arriving, and owns the deadline and failure handling that collectives need.
//!
//! Failure model: the first error on a group poisons it. This rank then sends an ABORT frame
//! with its reason to every peer and shuts its sockets, so peers blocked on it (or on anyone
//! downstream) fail promptly with a message naming the rank that failed.
//!
//! Longer than the project's ~500-line aim on purpose: the engine's state machine (frames in
//! flight, reduction while receiving, deadlines, ABORT handling) is one piece of logic whose
//! invariants span all of it.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

use crate::cpu::segment::Segment;
use crate::error::{DistError, DistResult};
use crate::reduce::dtype_name;
use crate::wire::{self, Header, HEADER_LEN, KIND_ABORT, KIND_DATA, MAX_ABORT_REASON};

/// How long an exchange polls without sleeping before it blocks in poll(2): waking a sleeping
/// thread (a halted virtual CPU, often) costs more than a short wait.
const BUSY_POLL: Duration = Duration::from_micros(100);

/// Collective op codes carried in frame headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum OpCode {
    Barrier = 1,
    AllReduce = 2,
    AllGather = 3,
    ReduceScatter = 4,
    Broadcast = 5,
    Reduce = 6,
    AllToAll = 7,
    SendRecv = 8,
    /// The exchanges that set a new group up (host detection, shared memory).
    Setup = 9,
    /// A permutation of the ranks' tensors: each rank sends to one rank, receives from one.
    Permute = 10,
    /// One exchange of a ring pass: each rank sends to and receives from the peers the pass's
    /// schedule names, with sizes known from the pass's one check.
    Ring = 11,
}

pub(crate) fn op_name(code: u8) -> &'static str {
    match code {
        1 => "barrier",
        2 => "all_reduce",
        3 => "all_gather",
        4 => "reduce_scatter",
        5 => "broadcast",
        6 => "reduce",
        7 => "all_to_all",
        8 => "send/recv",
        9 => "group setup",
        10 => "permute",
        11 => "ring exchange",
        _ => "unknown op",
    }
}

fn redop_name(code: u8) -> &'static str {
    match code {
        1 => "sum",
        2 => "avg",
        3 => "prod",
        4 => "max",
        5 => "min",
        _ => "",
    }
}

/// The step number of the frame that announces a collective whose data goes through shared
/// memory (see `shm::ops`): a header without payload, checked like any other.
pub(crate) const SHM_STEP: u32 = u32::MAX;

/// The step number of the frame that announces a collective whose data goes through NCCL
/// (the `nccl` backend): a header without payload, checked like any other.
pub(crate) const NCCL_STEP: u32 = u32::MAX - 1;

/// How a header reads to a person.
pub(crate) fn describe(h: &Header) -> String {
    let red = redop_name(h.redop);
    let red = if red.is_empty() { String::new() } else { format!("({red})") };
    // Barriers and setup frames carry no dtype.
    let of = if h.dtype == 0 { String::new() } else { format!(" of {}", dtype_name(h.dtype)) };
    if h.step == SHM_STEP {
        return format!("{}{red}{of} (call #{}, through shared memory, shape digest {:016x})", op_name(h.op), h.seq, h.meta);
    }
    if h.step == NCCL_STEP {
        return format!("{}{red}{of} (call #{}, through NCCL, shape digest {:016x})", op_name(h.op), h.seq, h.meta);
    }
    format!("{}{red}{of} (call #{}, step {}, {} bytes, shape digest {:016x})", op_name(h.op), h.seq, h.step, h.len, h.meta)
}

/// One outgoing frame.
pub(crate) struct SendOp<'a> {
    pub peer: usize,
    pub header: Header,
    pub data: &'a [u8],
}

/// Reduces `incoming` bytes (whole elements) into `acc`.
pub(crate) type Combine<'f> = &'f dyn Fn(&mut [u8], &[u8]);

/// One expected incoming frame. Its bytes land in `data`; with `acc`, they are also combined
/// into `acc` (same length) as they arrive.
pub(crate) struct RecvOp<'a, 'f> {
    pub peer: usize,
    pub expect: Header,
    pub data: &'a mut [u8],
    pub acc: Option<(&'a mut [u8], Combine<'f>, usize)>,
}

/// Connections of one group, indexed by group rank (`None` at this rank's own index).
pub(crate) struct Mesh {
    pub group: String,
    pub rank: usize,
    /// Global rank of each group member.
    pub members: Vec<usize>,
    peers: Vec<Option<TcpStream>>,
    pub timeout: Duration,
    /// The first error on this group, and whether another rank caused it.
    failure: Option<(String, bool)>,
    /// Peers to which a frame is half written: an ABORT frame must not be sent to them.
    mid_frame: Vec<bool>,
    /// Scratch memory reused across calls (grow-only, 8-byte aligned): fresh large buffers
    /// on every call would cost a page fault per 4 KiB.
    scratch: Vec<u64>,
    /// The group's shared-memory segment, when every member runs on this host (see `shm::ops`).
    pub shm: Option<Segment>,
    /// How many all_reduce calls took each path (tests observe the path through it).
    pub paths: AllReducePaths,
    /// How many broadcast and reduce calls took each path (tests observe the path through it).
    pub rooted_paths: RootedPaths,
    /// How many all_to_all and barrier calls took each path (tests observe the path through it).
    pub pairwise_paths: PairwisePaths,
    /// Frames and poll(2) calls of this group so far (benchmarks count them).
    pub counts: WireCounts,
    /// Groups of at least this many ranks take the binomial tree (`tree`).
    pub tree_from: usize,
    /// How many connections a rank waiting on something else than TCP looks at each time
    /// for a dead or failed peer ([`PeerWatch`], ALLGRAD_PEER_WINDOW).
    pub peer_window: usize,
    /// Per peer, the send and receive of the exchange in progress and its slot in the poll
    /// set, so that an exchange finds them without a search (it may have W - 1 of each).
    index: Vec<PeerIndex>,
    /// What opens the connections not made at formation, in groups that connect on demand
    /// (`group::on_demand`); `None` where every pair connected at formation.
    opener: Option<Box<dyn Opener>>,
}

/// What opens a group's connections when a call first needs them (`group::on_demand`). The
/// higher group rank of a pair connects, the lower one accepts: both ends of an exchange name
/// each other, so both know at the same call that the connection is needed.
pub(crate) trait Opener: Send {
    /// Connects to the lower group rank `peer` and authenticates both ways, before `deadline`.
    fn dial(&self, peer: usize, deadline: Instant) -> DistResult<TcpStream>;
    /// A run of dials begins (`true`) or ends (`false`): what the dials read their peers'
    /// addresses from (the store) may keep one connection open across it.
    fn dialing(&self, _on: bool) {}
    /// The authenticated connection the higher group rank `peer` opened, once it has come.
    fn take(&self, peer: usize) -> Option<TcpStream>;
    /// Waits at most `wait` for a connection to come.
    fn wait(&self, wait: Duration);
    /// Every connection that has come and not been taken, by group rank.
    fn take_all(&self) -> Vec<(usize, TcpStream)>;
    /// The group failed for `reason`: every connection that comes from now on is answered
    /// with the handshake and then `abort` (an ABORT frame), and closed for writing; and the
    /// reason is left where a rank that finds this one gone can read it (the store).
    fn poison(&self, reason: &str, abort: &[u8]);
}

/// The connections a rank that waits for something else than its TCP connections (a
/// shared-memory barrier, an NCCL call) looks at for a dead or failed peer, a window of them
/// at each look: look k of group rank r covers the `window` group ranks from
/// r + 1 + k * window on, modulo the group size W. So at every look each peer is in the window
/// of exactly `window` ranks (the first to see it dead tells the others), and a rank has
/// looked at all of its connections every W / window looks (rounded up). Looking at all of them at every
/// look costs a poll(2) over W - 1 descriptors, which for a thousand ranks is more work than
/// what they wait for.
pub(crate) struct PeerWatch {
    rank: usize,
    window: usize,
    size: usize,
    /// Looks so far.
    looks: usize,
}

impl PeerWatch {
    /// Group rank `rank`'s watch over a group of `size` ranks, `window` connections a look.
    pub(crate) fn new(rank: usize, window: usize, size: usize) -> PeerWatch {
        // A window of W covers every rank at every look: wider ones look the same.
        PeerWatch { rank, window: window.clamp(1, size.max(1)), size: size.max(1), looks: 0 }
    }

    /// The group ranks look `k` covers (it may include this rank, which has no connection).
    pub(crate) fn covers(&self, k: usize) -> impl Iterator<Item = usize> {
        let (w, window) = (self.size, self.window);
        // (r + 1 + k * window) mod W, without overflow however long the wait.
        let first = (self.rank + 1 + (k % w) * window) % w;
        (0..window).map(move |i| (first + i) % w)
    }

    /// Looks at the next window of `mesh`'s connections and moves on.
    pub(crate) fn look(&mut self, mesh: &Mesh, what: &str) -> Option<DistError> {
        // A group that connects on demand may hold fewer connections than a window: then every
        // look covers all of them, rather than a window of mostly unconnected ranks.
        let failed = if mesh.opener.is_some() && mesh.connections() <= self.window {
            mesh.peer_failure(what)
        } else {
            mesh.peer_failure_among(what, self.covers(self.looks))
        };
        self.looks += 1;
        failed
    }
}

/// Where one peer's send, receive and pollfd sit in the exchange in progress.
#[derive(Clone, Copy)]
struct PeerIndex {
    send: u32,
    recv: u32,
    fd: u32,
}

impl PeerIndex {
    const NONE: u32 = u32::MAX;
    const UNUSED: PeerIndex = PeerIndex { send: Self::NONE, recv: Self::NONE, fd: Self::NONE };
}

/// Frames this rank exchanged on one group's connections, and the poll(2) calls spent
/// waiting for them: what a benchmark reads to count the messages a collective costs
/// ([`crate::ProcessGroup::wire_counts`]).
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WireCounts {
    /// Frames sent (each with its header; payloads of any size).
    pub frames_sent: u64,
    /// Frames received.
    pub frames_received: u64,
    /// poll(2) calls made while exchanging frames.
    pub polls: u64,
}

/// How many all_reduce calls of a group took each path: what tests read to see the path a
/// call took ([`crate::ProcessGroup::all_reduce_paths`]).
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllReducePaths {
    /// Small messages: every rank sends its whole input to every other over TCP.
    pub direct: u64,
    /// Large messages over TCP: reduce-scatter then all-gather around the ring.
    pub ring: u64,
    /// Large messages through the host's shared-memory segment.
    pub shared_memory: u64,
    /// Small and medium messages in large groups: up and down a binomial tree (small
    /// reduce_scatter calls of such groups, which run a tree all_reduce, count here too).
    pub tree: u64,
}

/// Which path each broadcast and reduce of a group took
/// ([`crate::ProcessGroup::rooted_paths`]).
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RootedPaths {
    /// Small broadcasts: the root sends to every other rank, in one round.
    pub broadcast_direct: u64,
    /// Small broadcasts of large groups: log2(W) rounds down a binomial tree rooted at the root.
    pub broadcast_tree: u64,
    /// Large broadcasts: a pipelined chain from the root.
    pub broadcast_chain: u64,
    /// Small reduces: every rank sends to the root, in one round.
    pub reduce_direct: u64,
    /// Small reduces of large groups: log2(W) rounds up the binomial tree of the all_reduce.
    pub reduce_tree: u64,
    /// Large reduces: a ring reduce-scatter, then each rank's block to the root.
    pub reduce_ring: u64,
}

/// Which path each all_to_all and barrier of a group took, calls in which every rank hears
/// from every other ([`crate::ProcessGroup::pairwise_paths`]). Groups of one rank count none.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PairwisePaths {
    /// all_to_all of groups below the tree's threshold: every rank sends every other its
    /// block's size, then the block, each in one round.
    pub all_to_all_direct: u64,
    /// all_to_all of large groups with small blocks: a check up the tree, then sizes, then
    /// blocks, in Bruck's log2(W) rounds each.
    pub all_to_all_bruck: u64,
    /// all_to_all of large groups with a large block somewhere: a check up the tree, sizes in
    /// Bruck's rounds, then every block straight to its rank in one round.
    pub all_to_all_bruck_sizes: u64,
    /// Barriers of groups below the tree's threshold: one round, every rank to every other.
    pub barrier_direct: u64,
    /// Barriers of large groups: up and down the binomial tree, 2 log2(W) rounds.
    pub barrier_tree: u64,
}

impl Mesh {
    pub fn new(group: String, rank: usize, members: Vec<usize>, peers: Vec<Option<TcpStream>>, timeout: Duration) -> Mesh {
        let n = peers.len();
        Mesh {
            group,
            rank,
            members,
            peers,
            timeout,
            failure: None,
            mid_frame: vec![false; n],
            scratch: Vec::new(),
            shm: None,
            paths: AllReducePaths::default(),
            rooted_paths: RootedPaths::default(),
            pairwise_paths: PairwisePaths::default(),
            counts: WireCounts::default(),
            tree_from: crate::settings::DEFAULT_TREE_FROM,
            peer_window: crate::settings::DEFAULT_PEER_WINDOW,
            index: vec![PeerIndex::UNUSED; n],
            opener: None,
        }
    }

    /// Makes this group open the connections it lacks when a call first needs them.
    pub(crate) fn set_opener(&mut self, opener: Box<dyn Opener>) {
        self.opener = Some(opener);
    }

    /// How many peers this rank has a connection to.
    pub fn connections(&self) -> usize {
        self.peers.iter().flatten().count()
    }

    /// Opens the connections to the group ranks `wanted` that this rank lacks (groups that
    /// connect on demand), as an exchange without frames: see [`Mesh::connect_lower`].
    pub(crate) fn ensure_connected(&mut self, wanted: &[usize], what: &str) -> DistResult<()> {
        let waiting = self.connect_lower(wanted)?;
        self.exchange_inner(&mut [], &mut [], what, waiting)
    }

    /// Of the group ranks `wanted` that this rank has no connection to, connects to the lower
    /// ones (the higher rank of a pair connects) and returns the higher ones, which the
    /// exchange waits for ([`Mesh::exchange_inner`]): both ends of every exchange name each
    /// other, so each knows at the same call that the connection is needed. A connection that
    /// cannot be opened fails with [`DistError::Connect`] naming both ranks and the cause.
    fn connect_lower(&mut self, wanted: &[usize]) -> DistResult<Vec<usize>> {
        let r = self.rank;
        let mut missing: Vec<usize> = wanted.iter().copied().filter(|p| *p != r && self.peers[*p].is_none()).collect();
        if missing.is_empty() {
            return Ok(missing);
        }
        missing.sort_unstable();
        missing.dedup();
        let me = self.members[r];
        let Some(opener) = self.opener.take() else {
            return Err(DistError::Invalid(format!(
                "group {}: rank {me} has no connection to rank {}",
                self.group, self.members[missing[0]]
            )));
        };
        let deadline = Instant::now() + self.timeout;
        let mut res = Ok(());
        let dials = missing.iter().any(|p| *p < r);
        if dials {
            opener.dialing(true);
        }
        for &p in missing.iter().filter(|p| **p < r) {
            res = opener
                .dial(p, deadline)
                .map_err(|e| DistError::Connect {
                    rank: me,
                    peer: self.members[p],
                    group: self.group.clone(),
                    cause: e.to_string(),
                })
                .and_then(|s| self.adopt(p, s));
            if res.is_err() {
                break;
            }
        }
        if dials {
            opener.dialing(false);
        }
        self.opener = Some(opener);
        res.map(|_| missing.into_iter().filter(|p| *p > r).collect())
    }

    /// Adopts the connections of `waiting` (higher group ranks) that have come, dropping them
    /// from the list.
    fn take_arrived(&mut self, waiting: &mut Vec<usize>) -> DistResult<()> {
        let mut i = 0;
        while i < waiting.len() {
            match self.opener.as_ref().and_then(|o| o.take(waiting[i])) {
                Some(s) => self.adopt(waiting.swap_remove(i), s)?,
                None => i += 1,
            }
        }
        Ok(())
    }

    /// An ABORT frame at the front of the connection of a peer that `busy` does not name (the
    /// peers an exchange is reading a frame from look for theirs as they read).
    fn abort_among_idle(&self, busy: impl Fn(usize) -> bool) -> Option<DistError> {
        let mut fds: Vec<libc::pollfd> = Vec::new();
        let mut fd_peer: Vec<usize> = Vec::new();
        for (p, s) in self.peers.iter().enumerate() {
            if let Some(s) = s.as_ref().filter(|_| !busy(p)) {
                fds.push(wire::pollfd(s, libc::POLLIN));
                fd_peer.push(p);
            }
        }
        if wire::poll(&mut fds, Duration::ZERO).ok()? == 0 {
            return None;
        }
        fds.iter().zip(&fd_peer).filter(|(fd, _)| fd.revents != 0).find_map(|(_, &p)| self.pending_abort(p))
    }

    /// Makes `s` this rank's connection to group rank `peer`.
    fn adopt(&mut self, peer: usize, s: TcpStream) -> DistResult<()> {
        s.set_nonblocking(true).map_err(|e| DistError::io("configuring a data-plane socket", e))?;
        wire::tune_data_socket(&s);
        self.peers[peer] = Some(s);
        Ok(())
    }

    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// Takes the scratch buffer, grown to hold at least `bytes`; give it back with
    /// [`Mesh::put_scratch`].
    pub fn take_scratch(&mut self, bytes: usize) -> Vec<u64> {
        let mut s = std::mem::take(&mut self.scratch);
        let words = bytes.div_ceil(8);
        if s.len() < words {
            s.resize(words, 0);
        }
        s
    }

    /// Returns the scratch buffer for the next call.
    pub fn put_scratch(&mut self, s: Vec<u64>) {
        self.scratch = s;
    }

    pub fn failure(&self) -> Option<&(String, bool)> {
        self.failure.as_ref()
    }

    /// Fails fast when an earlier error broke the group.
    pub fn check_usable(&self) -> DistResult<()> {
        match &self.failure {
            None => Ok(()),
            Some((first, _)) => Err(DistError::Poisoned { group: self.group.clone(), first: first.clone() }),
        }
    }

    /// Records `err` as the group's failure, tells every peer, and closes the connections.
    pub fn fail(&mut self, err: DistError) -> DistError {
        if self.failure.is_none() {
            let secondary = err.is_secondary();
            let reason = format!("rank {} failed: {err}", self.members[self.rank]);
            self.failure = Some((err.to_string(), secondary));
            // Connections that came but that no call has taken yet get the ABORT frame too, and
            // so do those still to come: a peer that connected to this rank hears why.
            if let Some(opener) = self.opener.take() {
                for (p, c) in opener.take_all() {
                    let _ = self.adopt(p, c);
                }
                opener.poison(&reason, &abort_frame(&reason));
                self.opener = Some(opener);
            }
            self.broadcast_abort(&reason);
            // Peers waiting at a shared-memory barrier look at this word first (the ABORT frame
            // sent above carries the reason).
            if let Some(seg) = &self.shm {
                seg.raise_abort(self.rank);
            }
        }
        err
    }

    /// Test only: this rank disappears as a killed process would: its connections close
    /// without an ABORT frame and the shared abort word stays down.
    #[cfg(test)]
    pub fn kill_for_test(&mut self) {
        self.failure = Some(("killed by a test".into(), false));
        for s in self.peers.iter().flatten() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// Looks, without blocking, for a peer that sent an ABORT frame or closed its connection;
    /// anything else waiting on a connection is left for the next exchange.
    pub fn peer_failure(&self, what: &str) -> Option<DistError> {
        self.peer_failure_among(what, 0..self.size())
    }

    /// Looks, without blocking, at the connections of the group ranks `peers` only (this
    /// rank's own index is skipped): one poll(2) over a window of the connections instead of
    /// all W - 1 ([`PeerWatch`]).
    pub fn peer_failure_among(&self, what: &str, peers: impl Iterator<Item = usize>) -> Option<DistError> {
        let mut fds: Vec<libc::pollfd> = Vec::with_capacity(peers.size_hint().0);
        let mut fd_peer: Vec<usize> = Vec::with_capacity(fds.capacity());
        for p in peers {
            if let Some(s) = &self.peers[p] {
                fds.push(wire::pollfd(s, libc::POLLIN));
                fd_peer.push(p);
            }
        }
        match wire::poll(&mut fds, Duration::ZERO) {
            Ok(0) => return None,
            Ok(_) => {}
            Err(e) => return Some(DistError::io(format!("poll in {what}"), e)),
        }
        for (fd, &p) in fds.iter().zip(&fd_peer) {
            if fd.revents == 0 {
                continue;
            }
            if let Some(e) = self.pending_abort(p) {
                return Some(e);
            }
            let mut one = [0u8; 1];
            match self.stream(p).peek(&mut one) {
                Ok(0) => return Some(self.peer_closed(p, what, true)),
                Err(e) if is_disconnect(&e) => return Some(self.peer_closed(p, what, true)),
                _ => {}
            }
        }
        None
    }

    /// A fresh [`PeerWatch`] of this rank over the group's connections, with the group's
    /// window (ALLGRAD_PEER_WINDOW).
    pub(crate) fn peer_watch(&self) -> PeerWatch {
        PeerWatch::new(self.rank, self.peer_window, self.size())
    }

    fn broadcast_abort(&mut self, reason: &str) {
        let frame = abort_frame(reason);
        for (p, s) in self.peers.iter_mut().enumerate() {
            let Some(s) = s else { continue };
            // Best effort and never blocking: a peer that cannot take it (or that is in the
            // middle of one of our frames) sees the connection close instead.
            let _ = s.set_nonblocking(true);
            if !self.mid_frame[p] {
                let _ = s.write(&frame);
            }
            let _ = s.shutdown(Shutdown::Write);
        }
    }

    /// The error for a peer whose connection closed. A peer that failed because of another
    /// rank sent an ABORT frame before closing; when that frame is waiting at the front of its
    /// stream, report it (it names the root cause) rather than the close.
    fn peer_closed(&self, peer: usize, during: &str, at_frame_boundary: bool) -> DistError {
        if at_frame_boundary {
            if let Some(e) = self.pending_abort(peer) {
                return e;
            }
        }
        DistError::PeerClosed { peer: self.members[peer], during: during.to_string(), group: self.group.clone() }
    }

    pub fn pending_abort(&self, peer: usize) -> Option<DistError> {
        let s = self.peers[peer].as_ref()?;
        let mut head = [0u8; HEADER_LEN];
        if s.peek(&mut head).ok()? != HEADER_LEN {
            return None;
        }
        let h = Header::decode(&head).filter(|h| h.kind == KIND_ABORT && h.len <= MAX_ABORT_REASON)?;
        let mut buf = vec![0u8; HEADER_LEN + h.len as usize];
        if s.peek(&mut buf).ok()? != buf.len() {
            return None;
        }
        Some(self.aborted(peer, &buf[HEADER_LEN..]))
    }

    /// Sends header `h` (without payload) to every peer and checks theirs against it: ranks
    /// whose calls differ all fail with [`DistError::Mismatch`] naming both calls. Used where
    /// the data itself moves elsewhere (shared memory, NCCL), so that those paths keep the
    /// TCP path's checks. Also a barrier: no rank returns before every peer has sent. Large
    /// groups check through a tree instead ([`Mesh::tree_agree`]).
    pub fn exchange_header(&mut self, h: Header, what: &str) -> DistResult<()> {
        if self.uses_tree() {
            return self.tree_agree(h, what);
        }
        let (w, r) = (self.size(), self.rank);
        let mut sends: Vec<SendOp> = (0..w).filter(|p| *p != r).map(|p| SendOp { peer: p, header: h, data: &[] }).collect();
        let mut recvs: Vec<RecvOp> =
            (0..w).filter(|p| *p != r).map(|p| RecvOp { peer: p, expect: h, data: &mut [], acc: None }).collect();
        self.exchange(&mut sends, &mut recvs, what)
    }

    /// Runs `sends` and `recvs` to completion, concurrently, before the group's deadline.
    /// At most one send and one receive per peer. `what` describes this rank's call for
    /// error messages. On error the group is poisoned (see [`Mesh::fail`]).
    pub fn exchange(&mut self, sends: &mut [SendOp], recvs: &mut [RecvOp], what: &str) -> DistResult<()> {
        self.check_usable()?;
        let mut waiting = Vec::new();
        if self.opener.is_some() {
            let peers = sends.iter().map(|s| s.peer).chain(recvs.iter().map(|r| r.peer));
            if peers.clone().any(|p| self.peers[p].is_none()) {
                let wanted: Vec<usize> = peers.collect();
                waiting = self.connect_lower(&wanted).map_err(|e| self.fail(e))?;
            }
        }
        for (i, s) in sends.iter().enumerate() {
            self.index[s.peer].send = i as u32;
        }
        for (i, r) in recvs.iter().enumerate() {
            self.index[r.peer].recv = i as u32;
        }
        let r = self.exchange_inner(sends, recvs, what, waiting);
        for p in sends.iter().map(|s| s.peer).chain(recvs.iter().map(|r| r.peer)) {
            self.index[p] = PeerIndex::UNUSED;
        }
        r.map_err(|e| self.fail(e))
    }

    /// Adds `ev` to the peer's entry of the poll set, making one if it has none yet.
    fn poll_for(&mut self, fds: &mut Vec<libc::pollfd>, fd_peer: &mut Vec<usize>, peer: usize, ev: libc::c_short) {
        let k = self.index[peer].fd;
        if k != PeerIndex::NONE {
            fds[k as usize].events |= ev;
        } else {
            self.index[peer].fd = fds.len() as u32;
            fds.push(wire::pollfd(self.stream(peer), ev));
            fd_peer.push(peer);
        }
    }

    /// The exchange proper. `waiting`: peers of the exchange whose connections have not come
    /// yet (groups that connect on demand); their sends and receives start once they come,
    /// the others' meanwhile, and any ABORT frame on this rank's other connections fails the
    /// wait (a rank that could not open a connection floods its failure through the ones it
    /// holds).
    fn exchange_inner(
        &mut self,
        sends: &mut [SendOp],
        recvs: &mut [RecvOp],
        what: &str,
        mut waiting: Vec<usize>,
    ) -> DistResult<()> {
        let deadline = Instant::now() + self.timeout;
        let busy_until = Instant::now() + BUSY_POLL;
        // Per send: bytes of (header + data) written. Per receive: state.
        let send_frames: Vec<[u8; HEADER_LEN]> = sends.iter().map(|s| s.header.encode()).collect();
        let mut sent = vec![0usize; sends.len()];
        let mut rs: Vec<RecvState> = recvs.iter().map(|_| RecvState::default()).collect();
        let mut fds: Vec<libc::pollfd> = Vec::with_capacity(sends.len() + recvs.len());
        let mut fd_peer: Vec<usize> = Vec::with_capacity(fds.capacity());

        loop {
            if !waiting.is_empty() {
                self.take_arrived(&mut waiting)?;
            }
            for &p in &fd_peer {
                self.index[p].fd = PeerIndex::NONE;
            }
            fds.clear();
            fd_peer.clear();
            // Peers still to connect (`waiting`) have no connection to poll yet.
            let connecting = !waiting.is_empty();
            for (i, s) in sends.iter().enumerate() {
                let connected = !connecting || self.peers[s.peer].is_some();
                if sent[i] < HEADER_LEN + s.data.len() && connected {
                    self.poll_for(&mut fds, &mut fd_peer, s.peer, libc::POLLOUT);
                }
            }
            for (i, r) in recvs.iter().enumerate() {
                let connected = !connecting || self.peers[r.peer].is_some();
                if !rs[i].done && connected {
                    self.poll_for(&mut fds, &mut fd_peer, r.peer, libc::POLLIN);
                }
            }
            if fds.is_empty() && !connecting {
                self.counts.frames_sent += sends.len() as u64;
                self.counts.frames_received += recvs.len() as u64;
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let mut ranks: Vec<usize> = fd_peer.iter().map(|p| self.members[*p]).collect();
                ranks.dedup();
                let mut what = format!("in {what} on group {}", self.group);
                if !ranks.is_empty() {
                    what += &format!(", waiting for rank(s) {ranks:?}");
                }
                if connecting {
                    waiting.sort_unstable();
                    let late: Vec<usize> = waiting.iter().map(|p| self.members[*p]).collect();
                    let me = self.members[self.rank];
                    what += &format!(", waiting for rank(s) {late:?} to open their connections to rank {me}");
                }
                return Err(DistError::Timeout { what, timeout: self.timeout });
            }
            self.counts.polls += 1;
            if connecting {
                let index = &self.index;
                let reading = |p: usize| index[p].recv != PeerIndex::NONE && !rs[index[p].recv as usize].done;
                if let Some(e) = self.abort_among_idle(reading) {
                    return Err(e);
                }
                // Looks for new connections every few milliseconds.
                let wait = left.min(Duration::from_millis(5));
                if fds.is_empty() {
                    if let Some(o) = self.opener.as_ref() {
                        o.wait(wait);
                    }
                    continue;
                }
                wire::poll(&mut fds, wait).map_err(|e| DistError::io(format!("poll in {what}"), e))?;
            } else if Instant::now() < busy_until {
                // A peer a few microseconds behind is cheaper to wait for awake than asleep.
                let ready = wire::poll(&mut fds, Duration::ZERO).map_err(|e| DistError::io(format!("poll in {what}"), e))?;
                if ready == 0 {
                    std::thread::yield_now();
                    continue;
                }
            } else {
                wire::poll(&mut fds, left.min(Duration::from_millis(500)))
                    .map_err(|e| DistError::io(format!("poll in {what}"), e))?;
            }

            for (k, fd) in fds.iter().enumerate() {
                if fd.revents == 0 {
                    continue;
                }
                let peer = fd_peer[k];
                let (si, ri) = (self.index[peer].send, self.index[peer].recv);
                let readable = fd.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0;
                let writable = fd.revents & (libc::POLLOUT | libc::POLLHUP | libc::POLLERR) != 0;
                if readable && ri != PeerIndex::NONE {
                    let i = ri as usize;
                    if !rs[i].done {
                        self.pump_recv(&mut recvs[i], &mut rs[i], what)?;
                    }
                }
                if writable && fd.events & libc::POLLOUT != 0 && si != PeerIndex::NONE {
                    let i = si as usize;
                    // Whether this rank is part-way through reading a frame from the same peer.
                    let reading = ri != PeerIndex::NONE && {
                        let st = &rs[ri as usize];
                        !st.done && (st.phase != Phase::Header || st.got > 0)
                    };
                    self.pump_send(&sends[i], &send_frames[i], &mut sent[i], what, reading)?;
                }
            }
        }
    }

    fn stream(&self, peer: usize) -> &TcpStream {
        self.peers[peer].as_ref().expect("no connection to self")
    }

    fn pump_send(
        &mut self,
        s: &SendOp,
        header: &[u8; HEADER_LEN],
        sent: &mut usize,
        what: &str,
        reading_mid_frame: bool,
    ) -> DistResult<()> {
        let r = self.pump_send_inner(s, header, sent, what, reading_mid_frame);
        self.mid_frame[s.peer] = *sent > 0 && *sent < HEADER_LEN + s.data.len();
        r
    }

    fn pump_send_inner(
        &self,
        s: &SendOp,
        header: &[u8; HEADER_LEN],
        sent: &mut usize,
        what: &str,
        reading_mid_frame: bool,
    ) -> DistResult<()> {
        let mut stream = self.stream(s.peer);
        let total = HEADER_LEN + s.data.len();
        while *sent < total {
            let res = if *sent < HEADER_LEN {
                if s.data.len() <= 64 * 1024 && *sent == 0 {
                    // Small frames go out in one segment.
                    let mut b = Vec::with_capacity(total);
                    b.extend_from_slice(header);
                    b.extend_from_slice(s.data);
                    stream.write(&b)
                } else {
                    stream.write(&header[*sent..])
                }
            } else {
                stream.write(&s.data[*sent - HEADER_LEN..])
            };
            match res {
                Ok(0) => return Err(self.peer_closed(s.peer, what, !reading_mid_frame)),
                Ok(n) => *sent += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if is_disconnect(&e) => return Err(self.peer_closed(s.peer, what, !reading_mid_frame)),
                Err(e) => return Err(DistError::io(format!("sending to rank {} in {what}", self.members[s.peer]), e)),
            }
        }
        Ok(())
    }

    fn pump_recv(&self, r: &mut RecvOp, st: &mut RecvState, what: &str) -> DistResult<()> {
        let mut stream = self.stream(r.peer);
        loop {
            let res = match st.phase {
                Phase::Header => stream.read(&mut st.hdr[st.got..]),
                Phase::Body => stream.read(&mut r.data[st.got..]),
                Phase::Abort => stream.read(&mut st.reason[st.got..]),
            };
            let n = match res {
                Ok(0) => return Err(self.peer_closed(r.peer, what, false)),
                Ok(n) => n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) if is_disconnect(&e) => {
                    return Err(self.peer_closed(r.peer, what, st.phase == Phase::Header && st.got == 0))
                }
                Err(e) => return Err(DistError::io(format!("receiving from rank {} in {what}", self.members[r.peer]), e)),
            };
            st.got += n;
            match st.phase {
                Phase::Header if st.got == HEADER_LEN => {
                    let h = Header::decode(&st.hdr).ok_or_else(|| DistError::Protocol {
                        peer: self.members[r.peer],
                        group: self.group.clone(),
                        detail: format!("bad frame magic during {what}"),
                    })?;
                    st.got = 0;
                    if h.kind == KIND_ABORT {
                        if h.len > MAX_ABORT_REASON {
                            return Err(DistError::Protocol {
                                peer: self.members[r.peer],
                                group: self.group.clone(),
                                detail: format!("abort reason of {} bytes (at most {MAX_ABORT_REASON})", h.len),
                            });
                        }
                        st.reason = vec![0; h.len as usize];
                        st.phase = Phase::Abort;
                        if h.len == 0 {
                            return Err(self.aborted(r.peer, &st.reason));
                        }
                        continue;
                    }
                    if h.kind != KIND_DATA
                        || (h.op, h.dtype, h.redop, h.seq, h.step, h.len, h.meta)
                            != (
                                r.expect.op,
                                r.expect.dtype,
                                r.expect.redop,
                                r.expect.seq,
                                r.expect.step,
                                r.expect.len,
                                r.expect.meta,
                            )
                    {
                        return Err(DistError::Mismatch {
                            group: self.group.clone(),
                            rank: self.members[self.rank],
                            ours: format!("{what} [{}]", describe(&r.expect)),
                            peer: self.members[r.peer],
                            theirs: describe(&h),
                        });
                    }
                    // The header matched what this rank expects, so `len` is the buffer it sized.
                    debug_assert_eq!(h.len as usize, r.data.len());
                    if r.data.is_empty() {
                        st.done = true;
                        return Ok(());
                    }
                    st.phase = Phase::Body;
                }
                Phase::Body => {
                    if let Some((acc, combine, elem)) = r.acc.as_mut() {
                        // Combine whole elements as they arrive, in batches, overlapping the
                        // reduction with the rest of the transfer.
                        let ready = st.got - st.got % *elem;
                        if ready - st.reduced >= (256 << 10) || st.got == r.data.len() {
                            combine(&mut acc[st.reduced..ready], &r.data[st.reduced..ready]);
                            st.reduced = ready;
                        }
                    }
                    if st.got == r.data.len() {
                        st.done = true;
                        return Ok(());
                    }
                }
                Phase::Abort if st.got == st.reason.len() => return Err(self.aborted(r.peer, &st.reason)),
                _ => {}
            }
        }
    }

    fn aborted(&self, peer: usize, reason: &[u8]) -> DistError {
        DistError::PeerAborted {
            peer: self.members[peer],
            group: self.group.clone(),
            reason: String::from_utf8_lossy(reason).into_owned(),
        }
    }
}

impl Drop for Mesh {
    fn drop(&mut self) {
        // Closing a socket with unread input makes the kernel send a reset, which can make the
        // peer lose an ABORT frame still queued for it. Drain what has arrived first.
        let mut sink = vec![0u8; 64 << 10];
        for mut s in self.peers.iter().flatten() {
            let _ = s.set_nonblocking(true);
            for _ in 0..1024 {
                match s.read(&mut sink) {
                    Ok(n) if n > 0 => {}
                    _ => break,
                }
            }
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

#[derive(Default, PartialEq, Eq, Clone, Copy)]
enum Phase {
    #[default]
    Header,
    Body,
    Abort,
}

struct RecvState {
    phase: Phase,
    hdr: [u8; HEADER_LEN],
    got: usize,
    reduced: usize,
    reason: Vec<u8>,
    done: bool,
}

impl Default for RecvState {
    fn default() -> Self {
        RecvState { phase: Phase::Header, hdr: [0; HEADER_LEN], got: 0, reduced: 0, reason: Vec::new(), done: false }
    }
}

/// The ABORT frame that carries `reason` (cut to [`MAX_ABORT_REASON`] bytes).
fn abort_frame(reason: &str) -> Vec<u8> {
    let reason = &reason.as_bytes()[..reason.len().min(MAX_ABORT_REASON as usize)];
    let h = Header { kind: KIND_ABORT, len: reason.len() as u64, ..Default::default() };
    let mut frame = h.encode().to_vec();
    frame.extend_from_slice(reason);
    frame
}

fn is_disconnect(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::BrokenPipe
            | ErrorKind::ConnectionReset
            | ErrorKind::ConnectionAborted
            | ErrorKind::UnexpectedEof
            | ErrorKind::NotConnected
    )
}
