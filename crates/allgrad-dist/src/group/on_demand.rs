//! Connections on demand: a group of ALLGRAD_ON_DEMAND_FROM ranks or more connects at
//! formation only to its parent and children in the binomial tree (`cpu::tree`) and to its
//! neighbours on the ring (r - 1 and r + 1, which the ring all_reduce, all_gather and
//! reduce_scatter of large messages over TCP use at every call), and opens any other
//! connection the first time a call needs it ([`Mesh::ensure_connected`]).
//!
//! The rule is the one of formation: of the two ranks of a pair, the higher one connects and
//! the lower one accepts. Each rank's listener stays open for the life of the group, served
//! by one thread ([`Acceptor`]) that authenticates each connection as formation does (the job
//! token and the group's name, both ways, on a short-lived thread per handshake, so that a
//! connection that sends nothing holds up no other) and hands it to the group. A connection
//! with another token or group, from a rank that is not a higher member, or from a rank that
//! already connected, is refused (closed before any reply) and logged.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::cpu::mesh::{Mesh, Opener};
use crate::cpu::tree::tree_links;
use crate::error::{DistError, DistResult};
use crate::wire::{self, same_secret, Hello, Service};

/// How long an accepted connection may take to present its handshake.
const HANDSHAKE_GRACE: Duration = Duration::from_secs(10);

/// The group ranks that rank `r` of a group of `w` connects to at formation: its parent and
/// children in the binomial tree and its two neighbours on the ring, in increasing order.
pub(crate) fn formation_peers(r: usize, w: usize) -> Vec<usize> {
    let (parent, kids) = tree_links(r, w);
    let mut out: Vec<usize> = parent.into_iter().chain(kids).chain([(r + 1) % w, (r + w - 1) % w]).filter(|p| *p != r).collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// What the accepting thread of one group hands to the group, and what it refused.
pub(crate) struct Inbox {
    state: Mutex<InboxState>,
    came: Condvar,
    stop: AtomicBool,
    refused: AtomicU64,
}

struct InboxState {
    /// Per group rank, a connection that came and that the group has not taken yet.
    ready: Vec<Option<TcpStream>>,
    /// Per group rank, whether it connected already (a second connection is refused).
    seen: Vec<bool>,
    /// Once the group failed: the ABORT frame every connection that comes is answered with.
    abort: Option<Vec<u8>>,
}

impl Inbox {
    /// Connections refused so far (a wrong token or group, an unexpected or repeated rank).
    #[cfg(test)]
    pub(crate) fn refused(&self) -> u64 {
        self.refused.load(Ordering::SeqCst)
    }

    /// Takes the connection of group rank `p` if it has come; whether it had.
    #[cfg(test)]
    pub(crate) fn take_for_test(&self, p: usize) -> bool {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).ready[p].take().is_some()
    }
}

/// The listener of one rank of a group that connects on demand, and the thread that serves it
/// for the life of the group. Dropping it stops the thread (within a tenth of a second) and
/// closes the listener.
pub(crate) struct Acceptor {
    inbox: Arc<Inbox>,
    /// This rank's group rank.
    me: usize,
}

impl Acceptor {
    /// Serves `listener` for group rank `me` of `members` (global ranks) of `group`: accepts
    /// connections from the higher members that present `token` and `group`, answering each
    /// with `hello`.
    pub(crate) fn start(listener: TcpListener, hello: Hello, me: usize, members: &[usize]) -> DistResult<Acceptor> {
        listener.set_nonblocking(true).map_err(|e| DistError::io("data-plane listener", e))?;
        let n = members.len();
        let inbox = Arc::new(Inbox {
            state: Mutex::new(InboxState { ready: (0..n).map(|_| None).collect(), seen: vec![false; n], abort: None }),
            came: Condvar::new(),
            stop: AtomicBool::new(false),
            refused: AtomicU64::new(0),
        });
        let shared = Arc::new(Shared { inbox: inbox.clone(), hello, me, members: members.to_vec() });
        std::thread::Builder::new()
            .name("allgrad-accept".into())
            .spawn(move || serve(listener, shared))
            .map_err(|e| DistError::io("starting the thread that accepts connections", e))?;
        Ok(Acceptor { inbox, me })
    }

    #[cfg(test)]
    pub(crate) fn inbox(&self) -> &Arc<Inbox> {
        &self.inbox
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        self.inbox.stop.store(true, Ordering::SeqCst);
        let mut st = self.inbox.state.lock().unwrap_or_else(|p| p.into_inner());
        for s in st.ready.iter_mut().filter_map(Option::take) {
            close_gently(&s);
        }
    }
}

/// Closes a connection no call has read from, reading what came first: closing a socket with
/// unread input makes the kernel send a reset, which can make the peer lose an ABORT frame
/// still queued for it.
fn close_gently(mut s: &TcpStream) {
    let mut sink = [0u8; 4096];
    let _ = s.set_nonblocking(true);
    for _ in 0..256 {
        match std::io::Read::read(&mut s, &mut sink) {
            Ok(n) if n > 0 => {}
            _ => break,
        }
    }
    let _ = s.shutdown(std::net::Shutdown::Both);
}

