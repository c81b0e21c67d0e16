//! The rendezvous store: a small key-value server that rank 0 hosts and every rank uses to
//! find the others (data-plane addresses, later NCCL unique ids).
//!
//! Operations: `set`, `get` (blocks until the key exists, with a timeout), `get_many` (the
//! values of `prefix0`, `prefix1`, ... in one request: a rank of a W-rank group reads the
//! addresses of all the ranks it connects to at once, so forming a group costs the store W
//! requests rather than W(W - 1)/2), atomic `add`, `delete`, `check`. Every connection must present the job token first. Keys, values and
//! the store's total size are bounded, and every length is checked before allocation, so a
//! hostile client can neither crash the server nor make it allocate without bound.
//!
//! A request that waits is woken only by the keys it waits for: a `get` when its key appears, a
//! `get_many` once the last of its keys does (each waiter keeps the number of its keys still
//! missing, updated as keys come and go). While W ranks form a group, each sets one key and
//! reads W: the server wakes each waiter once, W wake-ups in all, where waking every waiter on
//! every `set` cost about W² ([`StoreServer::wake_ups`] counts them).

use std::collections::HashMap;
use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{DistError, DistResult};
use crate::wire::{read_exact_by, same_secret, write_all_by, Hello, Service};

/// Longest key accepted.
pub const MAX_KEY: usize = 4096;
/// Largest value accepted.
pub const MAX_VALUE: usize = 64 << 20;
/// Largest total of keys and values the server holds.
pub const MAX_TOTAL: usize = 1 << 30;
/// How long a client may take to finish a request once its first byte arrived, and to send
/// its handshake.
const REQUEST_GRACE: Duration = Duration::from_secs(30);

const CMD_SET: u8 = 1;
const CMD_GET: u8 = 2;
const CMD_ADD: u8 = 3;
const CMD_DELETE: u8 = 4;
const CMD_CHECK: u8 = 5;
const CMD_GET_MANY: u8 = 6;

/// Most keys one `get_many` may ask for.
pub const MAX_MANY: usize = 1 << 16;

const ST_OK: u8 = 0;
const ST_MISSING: u8 = 1;
const ST_ERROR: u8 = 2;

#[derive(Default)]
struct Table {
    map: HashMap<String, Vec<u8>>,
    bytes: usize,
    /// `get` requests waiting, by the key they wait for.
    key_waits: HashMap<String, Vec<Arc<Wait>>>,
    /// `get_many` requests waiting, by their prefix.
    prefix_waits: HashMap<String, Vec<Arc<Wait>>>,
}

/// One waiting request. `missing` (a `get_many`'s keys not yet there) changes only under the
/// table's lock; it is atomic only so that a `Wait` can be shared.
struct Wait {
    woken: Condvar,
    /// How many keys: `{prefix}0 .. {prefix}{count - 1}` (1 for a `get`).
    count: usize,
    missing: std::sync::atomic::AtomicUsize,
}

impl Wait {
    fn new(count: usize, missing: usize) -> Arc<Wait> {
        Arc::new(Wait { woken: Condvar::new(), count, missing: missing.into() })
    }
}

struct Shared {
    table: Mutex<Table>,
    stop: AtomicBool,
    token: String,
    /// Waiters woken by a key they waited for (not by the periodic check for a stop).
    wake_ups: AtomicU64,
    /// Client connections served now (accepted and not yet closed).
    connections: AtomicUsize,
}

/// Counts one served connection for as long as it lives.
struct Served(Arc<Shared>);

impl Drop for Served {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Shared {
    fn wake(&self, w: &Wait) {
        self.wake_ups.fetch_add(1, Ordering::Relaxed);
        w.woken.notify_one();
    }

