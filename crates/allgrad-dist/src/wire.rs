//! Bytes on the wire: the connection handshake, frame headers, and deadline-bounded reads.
//!
//! Every connection (store or data plane) starts with a [`Hello`] from each side carrying the
//! job token; a connection whose token does not match is dropped before anything else is
//! read from it. Every length read from a peer is checked against a fixed bound, or against
//! the size this rank expects, before any buffer is allocated.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::error::{DistError, DistResult};

const MAGIC: [u8; 4] = *b"AGRD";
const VERSION: u16 = 1;
/// Longest token or group name accepted in a handshake.
const MAX_HELLO_FIELD: usize = 1024;

/// Which service a connection is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub(crate) enum Service {
    Store = 1,
    Data = 2,
}

/// The first message on every connection, sent by both sides.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Hello {
    pub service: Service,
    pub rank: u32,
    pub world: u32,
    pub token: String,
    pub group: String,
}

impl Hello {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(20 + self.token.len() + self.group.len());
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&(self.service as u16).to_le_bytes());
        b.extend_from_slice(&self.rank.to_le_bytes());
        b.extend_from_slice(&self.world.to_le_bytes());
        for s in [&self.token, &self.group] {
            b.extend_from_slice(&(s.len() as u16).to_le_bytes());
            b.extend_from_slice(s.as_bytes());
        }
        b
    }

    /// Reads a hello, checking every field before trusting it. `who` names the remote side.
    pub fn read(stream: &mut TcpStream, deadline: Instant, who: &str) -> DistResult<Hello> {
        let bad = |detail: String| DistError::Unauthenticated { addr: who.to_string(), detail };
        let mut fixed = [0u8; 16];
        read_exact_by(stream, &mut fixed, deadline, who)?;
        if fixed[0..4] != MAGIC {
            return Err(bad("not an allgrad peer (bad magic)".into()));
        }
        let version = u16::from_le_bytes([fixed[4], fixed[5]]);
        if version != VERSION {
            return Err(bad(format!("protocol version {version}, expected {VERSION}")));
        }
        let service = match u16::from_le_bytes([fixed[6], fixed[7]]) {
            1 => Service::Store,
            2 => Service::Data,
            s => return Err(bad(format!("unknown service {s}"))),
        };
        let rank = u32::from_le_bytes(fixed[8..12].try_into().unwrap());
        let world = u32::from_le_bytes(fixed[12..16].try_into().unwrap());
        let mut fields = Vec::with_capacity(2);
        for name in ["token", "group"] {
            let mut len = [0u8; 2];
            read_exact_by(stream, &mut len, deadline, who)?;
            let len = u16::from_le_bytes(len) as usize;
            if len > MAX_HELLO_FIELD {
                return Err(bad(format!("{name} of {len} bytes (at most {MAX_HELLO_FIELD})")));
            }
            let mut v = vec![0u8; len];
            read_exact_by(stream, &mut v, deadline, who)?;
            fields.push(String::from_utf8(v).map_err(|_| bad(format!("{name} is not UTF-8")))?);
        }
        let group = fields.pop().unwrap();
        let token = fields.pop().unwrap();
        Ok(Hello { service, rank, world, token, group })
    }
}

/// Compares two secrets in time independent of where they differ.
pub(crate) fn same_secret(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut diff = (a.len() != b.len()) as u8;
    for i in 0..a.len().max(b.len()) {
        diff |= a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0);
    }
    diff == 0
}

/// Reads exactly `buf.len()` bytes from a blocking stream before `deadline`.
pub(crate) fn read_exact_by(stream: &mut TcpStream, buf: &mut [u8], deadline: Instant, who: &str) -> DistResult<()> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(DistError::Timeout { what: format!("reading from {who}"), timeout: Duration::ZERO });
        }
        stream
            .set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .map_err(|e| DistError::io(format!("setting a read timeout on {who}"), e))?;
        match stream.read(&mut buf[got..]) {
            Ok(0) => {
                return Err(DistError::io(
                    format!("reading from {who}"),
                    std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "connection closed"),
                ))
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(e) => return Err(DistError::io(format!("reading from {who}"), e)),
        }
    }
    Ok(())
}

