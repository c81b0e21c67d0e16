//! Seeded hostile clients against the rendezvous store: garbage and mutated handshakes, wrong
//! tokens, requests with random commands, oversized or lying lengths, non-UTF-8 keys and
//! bodies cut off anywhere. Every case must end promptly (a reply or a closed connection,
//! never a hang), every reply must be well formed, no connection thread may panic, nothing
//! larger than the caps may be stored, and a well-behaved client must still be served after
//! all of them.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::*;

const CASES: u64 = 300;
/// A case that takes longer than this has hung.
const CASE_LIMIT: Duration = Duration::from_secs(10);

static STORE_THREAD_PANICS: AtomicUsize = AtomicUsize::new(0);

/// The cases' random choices, from the workspace's keyed streams (seeded: a failing case
/// replays).
struct Rng(allgrad_rng::KeyedRng);

impl Rng {
    fn next(&mut self) -> u64 {
        rand::RngCore::next_u64(&mut self.0)
    }
    fn below(&mut self, n: u64) -> u64 {
        allgrad_rng::below(&mut self.0, n as usize) as u64
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

fn hello(token: &str) -> Vec<u8> {
    Hello { service: Service::Store, rank: 0, world: 0, token: token.into(), group: String::new() }.encode()
}

/// A request frame: command, key and value lengths as announced (which may lie), the argument,
/// then `body`.
fn request(cmd: u8, key_len: u32, val_len: u32, arg: u64, body: &[u8]) -> Vec<u8> {
    let mut b = vec![cmd];
    b.extend_from_slice(&key_len.to_le_bytes());
    b.extend_from_slice(&val_len.to_le_bytes());
    b.extend_from_slice(&arg.to_le_bytes());
    b.extend_from_slice(body);
    b
}

/// What one hostile client sends after connecting, and what it should see: `Reply::Handshake`
/// when the store's handshake reply comes first, `Reply::Waits` when the last request asks to
/// wait for a key for longer than an `Instant` can hold (the store must keep waiting, not
/// fail).
#[derive(Clone, Copy, PartialEq, Debug)]
enum Reply {
    Refused,
    Handshake,
    Waits,
}

fn hostile_bytes(r: &mut Rng) -> (Vec<u8>, Reply) {
    match r.below(6) {
        0 => {
            let n = r.below(64) as usize;
            (r.bytes(n), Reply::Refused)
        }
        1 => {
            let mut h = hello("tok");
            let i = r.below(h.len() as u64) as usize;
            h[i] ^= 1 + r.below(255) as u8;
            (h, Reply::Refused)
        }
        2 => (hello("tok-but-not-quite"), Reply::Refused),
        3 => {
            // Lying lengths (often over the caps), random command, body cut anywhere.
            let key_len = [r.below(16) as u32, MAX_KEY as u32 + 1, u32::MAX][r.below(3) as usize];
            let val_len = [r.below(64) as u32, MAX_VALUE as u32 + 1, u32::MAX][r.below(3) as usize];
            let body = {
                let n = r.below(128) as usize;
                r.bytes(n)
            };
            let mut b = hello("tok");
            b.extend(request(r.next() as u8, key_len, val_len, r.below(50), &body));
            let cut = 1 + r.below(b.len() as u64 - 1) as usize;
            b.truncate(cut.max(hello("tok").len()));
            (b, Reply::Handshake)
        }
        4 => {
            // Several complete requests: any command byte, keys that may not be UTF-8, waits
            // (GET's argument, in ms) kept short so that each reply comes soon.
            let mut b = hello("tok");
            for _ in 0..1 + r.below(4) {
                let key = {
                    let n = r.below(8) as usize;
                    r.bytes(n)
                };
                let val = {
                    let n = r.below(32) as usize;
                    r.bytes(n)
                };
                let mut frame = request(r.below(8) as u8, key.len() as u32, val.len() as u32, r.below(30), &key);
                frame.extend(val);
                b.extend(frame);
            }
            (b, Reply::Handshake)
        }
        _ => {
            // GET with a wait too long to represent: the server must not panic on it.
            let mut b = hello("tok");
            b.extend(request(CMD_GET, 3, 0, u64::MAX, b"zzz"));
            (b, Reply::Waits)
        }
    }
}

/// Reads replies until the store closes the connection or `limit` passes; checks that they
/// are well formed. Returns the number of replies.
fn drain_replies(s: &mut TcpStream, handshake: bool, limit: Duration) -> Result<usize, String> {
    let start = Instant::now();
    s.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        match s.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(_) => break, // reset by the store: a closed connection
        }
        if start.elapsed() > limit {
            return Err(format!("no end after {limit:?} ({} bytes read)", buf.len()));
        }
    }
    let mut at = 0;
    let reply = hello("tok");
    // A mutated handshake that only touched fields the store does not check (rank, world,
    // group) is a valid one: the store's reply may come then too, and nothing after it.
    let accepted = buf.starts_with(&reply);
    if handshake && !buf.is_empty() && !accepted {
        return Err(format!("malformed handshake reply {:?}", &buf[..buf.len().min(reply.len())]));
    }
    if accepted {
        at = reply.len();
        if !handshake && buf.len() > at {
            return Err(format!("{} bytes after the handshake, but no request was sent", buf.len() - at));
        }
    }
    let mut replies = 0;
    while at < buf.len() {
        if buf.len() < at + 5 {
            return Err(format!("truncated reply header at byte {at}"));
        }
        let status = buf[at];
        let len = u32::from_le_bytes(buf[at + 1..at + 5].try_into().unwrap()) as usize;
        if status > ST_ERROR || len > MAX_VALUE || buf.len() < at + 5 + len {
            return Err(format!("malformed reply at byte {at}: status {status}, length {len}"));
        }
        at += 5 + len;
        replies += 1;
    }
    Ok(replies)
}

