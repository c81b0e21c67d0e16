//! A client of PyTorch's TCPStore wire protocol, so that ranks started by torchrun can
//! rendezvous through the store its elastic agent already serves at MASTER_ADDR:MASTER_PORT
//! (`TORCHELASTIC_USE_AGENT_STORE=True`) instead of binding that port themselves.
//!
//! The protocol, as PyTorch's store daemons (the classic one and the libuv one) serve it:
//! - Every integer is little-endian (the daemons send host byte order; allgrad only targets
//!   little-endian hosts). A *string* is a u64 length and that many bytes.
//! - A connection first sends `VALIDATE` (query byte 0) and the u32 magic `0x3C85F7CE`; the
//!   server answers nothing and closes connections whose first query is anything else.
//! - Then each request is a query byte and its arguments; replies come in request order:
//!   `SET` (1): key, value; no reply. `GET` (3): key; reply value (the libuv daemon answers
//!   an empty value for a missing key, so `get` waits for the key first, as PyTorch's client
//!   does). `ADD` (4): key, i64 delta; reply the new i64 (the value is stored as decimal
//!   text). `CHECK` (5): u64 count, keys; reply one byte, 0 = all present. `WAIT` (6): u64
//!   count, keys; reply one byte 0 (`STOP_WAITING`) once all exist. `CANCEL_WAIT` (12): reply
//!   one byte 1 (`WAIT_CANCELED`). `PING` (13): u32 nonce; reply the same nonce.
//! - PyTorch's `TCPStore` puts `/` before every key, and a `PrefixStore(p, store)` turns key
//!   `k` into `p/k`; [`TorchStore::with_prefix`] does both, so keys written here read back
//!   with `PrefixStore(p, TCPStore(...)).get(k)` in Python.
//!
//! Every read has a deadline and every length read from the server is bounded before
//! allocation; errors name the store's address.

use std::io::Write;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::{DistError, DistResult};
use crate::wire::read_exact_by;

/// The number a client sends right after connecting (PyTorch's `validationMagicNumber`).
pub const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;
/// Longest key PyTorch's libuv daemon accepts.
pub const MAX_KEY: usize = 8 * 1024;
/// Largest value PyTorch's libuv daemon accepts, and the largest this client reads.
pub const MAX_VALUE: usize = 8 << 20;

/// Query bytes (PyTorch's `QueryType`, in declaration order).
pub(crate) mod query {
    pub const VALIDATE: u8 = 0;
    pub const SET: u8 = 1;
    pub const GET: u8 = 3;
    pub const ADD: u8 = 4;
    pub const CHECK: u8 = 5;
    pub const WAIT: u8 = 6;
    pub const CANCEL_WAIT: u8 = 12;
    pub const PING: u8 = 13;
}
/// `CHECK`'s reply when every key exists.
const READY: u8 = 0;
/// `WAIT`'s reply once every key exists.
const STOP_WAITING: u8 = 0;
/// `CANCEL_WAIT`'s reply.
const WAIT_CANCELED: u8 = 1;

/// A connection to a PyTorch TCPStore, with an optional key prefix. Calls are serialised.
pub struct TorchStore {
    addr: String,
    prefix: String,
    timeout: Duration,
    conn: Mutex<Conn>,
}

struct Conn {
    stream: TcpStream,
    /// Set once a request failed half-way: the reply stream is out of step from then on.
    broken: Option<String>,
}

impl std::fmt::Debug for TorchStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TorchStore({}, prefix {:?})", self.addr, self.prefix)
    }
}