/// What the accepting thread and its handshake threads share.
struct Shared {
    inbox: Arc<Inbox>,
    /// This rank's side of the handshake (its token and group are what a peer must present).
    hello: Hello,
    me: usize,
    members: Vec<usize>,
}

fn serve(listener: TcpListener, shared: Arc<Shared>) {
    let group = shared.hello.group.clone();
    while !shared.inbox.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((s, from)) => {
                let shared = shared.clone();
                let spawned =
                    std::thread::Builder::new().name("allgrad-handshake".into()).spawn(move || handshake(s, from, &shared));
                if let Err(e) = spawned {
                    tracing::warn!("{group}: no thread to read the handshake of a connection from {from}: {e}");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                // Wakes at once for a connection; a tenth of a second otherwise, to see `stop`.
                let mut fds = [libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
                let _ = wire::poll(&mut fds, Duration::from_millis(100));
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                // The file limit (EMFILE) and the like: the connecting rank's handshake times
                // out and fails its call naming both ranks; this thread tries again.
                tracing::warn!("{group}: accepting a data-plane connection: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// Reads and checks the handshake of one accepted connection and hands it to the group, or
/// refuses it.
fn handshake(mut s: TcpStream, from: SocketAddr, shared: &Shared) {
    let who = from.to_string();
    let (group, inbox) = (&shared.hello.group, &shared.inbox);
    let deadline = Instant::now() + HANDSHAKE_GRACE;
    let checked = s.set_nonblocking(false).map_err(|e| DistError::io("accepted connection", e)).and_then(|_| {
        let h = Hello::read(&mut s, deadline, &who)?;
        if h.service != Service::Data || !same_secret(&h.token, &shared.hello.token) {
            return Err(DistError::Unauthenticated { addr: who.clone(), detail: "wrong job token".into() });
        }
        if h.group != *group {
            return Err(DistError::Unauthenticated { addr: who.clone(), detail: format!("for group {:?}", h.group) });
        }
        let i = shared.members.iter().position(|m| *m == h.rank as usize).filter(|i| *i > shared.me);
        let Some(i) = i else {
            return Err(DistError::Unauthenticated {
                addr: who.clone(),
                detail: format!("rank {} is not a higher member of the group", h.rank),
            });
        };
        let mut st = inbox.state.lock().unwrap_or_else(|p| p.into_inner());
        if std::mem::replace(&mut st.seen[i], true) {
            return Err(DistError::Unauthenticated { addr: who.clone(), detail: format!("rank {} connected already", h.rank) });
        }
        Ok(i)
    });
    let i = match checked {
        Ok(i) => i,
        Err(e) => {
            inbox.refused.fetch_add(1, Ordering::SeqCst);
            tracing::warn!("refused a connection to the data plane of {group}: {e}");
            return;
        }
    };
    if let Err(e) = wire::write_all_by(&mut s, &shared.hello.encode(), deadline, &who) {
        // The connecting rank fails its call, naming this rank and the cause.
        tracing::warn!("{group}: answering the handshake of rank {}: {e}", shared.members[i]);
        return;
    }
    let mut st = inbox.state.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(abort) = &st.abort {
        // The group failed meanwhile: the peer hears why.
        let _ = std::io::Write::write_all(&mut s, abort);
        let _ = s.shutdown(std::net::Shutdown::Write);
    }
    if !inbox.stop.load(Ordering::SeqCst) {
        st.ready[i] = Some(s);
        inbox.came.notify_all();
    }
}

/// Opens the connections of one rank of a group that connects on demand: connects to lower
/// ranks at the address each published in the store, and takes what its [`Acceptor`] accepted
/// from the higher ones.
pub(crate) struct OnDemand {
    acceptor: Acceptor,
    /// This rank's side of the handshake.
    hello: Hello,
    members: Vec<usize>,
    /// The data-plane address of a group rank (one store `get`).
    address: Box<dyn Addresses>,
    /// Where failures are left for the ranks that find a failed rank gone (the store).
    board: Option<Box<dyn FailureBoard>>,
}

/// Where the data-plane address of each group rank is found (the store).
pub(crate) trait Addresses: Send + Sync {
    /// Group rank `p`'s address, waiting (up to the timeout) until it is published.
    fn address(&self, p: usize) -> DistResult<SocketAddr>;
    /// A run of lookups begins (`true`) or ends: the store keeps one connection open across it.
    fn hold(&self, _on: bool) {}
}

impl<F: Fn(usize) -> DistResult<SocketAddr> + Send + Sync> Addresses for F {
    fn address(&self, p: usize) -> DistResult<SocketAddr> {
        self(p)
    }
}

/// Where the rank that fails a group leaves its reason, and where a rank whose connection to
/// it is refused (it has exited) reads it: the error then names the root cause, not only the
/// rank that is gone.
pub(crate) trait FailureBoard: Send + Sync {
    /// Leaves group rank `rank`'s failure `reason` (best effort).
    fn post(&self, rank: usize, reason: &str);
    /// Group rank `rank`'s failure, if it left one (without waiting).
    fn read(&self, rank: usize) -> Option<String>;
}

impl OnDemand {
    pub(crate) fn new(acceptor: Acceptor, hello: Hello, members: &[usize], address: Box<dyn Addresses>) -> OnDemand {
        OnDemand { acceptor, hello, members: members.to_vec(), address, board: None }
    }

    /// Leaves failures on `board` and reads them there.
    pub(crate) fn with_board(mut self, board: Box<dyn FailureBoard>) -> OnDemand {
        self.board = Some(board);
        self
    }

    /// `err`, with the failure group rank `peer` left on the board, if any.
    fn with_cause(&self, peer: usize, err: DistError) -> DistError {
        match self.board.as_ref().and_then(|b| b.read(peer)) {
            Some(reason) => DistError::Io {
                context: format!("{err}; rank {} had failed: {reason}", self.members[peer]),
                source: std::io::Error::from(std::io::ErrorKind::ConnectionRefused),
            },
            None => err,
        }
    }
}

impl Opener for OnDemand {
    fn dial(&self, peer: usize, deadline: Instant) -> DistResult<TcpStream> {
        let group = &self.hello.group;
        let who = format!("rank {} ({group})", self.members[peer]);
        let target = self.address.address(peer)?;
        let mut s = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match TcpStream::connect_timeout(&target, left.clamp(Duration::from_millis(1), Duration::from_secs(5))) {
                Ok(s) => break s,
                // Its listener is open from before its address is published until the group
                // goes: a refusal means the process is gone.
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                    let err = DistError::io(format!("connecting to {target} (refused: is the process gone?)"), e);
                    return Err(self.with_cause(peer, err));
                }
                Err(e) if Instant::now() < deadline && e.raw_os_error() != Some(libc::EMFILE) => {
                    tracing::debug!("connecting to {who} at {target}: {e}; retrying");
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(DistError::io(format!("connecting to {target}"), e)),
            }
        };
        wire::write_all_by(&mut s, &self.hello.encode(), deadline, &who)?;
        let reply = Hello::read(&mut s, deadline, &who).map_err(|e| {
            let err = DistError::Unauthenticated {
                addr: target.to_string(),
                detail: format!(
                    "no handshake back ({e}): the rank refused this connection (another job token or group, or a \
                     second connection from this rank) or is gone"
                ),
            };
            self.with_cause(peer, err)
        })?;
        if reply.service != Service::Data
            || !same_secret(&reply.token, &self.hello.token)
            || reply.group != *group
            || reply.rank as usize != self.members[peer]
        {
            return Err(DistError::Unauthenticated { addr: target.to_string(), detail: format!("expected {who} of this job") });
        }
        Ok(s)
    }

    fn dialing(&self, on: bool) {
        self.address.hold(on);
    }

    fn take(&self, peer: usize) -> Option<TcpStream> {
        let mut st = self.acceptor.inbox.state.lock().unwrap_or_else(|p| p.into_inner());
        st.ready[peer].take()
    }

    fn take_all(&self) -> Vec<(usize, TcpStream)> {
        let mut st = self.acceptor.inbox.state.lock().unwrap_or_else(|p| p.into_inner());
        st.ready.iter_mut().enumerate().filter_map(|(p, s)| s.take().map(|s| (p, s))).collect()
    }

    fn poison(&self, reason: &str, abort: &[u8]) {
        self.acceptor.inbox.state.lock().unwrap_or_else(|p| p.into_inner()).abort = Some(abort.to_vec());
        if let Some(b) = &self.board {
            b.post(self.acceptor.me, reason);
        }
    }

    fn wait(&self, wait: Duration) {
        let inbox = &self.acceptor.inbox;
        let st = inbox.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.ready.iter().all(Option::is_none) {
            let _ = inbox.came.wait_timeout(st, wait);
        }
    }
}

/// Forms rank `me`'s side of a group that connects on demand: the acceptor on `listener`
/// (whose address is in the store already), then the connections along the tree and the ring.
pub(crate) fn form(
    mut mesh: Mesh,
    listener: TcpListener,
    hello: Hello,
    address: Box<dyn Addresses>,
    board: Box<dyn FailureBoard>,
) -> DistResult<Mesh> {
    let (me, n) = (mesh.rank, mesh.size());
    let acceptor = Acceptor::start(listener, hello.clone(), me, &mesh.members)?;
    let opener = OnDemand::new(acceptor, hello, &mesh.members.clone(), address).with_board(board);
    mesh.set_opener(Box::new(opener));
    if let Err(e) = mesh.ensure_connected(&formation_peers(me, n), "forming the group") {
        // Its ABORT frames tell the peers connected so far why.
        return Err(mesh.fail(e));
    }
    Ok(mesh)
}
