//! The network of a group: the address its data plane binds to, and the authenticated
//! connections between its members: every pair at formation in groups below
//! ALLGRAD_ON_DEMAND_FROM ranks, along the tree and the ring in larger ones (`on_demand`).

use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Context;
use crate::cpu::mesh::Mesh;
use crate::cpu::shm::setup::ShmConfig;
use crate::error::{DistError, DistResult};
use crate::rendezvous::store::StoreClient;
use crate::wire::{self, same_secret, Hello, Service};

/// How long an accepted connection may take to present its handshake.
const HANDSHAKE_GRACE: Duration = Duration::from_secs(10);

pub(super) fn resolve(host: &str, port: u16) -> DistResult<SocketAddr> {
    (host, port)
        .to_socket_addrs()
        .map_err(|e| DistError::io(format!("resolving MASTER_ADDR {host}"), e))?
        .next()
        .ok_or_else(|| DistError::Env(format!("MASTER_ADDR {host} resolves to no address")))
}

/// The local address this rank's data plane binds to: `configured` (ALLGRAD_BIND_ADDR) if
/// set, else the interface the OS would use to reach the master (found without sending a packet).
pub(super) fn bind_ip_toward(configured: Option<IpAddr>, master: &str, port: u16) -> DistResult<IpAddr> {
    if let Some(a) = configured {
        return Ok(a);
    }
    let target = resolve(master, port)?;
    if target.ip().is_loopback() {
        return Ok(target.ip());
    }
    let any: SocketAddr = if target.is_ipv4() { "0.0.0.0:0".parse().unwrap() } else { "[::]:0".parse().unwrap() };
    let probe = UdpSocket::bind(any).map_err(|e| DistError::io("finding the local interface", e))?;
    probe.connect(target).map_err(|e| DistError::io(format!("finding the interface that reaches {master}"), e))?;
    Ok(probe.local_addr().map_err(|e| DistError::io("finding the local interface", e))?.ip())
}

/// Connects this rank to every other member of a group: members publish their listening
/// address in the store, each connects to the lower ranks and accepts the higher ones. Every
/// connection is authenticated with the job token both ways. Then the members find out
/// whether they share this host, and set up shared memory if so (`cpu::shm::ops`).
///
/// A rank accepts (on a thread of its own) while it connects: were it to accept only once
/// connected to every lower rank, rank r could not finish before rank r - 1 began accepting,
/// and forming a group would take W handshakes one after the other.
pub(super) fn connect_mesh(ctx: &Arc<Context>, group: &str, me: usize, members: &[usize]) -> DistResult<Mesh> {
    let info = &ctx.info;
    let store = ctx.store.as_ref().expect("a multi-rank group has a store");
    // One connection to the store for the whole formation.
    let _forming = store.hold();
    let deadline = Instant::now() + info.timeout;
    let n = members.len();
    super::fd_limit::ensure_room(group, n)?;
    let listener = wire::listen(SocketAddr::new(ctx.bind_ip, 0))
        .map_err(|e| DistError::io(format!("binding the data plane on {}", ctx.bind_ip), e))?;
    let addr = listener.local_addr().map_err(|e| DistError::io("data-plane address", e))?;
    store.set(&format!("{group}/addr/{me}"), addr.to_string().as_bytes())?;

    let hello = Hello {
        service: Service::Data,
        rank: members[me] as u32,
        world: n as u32,
        token: info.token.clone(),
        group: group.to_string(),
    };
    if n >= ctx.settings.on_demand_from {
        let mut mesh = Mesh::new(group.to_string(), me, members.to_vec(), (0..n).map(|_| None).collect(), info.timeout);
        mesh.tree_from = ctx.settings.tree_from;
        mesh.peer_window = ctx.settings.peer_window;
        let address = Box::new(StoreAddresses { ctx: ctx.clone(), group: group.to_string(), members: members.to_vec() });
        let board = Box::new(StoreBoard { ctx: ctx.clone(), group: group.to_string() });
        let mut mesh = super::on_demand::form(mesh, listener, hello, address, board)?;
        mesh.setup_shm(&info.token, ShmConfig::from(&ctx.settings))?;
        return Ok(mesh);
    }
    let stop = AtomicBool::new(false);
    let (lower, higher) = std::thread::scope(|scope| {
        let accepting = std::thread::Builder::new()
            .name("allgrad-accept".into())
            .spawn_scoped(scope, || {
                accept_higher(&listener, &hello, &info.token, group, me, members, deadline, info.timeout, &stop)
            })
            .map_err(|e| DistError::io("starting the thread that accepts connections", e));
        let lower = connect_lower(store, &hello, &info.token, group, me, members, deadline);
        // The accepting thread gives up at once when this rank cannot form the group anyway.
        if lower.is_err() {
            stop.store(true, Ordering::SeqCst);
        }
        let higher =
            accepting.and_then(|t| t.join().unwrap_or_else(|_| Err(DistError::Invalid("the accepting thread panicked".into()))));
        (lower, higher)
    });
    let mut peers: Vec<Option<TcpStream>> = lower?.into_iter().map(Some).collect();
    peers.push(None);
    peers.extend((me + 1..n).map(|_| None));
    for (i, s) in higher? {
        peers[i] = Some(s);
    }
    for s in peers.iter().flatten() {
        s.set_nonblocking(true).map_err(|e| DistError::io("configuring a data-plane socket", e))?;
        wire::tune_data_socket(s);
    }
    let mut mesh = Mesh::new(group.to_string(), me, members.to_vec(), peers, info.timeout);
    mesh.tree_from = ctx.settings.tree_from;
    mesh.peer_window = ctx.settings.peer_window;
    mesh.setup_shm(&info.token, ShmConfig::from(&ctx.settings))?;
    Ok(mesh)
}