/// Writes all of `buf` to a blocking stream before `deadline`.
pub(crate) fn write_all_by(stream: &mut TcpStream, buf: &[u8], deadline: Instant, who: &str) -> DistResult<()> {
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    stream.set_write_timeout(Some(left)).map_err(|e| DistError::io(format!("setting a write timeout on {who}"), e))?;
    stream.write_all(buf).map_err(|e| DistError::io(format!("writing to {who}"), e))
}

/// Frame kinds on the data plane.
pub(crate) const KIND_DATA: u8 = 1;
pub(crate) const KIND_ABORT: u8 = 2;
/// Longest abort reason a peer may send.
pub(crate) const MAX_ABORT_REASON: u64 = 16 * 1024;

/// The fixed-size header in front of every data-plane frame. It identifies the collective
/// call (sequence number, op, dtype, reduce op, a digest of the shape) so that ranks which
/// disagree on what they are doing fail with a message instead of mixing up bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub(crate) struct Header {
    pub kind: u8,
    pub op: u8,
    pub dtype: u8,
    pub redop: u8,
    pub seq: u64,
    pub step: u32,
    pub len: u64,
    pub meta: u64,
}

pub(crate) const HEADER_LEN: usize = 40;

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = self.kind;
        b[5] = self.op;
        b[6] = self.dtype;
        b[7] = self.redop;
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..20].copy_from_slice(&self.step.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b[32..40].copy_from_slice(&self.meta.to_le_bytes());
        b
    }

    /// Decodes a header; `None` when the magic is wrong.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Option<Header> {
        if b[0..4] != MAGIC {
            return None;
        }
        Some(Header {
            kind: b[4],
            op: b[5],
            dtype: b[6],
            redop: b[7],
            seq: u64::from_le_bytes(b[8..16].try_into().unwrap()),
            step: u32::from_le_bytes(b[16..20].try_into().unwrap()),
            len: u64::from_le_bytes(b[24..32].try_into().unwrap()),
            meta: u64::from_le_bytes(b[32..40].try_into().unwrap()),
        })
    }
}