impl TorchStore {
    /// Connects to the store at `addr` (`host:port`), retrying until `timeout` while nothing
    /// listens there yet, and validates the connection. `timeout` also bounds every later call.
    pub fn connect(addr: &str, timeout: Duration) -> DistResult<TorchStore> {
        let deadline = Instant::now() + timeout;
        let target: SocketAddr = addr
            .to_socket_addrs()
            .map_err(|e| DistError::io(format!("resolving the TCPStore address {addr}"), e))?
            .next()
            .ok_or_else(|| DistError::Env(format!("the TCPStore address {addr} resolves to no address")))?;
        let stream = loop {
            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
            match TcpStream::connect_timeout(&target, left.min(Duration::from_secs(5))) {
                Ok(s) => break s,
                Err(e) if Instant::now() < deadline => {
                    tracing::debug!("connecting to the TCPStore at {addr}: {e}; retrying");
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => return Err(DistError::io(format!("connecting to the TCPStore at {addr}"), e)),
            }
        };
        let _ = stream.set_nodelay(true);
        let store = TorchStore {
            addr: addr.to_string(),
            prefix: String::new(),
            timeout,
            conn: Mutex::new(Conn { stream, broken: None }),
        };
        let mut hello = vec![query::VALIDATE];
        hello.extend_from_slice(&VALIDATION_MAGIC.to_le_bytes());
        store.request(&hello, deadline, |_, _| Ok(()))?;
        Ok(store)
    }

    /// The same connection, with keys put under `prefix` as PyTorch's `PrefixStore` does.
    pub fn with_prefix(mut self, prefix: &str) -> TorchStore {
        self.prefix = prefix.to_string();
        self
    }

    /// The store's address, as given to [`TorchStore::connect`].
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The key as sent on the wire: `/` + prefix + `/` + key (or `/` + key without a prefix).
    pub fn wire_key(&self, key: &str) -> String {
        if self.prefix.is_empty() {
            format!("/{key}")
        } else {
            format!("/{}/{key}", self.prefix)
        }
    }

    /// Round-trips a nonce (servers of PyTorch 2.4 and later).
    pub fn ping(&self, nonce: u32) -> DistResult<()> {
        let mut msg = vec![query::PING];
        msg.extend_from_slice(&nonce.to_le_bytes());
        let got = self.request(&msg, self.deadline(), |c, d| c.read_u32(d))?;
        if got != nonce {
            return Err(DistError::Store(format!("the TCPStore at {} answered ping {nonce} with {got}", self.addr)));
        }
        Ok(())
    }

    /// Sets `key` to `value`.
    pub fn set(&self, key: &str, value: &[u8]) -> DistResult<()> {
        if value.len() > MAX_VALUE {
            return Err(DistError::Invalid(format!("a TCPStore value holds at most {MAX_VALUE} bytes, not {}", value.len())));
        }
        let mut msg = vec![query::SET];
        put_bytes(&mut msg, self.checked_key(key)?.as_bytes());
        put_bytes(&mut msg, value);
        self.request(&msg, self.deadline(), |_, _| Ok(()))
    }

    /// The value of `key`, waiting (up to the timeout) until some rank sets it.
    pub fn get(&self, key: &str) -> DistResult<Vec<u8>> {
        self.wait(&[key], self.timeout)?;
        let mut msg = vec![query::GET];
        put_bytes(&mut msg, self.checked_key(key)?.as_bytes());
        self.request(&msg, self.deadline(), |c, d| c.read_value(d))
    }

    /// Adds `delta` to the integer at `key` (0 when missing) and returns the sum.
    pub fn add(&self, key: &str, delta: i64) -> DistResult<i64> {
        let mut msg = vec![query::ADD];
        put_bytes(&mut msg, self.checked_key(key)?.as_bytes());
        msg.extend_from_slice(&delta.to_le_bytes());
        self.request(&msg, self.deadline(), |c, d| c.read_u64(d).map(|v| v as i64))
    }

    /// Whether every key exists, without waiting.
    pub fn check(&self, keys: &[&str]) -> DistResult<bool> {
        let msg = self.keys_message(query::CHECK, keys)?;
        Ok(self.request(&msg, self.deadline(), |c, d| c.read_u8(d))? == READY)
    }

    /// Waits until every key exists, at most `timeout`; a timeout is an error naming the keys
    /// and the store, and the wait is cancelled on the server.
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> DistResult<()> {
        let msg = self.keys_message(query::WAIT, keys)?;
        let deadline = Instant::now() + timeout;
        let mut conn = self.lock()?;
        self.send(&mut conn, &msg, deadline)?;
        match conn.read_u8(deadline) {
            Ok(STOP_WAITING) => Ok(()),
            Ok(other) => Err(self.poison(&mut conn, format!("answered WAIT with {other}"))),
            Err(DistError::Timeout { .. }) => {
                // Cancel, then read past a STOP_WAITING that may have crossed the cancel.
                let grace = Instant::now() + Duration::from_secs(5);
                let cancelled = self.send(&mut conn, &[query::CANCEL_WAIT], grace).and_then(|_| loop {
                    match conn.read_u8(grace)? {
                        STOP_WAITING => continue,
                        WAIT_CANCELED => break Ok(()),
                        other => break Err(DistError::Store(format!("answered CANCEL_WAIT with {other}"))),
                    }
                });
                if let Err(e) = cancelled {
                    self.poison(&mut conn, format!("could not cancel a wait: {e}"));
                }
                Err(DistError::Timeout {
                    what: format!("waiting for {} in torchrun's TCPStore at {}", self.wire_keys(keys), self.addr),
                    timeout,
                })
            }
            Err(e) => Err(self.poison(&mut conn, e.to_string())),
        }
    }

    fn wire_keys(&self, keys: &[&str]) -> String {
        keys.iter().map(|k| format!("{:?}", self.wire_key(k))).collect::<Vec<_>>().join(", ")
    }

    fn keys_message(&self, q: u8, keys: &[&str]) -> DistResult<Vec<u8>> {
        let mut msg = vec![q];
        msg.extend_from_slice(&(keys.len() as u64).to_le_bytes());
        for k in keys {
            put_bytes(&mut msg, self.checked_key(k)?.as_bytes());
        }
        Ok(msg)
    }

    fn checked_key(&self, key: &str) -> DistResult<String> {
        let k = self.wire_key(key);
        if k.len() > MAX_KEY {
            return Err(DistError::Invalid(format!("a TCPStore key holds at most {MAX_KEY} bytes, not {}", k.len())));
        }
        Ok(k)
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.timeout
    }

    fn lock(&self) -> DistResult<MutexGuard<'_, Conn>> {
        let conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(why) = &conn.broken {
            return Err(DistError::Store(format!("the connection to the TCPStore at {} is unusable: {why}", self.addr)));
        }
        Ok(conn)
    }