/// Connects to the lower ranks of the group, in order, and authenticates each; the addresses
/// of all of them come from the store in one request.
fn connect_lower(
    store: &StoreClient,
    hello: &Hello,
    token: &str,
    group: &str,
    me: usize,
    members: &[usize],
    deadline: Instant,
) -> DistResult<Vec<TcpStream>> {
    let addrs = store.get_many(&format!("{group}/addr/"), me)?;
    let mut out = Vec::with_capacity(me);
    for (p, raw) in addrs.iter().enumerate() {
        let who = format!("rank {} ({group})", members[p]);
        let target: SocketAddr = String::from_utf8_lossy(raw).parse().map_err(|_| DistError::Protocol {
            peer: members[p],
            group: group.into(),
            detail: "unreadable address in the store".into(),
        })?;
        let mut s = loop {
            match TcpStream::connect_timeout(&target, Duration::from_secs(5)) {
                Ok(s) => break s,
                Err(e) if Instant::now() < deadline => {
                    tracing::debug!("connecting to {who} at {target}: {e}; retrying");
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(DistError::io(format!("connecting to {who} at {target}"), e)),
            }
        };
        wire::write_all_by(&mut s, &hello.encode(), deadline, &who)?;
        let reply = Hello::read(&mut s, deadline, &who)?;
        if reply.service != Service::Data
            || !same_secret(&reply.token, token)
            || reply.group != group
            || reply.rank as usize != members[p]
        {
            return Err(DistError::Unauthenticated { addr: target.to_string(), detail: format!("expected {who} of this job") });
        }
        out.push(s);
    }
    Ok(out)
}

/// Accepts the higher ranks of the group on `listener` until each has connected and been
/// authenticated, `stop` is raised, or the deadline passes. Each handshake is read on its own
/// short-lived thread, so a stray or hostile connection that sends nothing cannot hold up the
/// others. Returns each one's group rank and connection.
#[allow(clippy::too_many_arguments)]
fn accept_higher(
    listener: &TcpListener,
    hello: &Hello,
    token: &str,
    group: &str,
    me: usize,
    members: &[usize],
    deadline: Instant,
    timeout: Duration,
    stop: &AtomicBool,
) -> DistResult<Vec<(usize, TcpStream)>> {
    let n = members.len();
    listener.set_nonblocking(true).map_err(|e| DistError::io("data-plane listener", e))?;
    let (tx, rx) = std::sync::mpsc::channel::<(TcpStream, String, DistResult<Hello>)>();
    let mut have = vec![false; n];
    let mut out = Vec::with_capacity(n - 1 - me);
    // Handshakes being read on their threads.
    let mut pending = 0usize;
    while out.len() < n - 1 - me {
        if stop.load(Ordering::SeqCst) {
            return Ok(out);
        }
        match listener.accept() {
            Ok((mut s, from)) => {
                let tx = tx.clone();
                pending += 1;
                let limit = deadline.min(Instant::now() + HANDSHAKE_GRACE);
                std::thread::spawn(move || {
                    let who = from.to_string();
                    let h = s
                        .set_nonblocking(false)
                        .map_err(|e| DistError::io("accepted connection", e))
                        .and_then(|_| Hello::read(&mut s, limit, &who));
                    let _ = tx.send((s, who, h));
                });
                continue;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(DistError::io("accepting a data-plane connection", e)),
        }
        while let Ok((mut s, who, h)) = rx.try_recv() {
            pending -= 1;
            let checked = h.and_then(|h| {
                if h.service != Service::Data || !same_secret(&h.token, token) {
                    return Err(DistError::Unauthenticated { addr: who.clone(), detail: "wrong job token".into() });
                }
                match members.iter().position(|m| *m == h.rank as usize).filter(|i| *i > me && h.group == group) {
                    Some(i) if !have[i] => {
                        wire::write_all_by(&mut s, &hello.encode(), deadline, &who)?;
                        Ok(i)
                    }
                    _ => Err(DistError::Unauthenticated {
                        addr: who.clone(),
                        detail: format!("unexpected peer rank {} for group {:?}", h.rank, h.group),
                    }),
                }
            });
            match checked {
                Ok(i) => {
                    have[i] = true;
                    out.push((i, s));
                }
                Err(e) => tracing::warn!("dropped a connection to the data plane of {group}: {e}"),
            }
        }
        if out.len() < n - 1 - me {
            if Instant::now() >= deadline {
                let waiting: Vec<usize> = (me + 1..n).filter(|p| !have[*p]).map(|p| members[p]).collect();
                return Err(DistError::Timeout {
                    what: format!("waiting for rank(s) {waiting:?} to connect ({group})"),
                    timeout,
                });
            }
            // Wakes at once for a new connection. While handshakes are being read, their results
            // are looked at every millisecond; otherwise the thread sleeps until a connection
            // comes (or a tenth of a second passes, to see `stop`): a thousand ranks waiting
            // for their peers to start must not each wake a thousand times a second.
            let wait = if pending > 0 { Duration::from_millis(1) } else { Duration::from_millis(100) };
            let mut fds = [libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
            let _ = wire::poll(&mut fds, wait.min(deadline.saturating_duration_since(Instant::now())));
        }
    }
    Ok(out)
}

/// The data-plane addresses of a group that connects on demand, read from the store.
struct StoreAddresses {
    ctx: Arc<Context>,
    group: String,
    members: Vec<usize>,
}

impl super::on_demand::Addresses for StoreAddresses {
    fn address(&self, p: usize) -> DistResult<SocketAddr> {
        let store = self.ctx.store.as_ref().expect("a multi-rank group has a store");
        let raw = store.get(&format!("{}/addr/{p}", self.group))?;
        String::from_utf8_lossy(&raw).parse().map_err(|_| DistError::Protocol {
            peer: self.members[p],
            group: self.group.clone(),
            detail: "unreadable address in the store".into(),
        })
    }

    fn hold(&self, on: bool) {
        if let Some(store) = &self.ctx.store {
            if on {
                store.acquire();
            } else {
                store.release();
            }
        }
    }
}

/// The failures of a group that connects on demand, left in the store under
/// `{group}/failed/{rank}` (`on_demand::FailureBoard`).
struct StoreBoard {
    ctx: Arc<Context>,
    group: String,
}

impl super::on_demand::FailureBoard for StoreBoard {
    fn post(&self, rank: usize, reason: &str) {
        if let Some(store) = &self.ctx.store {
            if let Err(e) = store.set(&format!("{}/failed/{rank}", self.group), reason.as_bytes()) {
                tracing::debug!("{}: leaving this rank's failure in the store: {e}", self.group);
            }
        }
    }

    fn read(&self, rank: usize) -> Option<String> {
        let store = self.ctx.store.as_ref()?;
        let _both = store.hold();
        let key = format!("{}/failed/{rank}", self.group);
        // `check` answers at once; `get` only once the key is known to be there.
        if !store.check(&key).ok()? {
            return None;
        }
        store.get(&key).ok().map(|v| String::from_utf8_lossy(&v).into_owned())
    }
}