/// A 64-bit FNV-1a digest, used to compare shapes across ranks cheaply.
pub(crate) fn digest(words: &[u64]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for w in words {
        for byte in w.to_le_bytes() {
            h ^= byte as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// Waits until one of `fds` is ready or `timeout` passes; returns the revents of each.
pub(crate) fn poll(fds: &mut [libc::pollfd], timeout: Duration) -> std::io::Result<usize> {
    let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
    loop {
        // SAFETY: `fds` is a valid, exclusively borrowed slice of pollfd for the whole call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

pub(crate) fn pollfd(stream: &TcpStream, events: libc::c_short) -> libc::pollfd {
    libc::pollfd { fd: stream.as_raw_fd(), events, revents: 0 }
}

/// Connections a listener queues before accepting them. The kernel caps it at
/// `net.core.somaxconn` (4096 on current kernels). The standard library listens with 128: when
/// a thousand ranks connect to rank 0's store or data plane at once, the connections past the
/// queue lose their SYN and wait a second or more for its retransmission.
pub(crate) const LISTEN_BACKLOG: libc::c_int = 4096;

/// A TCP listener on `addr` (port 0: a free one) with [`LISTEN_BACKLOG`], address reuse as
/// the standard library sets it, and close-on-exec.
pub(crate) fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    use std::os::fd::FromRawFd;
    let (family, storage, len) = sockaddr(addr);
    // SAFETY: plain syscalls on a socket this function creates and owns until it is handed to
    // the TcpListener (or closed on error); `storage` outlives the bind call and `len` is its
    // valid size for `family`.
    unsafe {
        let fd = libc::socket(family, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let fail = |fd| {
            let e = std::io::Error::last_os_error();
            libc::close(fd);
            Err(e)
        };
        let one: libc::c_int = 1;
        let opt = &one as *const libc::c_int as *const libc::c_void;
        if libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_REUSEADDR, opt, std::mem::size_of::<libc::c_int>() as libc::socklen_t)
            != 0
        {
            return fail(fd);
        }
        if libc::bind(fd, &storage as *const libc::sockaddr_storage as *const libc::sockaddr, len) != 0 {
            return fail(fd);
        }
        if libc::listen(fd, LISTEN_BACKLOG) != 0 {
            return fail(fd);
        }
        Ok(TcpListener::from_raw_fd(fd))
    }
}

/// `addr` as a C socket address: family, storage and length.
fn sockaddr(addr: SocketAddr) -> (libc::c_int, libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: all-zero sockaddr_storage, sockaddr_in and sockaddr_in6 are valid values; the
    // storage is then written as the one it has room for (it is larger and suitably aligned
    // for both).
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match addr {
        SocketAddr::V4(a) => {
            let mut sin: libc::sockaddr_in = unsafe { std::mem::zeroed() };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_port = a.port().to_be();
            sin.sin_addr = libc::in_addr { s_addr: u32::from_ne_bytes(a.ip().octets()) };
            unsafe { std::ptr::write(&mut storage as *mut _ as *mut libc::sockaddr_in, sin) };
            (libc::AF_INET, storage, std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t)
        }
        SocketAddr::V6(a) => {
            let mut sin6: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_port = a.port().to_be();
            sin6.sin6_flowinfo = a.flowinfo();
            sin6.sin6_addr = libc::in6_addr { s6_addr: a.ip().octets() };
            sin6.sin6_scope_id = a.scope_id();
            unsafe { std::ptr::write(&mut storage as *mut _ as *mut libc::sockaddr_in6, sin6) };
            (libc::AF_INET6, storage, std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t)
        }
    }
}

/// Larger kernel socket buffers let a ring step stream without stalling on the peer.
pub(crate) fn tune_data_socket(stream: &TcpStream) {
    let _ = stream.set_nodelay(true);
    let size: libc::c_int = 4 << 20;
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        // SAFETY: setsockopt reads `size` (a c_int that outlives the call) on a valid socket fd.
        unsafe {
            libc::setsockopt(
                stream.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                &size as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listeners_queue_more_connections_than_the_standard_librarys_128() {
        // Nothing accepts: every connection below the backlog still completes its handshake.
        for addr in ["127.0.0.1:0", "[::1]:0"] {
            let Ok(l) = listen(addr.parse().unwrap()) else { continue }; // no IPv6 here
            let target = l.local_addr().unwrap();
            assert_ne!(target.port(), 0);
            let conns: Vec<TcpStream> = (0..200)
                .map(|i| {
                    TcpStream::connect_timeout(&target, Duration::from_millis(500))
                        .unwrap_or_else(|e| panic!("connection {i} to {target}: {e}"))
                })
                .collect();
            assert_eq!(conns.len(), 200);
            // And they are accepted in order afterwards.
            let (s, _) = l.accept().unwrap();
            assert_eq!(s.peer_addr().unwrap(), conns[0].local_addr().unwrap());
        }
    }

    #[test]
    fn header_round_trips() {
        let h = Header { kind: KIND_DATA, op: 3, dtype: 7, redop: 2, seq: 1 << 40, step: 9, len: 12345, meta: 77 };
        assert_eq!(Header::decode(&h.encode()), Some(h));
        let mut bad = h.encode();
        bad[0] = b'X';
        assert_eq!(Header::decode(&bad), None);
    }

    #[test]
    fn secrets_compare_by_content() {
        assert!(same_secret("abc", "abc"));
        assert!(!same_secret("abc", "abd"));
        assert!(!same_secret("abc", "abcd"));
        assert!(!same_secret("", "a"));
    }
}