    /// `key` has just appeared (`present`) in the table, or left it: wake its `get`s, and count it
    /// for (or against) the `get_many`s whose range holds it, waking those it completes.
    fn key_changed(&self, t: &Table, key: &str, present: bool) {
        if present {
            for w in t.key_waits.get(key).into_iter().flatten() {
                self.wake(w);
            }
        }
        // `key` is `{prefix}{i}` for every split where what follows is a decimal without
        // leading zeros: the prefix may itself end in digits.
        let digits = key.len() - key.trim_end_matches(|c: char| c.is_ascii_digit()).len();
        for start in key.len() - digits..key.len() {
            let (prefix, number) = key.split_at(start);
            if number.len() > 1 && number.starts_with('0') {
                continue;
            }
            let Ok(i) = number.parse::<usize>() else { continue };
            for w in t.prefix_waits.get(prefix).into_iter().flatten().filter(|w| i < w.count) {
                if present {
                    if w.missing.fetch_sub(1, Ordering::Relaxed) == 1 {
                        self.wake(w);
                    }
                } else {
                    w.missing.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// Waits on `w` (registered by the caller) for at most `left`, or 200 ms at a time so that a
    /// stopping server is noticed.
    fn wait_on<'a>(&self, t: std::sync::MutexGuard<'a, Table>, w: &Wait, left: Duration) -> std::sync::MutexGuard<'a, Table> {
        w.woken.wait_timeout(t, left.min(Duration::from_millis(200))).unwrap_or_else(|p| p.into_inner()).0
    }
}

/// Removes `w` from the waiters of `key` in `waits`.
fn unregister(waits: &mut HashMap<String, Vec<Arc<Wait>>>, key: &str, w: &Arc<Wait>) {
    if let Some(list) = waits.get_mut(key) {
        list.retain(|x| !Arc::ptr_eq(x, w));
        if list.is_empty() {
            waits.remove(key);
        }
    }
}

/// The store server. It runs on background threads until dropped.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Binds `addr` (only that address: give the interface rank 0 is reached on) and serves.
    /// Port 0 picks a free port; [`StoreServer::addr`] tells which.
    pub fn start(addr: impl ToSocketAddrs + std::fmt::Debug, token: &str) -> DistResult<StoreServer> {
        // Bound with a long listen queue: every rank of a job connects at about the same moment.
        let bind = |a: SocketAddr| crate::wire::listen(a);
        let listener = addr
            .to_socket_addrs()
            .and_then(|mut a| a.next().ok_or_else(|| std::io::Error::other("resolves to no address")))
            .and_then(bind)
            .map_err(|e| DistError::io(format!("binding the rendezvous store to {addr:?}"), e))?;
        let addr = listener.local_addr().map_err(|e| DistError::io("reading the store address", e))?;
        listener.set_nonblocking(true).map_err(|e| DistError::io("configuring the store listener", e))?;
        let shared = Arc::new(Shared {
            table: Mutex::new(Table::default()),
            stop: AtomicBool::new(false),
            token: token.to_string(),
            wake_ups: AtomicU64::new(0),
            connections: AtomicUsize::new(0),
        });
        let s = shared.clone();
        let accept = std::thread::Builder::new()
            .name("allgrad-store".into())
            .spawn(move || accept_loop(listener, s))
            .map_err(|e| DistError::io("starting the store thread", e))?;
        Ok(StoreServer { addr, shared, accept: Some(accept) })
    }

    /// The address the store listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// How many times a waiting `get` or `get_many` was woken by the keys it waited for, since
    /// the server started (the measure of the store's work while a group forms).
    pub fn wake_ups(&self) -> u64 {
        self.shared.wake_ups.load(Ordering::Relaxed)
    }

    /// Client connections the server holds open now: each is a descriptor and a thread of the
    /// process that serves the store (rank 0).
    pub fn connections(&self) -> usize {
        self.shared.connections.load(Ordering::SeqCst)
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let t = self.shared.table.lock().unwrap_or_else(|p| p.into_inner());
            for w in t.key_waits.values().chain(t.prefix_waits.values()).flatten() {
                w.woken.notify_one();
            }
        }
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, peer)) => {
                let s = shared.clone();
                shared.connections.fetch_add(1, Ordering::SeqCst);
                // Dropped with the thread's closure, after the connection: also when no thread starts.
                let served = Served(shared.clone());
                let _ = std::thread::Builder::new().name("allgrad-store-conn".into()).spawn(move || {
                    let _served = served;
                    if let Err(e) = serve(stream, &s) {
                        if !s.stop.load(Ordering::SeqCst) {
                            tracing::debug!("store connection from {peer} ended: {e}");
                        }
                    }
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => {
                tracing::warn!("store accept failed: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

fn serve(mut stream: TcpStream, shared: &Shared) -> DistResult<()> {
    stream.set_nonblocking(false).map_err(|e| DistError::io("store connection", e))?;
    let _ = stream.set_nodelay(true);
    let who = stream.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
    let hello = Hello::read(&mut stream, Instant::now() + REQUEST_GRACE, &who)?;
    if hello.service != Service::Store || !same_secret(&hello.token, &shared.token) {
        tracing::warn!("rendezvous store rejected a connection from {who}: wrong job token or service");
        return Err(DistError::Unauthenticated { addr: who, detail: "wrong job token".into() });
    }
    let reply = Hello { service: Service::Store, rank: 0, world: 0, token: shared.token.clone(), group: String::new() };
    write_all_by(&mut stream, &reply.encode(), Instant::now() + REQUEST_GRACE, &who)?;

    loop {
        // Wait for the next request, checking now and then whether the server stops.
        let mut cmd = [0u8; 1];
        stream.set_read_timeout(Some(Duration::from_millis(200))).map_err(|e| DistError::io("store", e))?;
        match stream.read(&mut cmd) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                if shared.stop.load(Ordering::SeqCst) {
                    return Ok(());
                }
                continue;
            }
            Err(e) => return Err(DistError::io(format!("reading from store client {who}"), e)),
        }
        let deadline = Instant::now() + REQUEST_GRACE;
        let mut lens = [0u8; 16];
        read_exact_by(&mut stream, &mut lens, deadline, &who)?;
        let key_len = u32::from_le_bytes(lens[0..4].try_into().unwrap()) as usize;
        let val_len = u32::from_le_bytes(lens[4..8].try_into().unwrap()) as usize;
        let arg = u64::from_le_bytes(lens[8..16].try_into().unwrap());
        if key_len > MAX_KEY || val_len > MAX_VALUE {
            let msg = format!("request too large: key {key_len} bytes (max {MAX_KEY}), value {val_len} bytes (max {MAX_VALUE})");
            respond(&mut stream, ST_ERROR, msg.as_bytes(), &who)?;
            return Err(DistError::Store(msg));
        }
        let mut key = vec![0u8; key_len];
        read_exact_by(&mut stream, &mut key, deadline, &who)?;
        let mut val = vec![0u8; val_len];
        read_exact_by(&mut stream, &mut val, deadline, &who)?;
        let key = match String::from_utf8(key) {
            Ok(k) => k,
            Err(_) => {
                respond(&mut stream, ST_ERROR, b"key is not UTF-8", &who)?;
                continue;
            }
        };
        let (status, body) = handle(shared, cmd[0], key, val, arg);
        respond(&mut stream, status, &body, &who)?;
    }
}

fn handle(shared: &Shared, cmd: u8, key: String, val: Vec<u8>, arg: u64) -> (u8, Vec<u8>) {
    let mut t = shared.table.lock().unwrap_or_else(|p| p.into_inner());
    match cmd {
        CMD_SET => {
            let old = t.map.get(&key).map(|v| v.len() + key.len()).unwrap_or(0);
            let new_total = t.bytes - old + key.len() + val.len();
            if new_total > MAX_TOTAL {
                return (ST_ERROR, format!("store is full ({MAX_TOTAL} bytes)").into_bytes());
            }
            t.bytes = new_total;
            if t.map.insert(key.clone(), val).is_none() {
                shared.key_changed(&t, &key, true);
            }
            (ST_OK, Vec::new())
        }
        CMD_GET => {
            // A wait too long to represent (a hostile u64::MAX) waits until the server stops.
            let deadline = Instant::now().checked_add(Duration::from_millis(arg));
            if let Some(v) = t.map.get(&key) {
                return (ST_OK, v.clone());
            }
            let w = Wait::new(1, 1);
            t.key_waits.entry(key.clone()).or_default().push(w.clone());
            let answer = loop {
                if let Some(v) = t.map.get(&key) {
                    break (ST_OK, v.clone());
                }
                let left = deadline.map_or(Duration::MAX, |d| d.saturating_duration_since(Instant::now()));
                if left.is_zero() || shared.stop.load(Ordering::SeqCst) {
                    break (ST_MISSING, Vec::new());
                }
                t = shared.wait_on(t, &w, left);
            };
            unregister(&mut t.key_waits, &key, &w);
            answer
        }
        CMD_ADD => {
            let cur = match t.map.get(&key) {
                None => 0i64,
                Some(v) if v.len() == 8 => i64::from_le_bytes(v[..].try_into().unwrap()),
                Some(_) => return (ST_ERROR, format!("key {key:?} does not hold a counter").into_bytes()),
            };
            let next = cur.wrapping_add(arg as i64);
            let new = !t.map.contains_key(&key);
            if new {
                t.bytes += key.len() + 8;
            }
            t.map.insert(key.clone(), next.to_le_bytes().to_vec());
            if new {
                shared.key_changed(&t, &key, true);
            }
            (ST_OK, next.to_le_bytes().to_vec())
        }
        CMD_DELETE => match t.map.remove(&key) {
            Some(v) => {
                t.bytes -= key.len() + v.len();
                shared.key_changed(&t, &key, false);
                (ST_OK, vec![1])
            }
            None => (ST_OK, vec![0]),
        },
        CMD_CHECK => (ST_OK, vec![t.map.contains_key(&key) as u8]),
        CMD_GET_MANY => {
            let count = match <[u8; 4]>::try_from(&val[..]) {
                Ok(b) if u32::from_le_bytes(b) as usize <= MAX_MANY => u32::from_le_bytes(b) as usize,
                _ => return (ST_ERROR, format!("get_many wants a count of at most {MAX_MANY} as 4 bytes").into_bytes()),
            };
            let deadline = Instant::now().checked_add(Duration::from_millis(arg));
            let first_missing = |t: &Table| (0..count).find(|i| !t.map.contains_key(&format!("{key}{i}")));
            if first_missing(&t).is_some() {
                // Counted once here; from now on `key_changed` keeps the count as keys come and go.
                let missing = (0..count).filter(|i| !t.map.contains_key(&format!("{key}{i}"))).count();
                let w = Wait::new(count, missing);
                t.prefix_waits.entry(key.clone()).or_default().push(w.clone());
                let gone = loop {
                    if w.missing.load(Ordering::Relaxed) == 0 {
                        break None;
                    }
                    let left = deadline.map_or(Duration::MAX, |d| d.saturating_duration_since(Instant::now()));
                    if left.is_zero() || shared.stop.load(Ordering::SeqCst) {
                        break first_missing(&t);
                    }
                    t = shared.wait_on(t, &w, left);
                };
                unregister(&mut t.prefix_waits, &key, &w);
                if let Some(next) = gone {
                    return (ST_MISSING, (next as u32).to_le_bytes().to_vec());
                }
            }
            let mut body = Vec::new();
            for i in 0..count {
                // Deleted meanwhile by a client that should not have: say which.
                let Some(v) = t.map.get(&format!("{key}{i}")) else {
                    return (ST_MISSING, (i as u32).to_le_bytes().to_vec());
                };
                if body.len() + 4 + v.len() > MAX_VALUE {
                    return (ST_ERROR, format!("get_many of {count} keys would answer more than {MAX_VALUE} bytes").into_bytes());
                }
                body.extend_from_slice(&(v.len() as u32).to_le_bytes());
                body.extend_from_slice(v);
            }
            (ST_OK, body)
        }
        c => (ST_ERROR, format!("unknown command {c}").into_bytes()),
    }
}

fn respond(stream: &mut TcpStream, status: u8, body: &[u8], who: &str) -> DistResult<()> {
    let mut b = Vec::with_capacity(5 + body.len());
    b.push(status);
    b.extend_from_slice(&(body.len() as u32).to_le_bytes());
    b.extend_from_slice(body);
    write_all_by(stream, &b, Instant::now() + REQUEST_GRACE, who)
}

/// Opens an authenticated connection to the store at `addr` within `timeout`: retries while
/// nothing answers (with a pause growing from 10 ms to half a second), and, for a first
/// connection only, while the store refuses (rank 0 may not have started it yet).
fn open(addr: &str, token: &str, rank: usize, timeout: Duration, opening: Opening) -> DistResult<TcpStream> {
    let deadline = Instant::now() + timeout;
    let mut last_err = None;
    let mut pause = Duration::from_millis(10);
    let again = opening == Opening::Again;
    loop {
        if Instant::now() >= deadline {
            return Err(DistError::Timeout {
                what: format!(
                    "{} the rendezvous store at {addr} (is rank 0 running and MASTER_ADDR/MASTER_PORT right?{})",
                    if again { "reconnecting to" } else { "connecting to" },
                    last_err.map(|e: DistError| format!(" last error: {e}")).unwrap_or_default()
                ),
                timeout,
            });
        }
        let target = addr
            .to_socket_addrs()
            .map_err(|e| DistError::io(format!("resolving the store address {addr}"), e))?
            .next()
            .ok_or_else(|| DistError::Env(format!("store address {addr} resolves to nothing")))?;
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        let err = match TcpStream::connect_timeout(&target, left.min(Duration::from_secs(5))) {
            Ok(s) => match handshake(s, addr, token, rank, deadline) {
                Ok(s) => return Ok(s),
                // Another token is not worth retrying; a closed connection on a reconnect (the
                // token was accepted before) may be a store busy accepting: retried.
                Err(e @ DistError::Unauthenticated { .. }) if !again => return Err(e),
                Err(e) => e,
            },
            Err(e) if again && e.kind() == std::io::ErrorKind::ConnectionRefused => {
                return Err(DistError::io(
                    format!("reconnecting to the rendezvous store at {addr} (refused: has rank 0, which serves it, exited?)"),
                    e,
                ));
            }
            Err(e) => DistError::io(format!("connecting to {addr}"), e),
        };
        tracing::debug!("connecting to the rendezvous store at {addr}: {err}; retrying");
        last_err = Some(err);
        std::thread::sleep(if again { pause } else { Duration::from_millis(50) });
        pause = (pause * 2).min(Duration::from_millis(500));
    }
}

/// Presents the job token on a new connection to the store and checks the store's answer.
fn handshake(mut stream: TcpStream, addr: &str, token: &str, rank: usize, deadline: Instant) -> DistResult<TcpStream> {
    let _ = stream.set_nodelay(true);
    let hello = Hello { service: Service::Store, rank: rank as u32, world: 0, token: token.to_string(), group: String::new() };
    let who = format!("rendezvous store {addr}");
    write_all_by(&mut stream, &hello.encode(), deadline, &who)?;
    let reply = Hello::read(&mut stream, deadline, &who).map_err(|e| match e {
        DistError::Io { .. } => DistError::Unauthenticated {
            addr: addr.to_string(),
            detail: "the store closed the connection during the handshake (is this rank's job token, ALLGRAD_JOB_TOKEN, the same as rank 0's?)".into(),
        },
        e => e,
    })?;
    if reply.service != Service::Store || !same_secret(&reply.token, token) {
        return Err(DistError::Unauthenticated {
            addr: addr.to_string(),
            detail: "the store answered with another job token".into(),
        });
    }
    Ok(stream)
}

/// Sends one request on `s` and reads its reply (status and body), before the request's wait
/// plus [`REQUEST_GRACE`].
fn exchange(
    s: &mut TcpStream,
    addr: &str,
    cmd: u8,
    key: &str,
    val: &[u8],
    arg: u64,
    wait: Duration,
) -> DistResult<(u8, Vec<u8>)> {
    let who = format!("rendezvous store {addr}");
    let deadline = Instant::now() + wait + REQUEST_GRACE;
    let mut b = Vec::with_capacity(17 + key.len() + val.len());
    b.push(cmd);
    b.extend_from_slice(&(key.len() as u32).to_le_bytes());
    b.extend_from_slice(&(val.len() as u32).to_le_bytes());
    b.extend_from_slice(&arg.to_le_bytes());
    b.extend_from_slice(key.as_bytes());
    b.extend_from_slice(val);
    write_all_by(s, &b, deadline, &who)?;
    let mut head = [0u8; 5];
    read_exact_by(s, &mut head, deadline, &who)?;
    let len = u32::from_le_bytes(head[1..5].try_into().unwrap()) as usize;
    if len > MAX_VALUE {
        return Err(DistError::Store(format!("reply of {len} bytes exceeds {MAX_VALUE}")));
    }
    let mut body = vec![0u8; len];
    read_exact_by(s, &mut body, deadline, &who)?;
    Ok((head[0], body))
}

/// A client of the store. Cheap to share between threads (requests are serialised).
///
/// # Connections that close when idle
///
/// Rank 0 serves the store, so each connection open to it is a descriptor (and a thread) there:
/// W of them for a job of W ranks, for the life of the job, while a group needs the store only
/// to form (and later for a subgroup, a connection opened on demand, a failure record). So a
/// group's client closes its connection once idle ([`StoreClient::set_close_when_idle`]) and
/// opens a new one for its next request: after formation rank 0 serves no connection but those
/// of requests in progress. [`StoreClient::hold`] keeps it open across a run of requests (a
/// formation, a run of on-demand connections). Why this design rather than the others:
///
/// - The client closes, never the server (an idle timeout on the server would race a request
///   already on its way, which the client could not tell from one that was lost). A connection
///   closes only between requests, under the lock that serialises them, and a request is sent
///   on exactly one connection and never sent again: a failure in the middle of one (the store
///   gone, a reply that does not come) is that request's error, as it was before. So no
///   request is lost or applied twice across a reconnect: an `add` counts once, and a `get`
///   or `get_many` that waits keeps its connection until answered.
/// - A reconnect presents the job token as the first connection did, within the client's
///   timeout (and no longer than the request could take on an open connection); while the
///   store does not answer it retries with a growing pause. A refusal is
///   not retried: the store was up, so a closed port means rank 0 has exited, and the request
///   fails at once naming the store's address, as a request on a connection kept open did.
/// - Nothing relies on the connection staying open: the server keeps no state per connection
///   (keys, counters and waiters live in its table), and no rank's death is told by its store
///   connection closing (the data plane and the failure records tell it).
///
/// A client made by [`StoreClient::connect`] keeps its connection open until dropped.
pub struct StoreClient {
    /// The connection, while open. Lock order: `io` before `holds`.
    io: Mutex<Option<TcpStream>>,
    holds: Mutex<Holds>,
    addr: String,
    token: String,
    rank: usize,
    timeout: Duration,
    /// Connections opened so far (the first one included).
    opened: AtomicU64,
}

#[derive(Default)]
struct Holds {
    /// [`StoreHold`]s alive.
    count: usize,
    /// Whether the connection closes once idle with no hold alive.
    close_when_idle: bool,
}

/// Keeps a [`StoreClient`]'s connection open across requests until dropped
/// ([`StoreClient::hold`]).
pub struct StoreHold<'a> {
    client: &'a StoreClient,
}

impl Drop for StoreHold<'_> {
    fn drop(&mut self) {
        self.client.release();
    }
}

/// Whether a connection is the client's first (the store may not be up yet: refusals are
/// retried) or a reconnect (the store was up: a refusal means it is gone).
#[derive(Clone, Copy, PartialEq)]
enum Opening {
    First,
    Again,
}

impl StoreClient {
    /// Connects to the store at `addr`, retrying while it is not up yet, for at most `timeout`.
    pub fn connect(addr: &str, token: &str, rank: usize, timeout: Duration) -> DistResult<StoreClient> {
        let stream = open(addr, token, rank, timeout, Opening::First)?;
        Ok(StoreClient {
            io: Mutex::new(Some(stream)),
            holds: Mutex::new(Holds::default()),
            addr: addr.to_string(),
            token: token.to_string(),
            rank,
            timeout,
            opened: AtomicU64::new(1),
        })
    }

    /// From now on (`true`), closes the connection whenever it is idle and no [`StoreHold`] is
    /// alive, now included, and opens a new one for the next request (see the type's notes).
    pub fn set_close_when_idle(&self, on: bool) {
        let mut h = self.holds.lock().unwrap_or_else(|p| p.into_inner());
        h.close_when_idle = on;
        if on && h.count == 0 {
            self.close_if_idle();
        }
    }

    /// Keeps the connection open (opened by the next request if closed) until the returned
    /// hold is dropped.
    pub fn hold(&self) -> StoreHold<'_> {
        self.acquire();
        StoreHold { client: self }
    }

    /// [`StoreClient::hold`] without the guard: each call is undone by one [`StoreClient::release`].
    pub(crate) fn acquire(&self) {
        self.holds.lock().unwrap_or_else(|p| p.into_inner()).count += 1;
    }

    /// Undoes one [`StoreClient::acquire`].
    pub(crate) fn release(&self) {
        let mut h = self.holds.lock().unwrap_or_else(|p| p.into_inner());
        h.count = h.count.saturating_sub(1);
        if h.count == 0 && h.close_when_idle {
            // Not waiting for a request in progress (a `get` may wait long): that request
            // closes the connection when it ends, as it finds no hold alive (it looks at the
            // holds before it lets the connection go, and this thread changed them first).
            self.close_if_idle();
        }
    }

    /// Closes the connection unless a request is using it (called with `holds` locked).
    fn close_if_idle(&self) {
        match self.io.try_lock() {
            Ok(mut io) => *io = None,
            Err(std::sync::TryLockError::Poisoned(p)) => *p.into_inner() = None,
            Err(std::sync::TryLockError::WouldBlock) => {}
        }
    }

    /// Whether the client holds a connection to the store now (for tests).
    #[doc(hidden)]
    pub fn is_connected(&self) -> bool {
        self.io.lock().unwrap_or_else(|p| p.into_inner()).is_some()
    }

    /// Connections this client opened so far, its first included (for tests).
    #[doc(hidden)]
    pub fn connections_opened(&self) -> u64 {
        self.opened.load(Ordering::Relaxed)
    }

    /// The store's address, as given to [`StoreClient::connect`].
    pub fn addr(&self) -> &str {
        &self.addr
    }

    fn request(&self, cmd: u8, key: &str, val: &[u8], arg: u64, wait: Duration) -> DistResult<(u8, Vec<u8>)> {
        if key.len() > MAX_KEY || val.len() > MAX_VALUE {
            return Err(DistError::Invalid(format!(
                "store request too large: key {} bytes (max {MAX_KEY}), value {} bytes (max {MAX_VALUE})",
                key.len(),
                val.len()
            )));
        }
        let mut io = self.io.lock().unwrap_or_else(|p| p.into_inner());
        let answer = match &mut *io {
            Some(s) => exchange(s, &self.addr, cmd, key, val, arg, wait),
            // Within the client's timeout, and no longer than the request itself may take on an
            // open connection (a best-effort `set` to a store whose host went silent gives up as
            // soon as it did).
            None => open(&self.addr, &self.token, self.rank, self.timeout.min(wait + REQUEST_GRACE), Opening::Again).and_then(
                |mut s| {
                    self.opened.fetch_add(1, Ordering::Relaxed);
                    let a = exchange(&mut s, &self.addr, cmd, key, val, arg, wait);
                    *io = Some(s);
                    a
                },
            ),
        };
        // A request that failed on the way may have left bytes on the connection (a reply still
        // to come): the next request starts on a new one. This one is not sent again.
        if answer.is_err() {
            *io = None;
        }
        let h = self.holds.lock().unwrap_or_else(|p| p.into_inner());
        if h.close_when_idle && h.count == 0 {
            *io = None;
        }
        // `io` goes before `holds`: a hold released meanwhile either saw this request's lock
        // taken (and this request closes, having read `holds` after it changed) or finds the
        // connection idle.
        drop(io);
        drop(h);
        let (status, body) = answer?;
        if status == ST_ERROR {
            return Err(DistError::Store(String::from_utf8_lossy(&body).into_owned()));
        }
        Ok((status, body))
    }

    /// Sets `key` to `value`, replacing any earlier value.
    pub fn set(&self, key: &str, value: &[u8]) -> DistResult<()> {
        self.request(CMD_SET, key, value, 0, Duration::ZERO).map(|_| ())
    }

    /// Waits until `key` exists (at most the client's timeout) and returns its value.
    pub fn get(&self, key: &str) -> DistResult<Vec<u8>> {
        self.get_timeout(key, self.timeout)
    }

    /// Waits until `key` exists (at most `timeout`) and returns its value.
    pub fn get_timeout(&self, key: &str, timeout: Duration) -> DistResult<Vec<u8>> {
        let ms = timeout.as_millis().min(u64::MAX as u128) as u64;
        match self.request(CMD_GET, key, &[], ms, timeout)? {
            (ST_OK, v) => Ok(v),
            _ => Err(DistError::Timeout { what: format!("waiting for store key {key:?}"), timeout }),
        }
    }

    /// Waits until keys `{prefix}0` .. `{prefix}{count - 1}` all exist (at most the client's
    /// timeout in all) and returns their values, in one request.
    pub fn get_many(&self, prefix: &str, count: usize) -> DistResult<Vec<Vec<u8>>> {
        if count > MAX_MANY {
            return Err(DistError::Invalid(format!("get_many of {count} keys (at most {MAX_MANY})")));
        }
        let timeout = self.timeout;
        let ms = timeout.as_millis().min(u64::MAX as u128) as u64;
        let (status, body) = self.request(CMD_GET_MANY, prefix, &(count as u32).to_le_bytes(), ms, timeout)?;
        if status != ST_OK {
            let missing = <[u8; 4]>::try_from(&body[..]).map(u32::from_le_bytes).unwrap_or(0);
            return Err(DistError::Timeout {
                what: format!("waiting for store key {:?}", format!("{prefix}{missing}")),
                timeout,
            });
        }
        let malformed = || DistError::Store(format!("malformed get_many reply of {} bytes for {count} keys", body.len()));
        let mut out = Vec::with_capacity(count);
        let mut at = 0;
        for _ in 0..count {
            let len = body.get(at..at + 4).ok_or_else(malformed)?;
            let len = u32::from_le_bytes(len.try_into().unwrap()) as usize;
            out.push(body.get(at + 4..at + 4 + len).ok_or_else(malformed)?.to_vec());
            at += 4 + len;
        }
        if at != body.len() {
            return Err(malformed());
        }
        Ok(out)
    }

    /// Atomically adds `delta` to the counter at `key` (0 when absent); returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> DistResult<i64> {
        let (_, v) = self.request(CMD_ADD, key, &[], delta as u64, Duration::ZERO)?;
        let v: [u8; 8] = v.try_into().map_err(|_| DistError::Store("malformed counter reply".into()))?;
        Ok(i64::from_le_bytes(v))
    }