    fn send(&self, conn: &mut Conn, msg: &[u8], deadline: Instant) -> DistResult<()> {
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        let sent = conn.stream.set_write_timeout(Some(left)).and_then(|_| conn.stream.write_all(msg));
        sent.map_err(|e| self.poison(conn, format!("writing: {e}")))
    }

    /// Sends one request and reads its reply with `reply`; a failure half-way breaks the
    /// connection for later calls (their replies would be out of step).
    fn request<R>(
        &self,
        msg: &[u8],
        deadline: Instant,
        reply: impl FnOnce(&mut Conn, Instant) -> DistResult<R>,
    ) -> DistResult<R> {
        let mut conn = self.lock()?;
        self.send(&mut conn, msg, deadline)?;
        reply(&mut conn, deadline).map_err(|e| match e {
            DistError::Timeout { .. } => {
                self.poison(&mut conn, "no reply".into());
                DistError::Timeout { what: format!("waiting for the TCPStore at {} to answer", self.addr), timeout: self.timeout }
            }
            e => self.poison(&mut conn, e.to_string()),
        })
    }

    fn poison(&self, conn: &mut Conn, why: String) -> DistError {
        conn.broken.get_or_insert(why.clone());
        DistError::Store(format!("the TCPStore at {}: {why}", self.addr))
    }
}

fn put_bytes(msg: &mut Vec<u8>, b: &[u8]) {
    msg.extend_from_slice(&(b.len() as u64).to_le_bytes());
    msg.extend_from_slice(b);
}

impl Conn {
    fn read_array<const N: usize>(&mut self, deadline: Instant) -> DistResult<[u8; N]> {
        let mut b = [0u8; N];
        read_exact_by(&mut self.stream, &mut b, deadline, "the store")?;
        Ok(b)
    }
    fn read_u8(&mut self, deadline: Instant) -> DistResult<u8> {
        Ok(self.read_array::<1>(deadline)?[0])
    }
    fn read_u32(&mut self, deadline: Instant) -> DistResult<u32> {
        Ok(u32::from_le_bytes(self.read_array(deadline)?))
    }
    fn read_u64(&mut self, deadline: Instant) -> DistResult<u64> {
        Ok(u64::from_le_bytes(self.read_array(deadline)?))
    }
    fn read_value(&mut self, deadline: Instant) -> DistResult<Vec<u8>> {
        let n = self.read_u64(deadline)?;
        if n > MAX_VALUE as u64 {
            return Err(DistError::Store(format!("announced a value of {n} bytes (at most {MAX_VALUE} accepted)")));
        }
        let mut v = vec![0u8; n as usize];
        read_exact_by(&mut self.stream, &mut v, deadline, "the store")?;
        Ok(v)
    }
}

#[cfg(test)]
#[path = "torch_store_tests.rs"]
mod tests;