#[test]
fn hostile_clients_get_prompt_well_formed_answers_and_the_store_keeps_serving() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if std::thread::current().name() == Some("allgrad-store-conn") {
            STORE_THREAD_PANICS.fetch_add(1, Ordering::SeqCst);
        }
        previous(info);
    }));
    let server = StoreServer::start("127.0.0.1:0", "tok").unwrap();
    let addr = server.addr().to_string();
    let mut r = Rng(allgrad_rng::stream(&[0xA11_6AAD]));
    let (mut replies, mut cases) = (0, 0);
    for case in 0..CASES {
        let (bytes, expect) = hostile_bytes(&mut r);
        let mut s = TcpStream::connect(&addr).unwrap();
        let _ = s.write_all(&bytes);
        let _ = s.shutdown(Shutdown::Write);
        if expect == Reply::Waits {
            // Still waiting after a while: neither a reply nor a closed (panicked) connection.
            let e = drain_replies(&mut s, true, Duration::from_millis(300)).expect_err("an endless GET ended");
            assert!(e.starts_with("no end"), "case {case}: {e}");
        } else {
            match drain_replies(&mut s, expect == Reply::Handshake, CASE_LIMIT) {
                Ok(n) => replies += n,
                Err(e) => panic!("case {case} ({} bytes sent): {e}", bytes.len()),
            }
        }
        cases += 1;
    }
    println!("{cases} hostile store clients, {replies} well-formed replies");
    assert_eq!(STORE_THREAD_PANICS.load(Ordering::SeqCst), 0, "a store connection thread panicked");
    let t = server.shared.table.lock().unwrap();
    assert!(t.map.keys().all(|k| k.len() <= MAX_KEY) && t.map.values().all(|v| v.len() <= MAX_VALUE));
    assert!(t.bytes <= MAX_TOTAL);
    drop(t);
    let c = StoreClient::connect(&addr, "tok", 0, Duration::from_secs(5)).unwrap();
    c.set("after", b"fuzz").unwrap();
    assert_eq!(c.get("after").unwrap(), b"fuzz");
}