    /// Deletes `key`; returns whether it existed.
    pub fn delete(&self, key: &str) -> DistResult<bool> {
        Ok(self.request(CMD_DELETE, key, &[], 0, Duration::ZERO)?.1 == [1])
    }

    /// Whether `key` exists now (does not wait).
    pub fn check(&self, key: &str) -> DistResult<bool> {
        Ok(self.request(CMD_CHECK, key, &[], 0, Duration::ZERO)?.1 == [1])
    }

    /// The client's default timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
}

#[cfg(test)]
#[path = "store_fuzz_tests.rs"]
mod fuzz_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn server() -> (StoreServer, String) {
        let s = StoreServer::start("127.0.0.1:0", "tok").unwrap();
        let a = s.addr().to_string();
        (s, a)
    }

    #[test]
    fn set_get_add_delete_check() {
        let (_s, addr) = server();
        let c = StoreClient::connect(&addr, "tok", 0, Duration::from_secs(5)).unwrap();
        c.set("a", b"hello").unwrap();
        assert_eq!(c.get("a").unwrap(), b"hello");
        assert!(c.check("a").unwrap());
        assert_eq!(c.add("n", 3).unwrap(), 3);
        assert_eq!(c.add("n", -1).unwrap(), 2);
        assert!(c.delete("a").unwrap());
        assert!(!c.delete("a").unwrap());
        assert!(!c.check("a").unwrap());
    }

    #[test]
    fn get_many_waits_for_every_key_and_answers_in_order() {
        let (_s, addr) = server();
        let a2 = addr.clone();
        let t = std::thread::spawn(move || {
            let c = StoreClient::connect(&a2, "tok", 1, Duration::from_secs(5)).unwrap();
            c.get_many("g/addr/", 3).unwrap()
        });
        let c = StoreClient::connect(&addr, "tok", 0, Duration::from_secs(5)).unwrap();
        // Set out of order, the last one late: the reader waits for it.
        c.set("g/addr/2", b"two").unwrap();
        c.set("g/addr/0", b"").unwrap();
        std::thread::sleep(Duration::from_millis(100));
        c.set("g/addr/1", b"one").unwrap();
        assert_eq!(t.join().unwrap(), vec![b"".to_vec(), b"one".to_vec(), b"two".to_vec()]);
        assert_eq!(c.get_many("g/addr/", 0).unwrap(), Vec::<Vec<u8>>::new());
        // A key that never comes: a timeout naming it.
        let short = StoreClient::connect(&addr, "tok", 2, Duration::from_millis(150)).unwrap();
        let e = short.get_many("g/addr/", 5).unwrap_err().to_string();
        assert!(e.contains("\"g/addr/3\"") && e.contains("timed out"), "{e}");
        // Too many keys: refused before asking.
        assert!(c.get_many("g/addr/", MAX_MANY + 1).is_err());
    }

    /// A group's formation: every rank sets its key and reads all W. Each waiting `get_many` is
    /// woken once, by the last of its keys: at most W wake-ups, where waking every waiter on
    /// every `set` gave about W²/2.
    #[test]
    fn forming_a_group_wakes_each_waiter_once() {
        const W: usize = 48;
        let (s, addr) = server();
        let go = Arc::new(std::sync::Barrier::new(W));
        let ranks: Vec<_> = (0..W)
            .map(|r| {
                let (addr, go) = (addr.clone(), go.clone());
                std::thread::spawn(move || {
                    let c = StoreClient::connect(&addr, "tok", r, Duration::from_secs(30)).unwrap();
                    go.wait();
                    // Staggered, so that most ranks wait while the others arrive.
                    std::thread::sleep(Duration::from_millis(2 * r as u64));
                    c.set(&format!("w/addr/{r}"), format!("rank {r}").as_bytes()).unwrap();
                    c.get_many("w/addr/", W).unwrap()
                })
            })
            .collect();
        let want: Vec<Vec<u8>> = (0..W).map(|r| format!("rank {r}").into_bytes()).collect();
        for t in ranks {
            assert_eq!(t.join().unwrap(), want);
        }
        let wakes = s.wake_ups();
        assert!(wakes >= 1 && wakes <= W as u64, "{wakes} wake-ups for {W} ranks forming a group (at most {W})");
    }

    /// Keys that come, go and come back: a `get_many` answers only when all are there at once,
    /// and a prefix that ends in digits is told apart from a longer one.
    #[test]
    fn get_many_counts_keys_that_leave_and_return() {
        let (s, addr) = server();
        let c = StoreClient::connect(&addr, "tok", 0, Duration::from_secs(5)).unwrap();
        let a2 = addr.clone();
        let t = std::thread::spawn(move || {
            let c = StoreClient::connect(&a2, "tok", 1, Duration::from_secs(5)).unwrap();
            c.get_many("p1/", 3).unwrap()
        });
        std::thread::sleep(Duration::from_millis(50));
        c.set("p1/0", b"a").unwrap();
        c.set("p1/1", b"b").unwrap();
        assert!(c.delete("p1/0").unwrap());
        // Not in the range, or under another prefix: none of them counts.
        c.set("p1/3", b"x").unwrap();
        c.set("p1/01", b"x").unwrap();
        c.set("p12", b"x").unwrap();
        assert_eq!(c.add("p1/2", 7).unwrap(), 7);
        std::thread::sleep(Duration::from_millis(100));
        assert!(!t.is_finished(), "get_many answered while p1/0 was missing");
        assert_eq!(s.wake_ups(), 0);
        c.set("p1/0", b"A").unwrap();
        assert_eq!(t.join().unwrap(), vec![b"A".to_vec(), b"b".to_vec(), 7i64.to_le_bytes().to_vec()]);
        assert_eq!(s.wake_ups(), 1);
    }

    #[test]
    fn get_blocks_until_another_client_sets() {
        let (_s, addr) = server();
        let a2 = addr.clone();
        let t = std::thread::spawn(move || {
            let c = StoreClient::connect(&a2, "tok", 1, Duration::from_secs(5)).unwrap();
            c.get("late").unwrap()
        });
        std::thread::sleep(Duration::from_millis(100));
        let c = StoreClient::connect(&addr, "tok", 0, Duration::from_secs(5)).unwrap();
        c.set("late", b"x").unwrap();
        assert_eq!(t.join().unwrap(), b"x");
    }

    #[test]
    fn get_times_out_with_the_key_name() {
        let (_s, addr) = server();
        let c = StoreClient::connect(&addr, "tok", 0, Duration::from_secs(5)).unwrap();
        let err = c.get_timeout("never", Duration::from_millis(100)).unwrap_err().to_string();
        assert!(err.contains("never") && err.contains("timed out"), "{err}");
    }

    #[test]
    fn wrong_token_is_rejected_and_server_keeps_serving() {
        let (_s, addr) = server();
        let err = StoreClient::connect(&addr, "WRONG", 0, Duration::from_secs(5)).err().unwrap().to_string();
        assert!(err.contains("token"), "{err}");
        let c = StoreClient::connect(&addr, "tok", 0, Duration::from_secs(5)).unwrap();
        c.set("k", b"v").unwrap();
        assert_eq!(c.get("k").unwrap(), b"v");
    }

    #[test]
    fn garbage_and_oversized_requests_do_not_hurt_the_server() {
        let (_s, addr) = server();
        // Garbage instead of a handshake.
        let mut g = TcpStream::connect(&addr).unwrap();
        g.write_all(&[0xff; 64]).unwrap();
        // A valid handshake followed by a request claiming a 4 GiB value.
        let mut h = TcpStream::connect(&addr).unwrap();
        let hello = Hello { service: Service::Store, rank: 0, world: 0, token: "tok".into(), group: String::new() };
        h.write_all(&hello.encode()).unwrap();
        let _ = Hello::read(&mut h, Instant::now() + Duration::from_secs(5), "store").unwrap();
        let mut req = vec![CMD_SET];
        req.extend_from_slice(&1u32.to_le_bytes());
        req.extend_from_slice(&u32::MAX.to_le_bytes());
        req.extend_from_slice(&0u64.to_le_bytes());
        h.write_all(&req).unwrap();
        let mut head = [0u8; 5];
        read_exact_by(&mut h, &mut head, Instant::now() + Duration::from_secs(5), "store").unwrap();
        assert_eq!(head[0], ST_ERROR);
        // A well-behaved client still works.
        let c = StoreClient::connect(&addr, "tok", 0, Duration::from_secs(5)).unwrap();
        c.set("k", b"v").unwrap();
        assert_eq!(c.get("k").unwrap(), b"v");
    }
}
