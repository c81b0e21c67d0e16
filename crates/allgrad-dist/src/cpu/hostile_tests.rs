//! Hostile and malformed peers on the data plane.
//!
//! - Intruders (a handshake with the wrong token, garbage bytes, a connection that sends
//!   nothing, the right token for the wrong service, an oversized handshake field) connect
//!   to rank 0 before the real rank 1: they are dropped without learning anything, and both
//!   real ranks come up and all_reduce correctly.
//! - A fake rank 1 that completes the handshake and the group setup (declining shared
//!   memory, so the group stays on TCP) and then sends a malformed frame (bad magic,
//!   a DATA header claiming u64::MAX bytes, an oversized ABORT reason, ...) makes rank 0's
//!   collective fail promptly, naming rank 1, without panicking, allocating the claimed size
//!   or waiting for the timeout; rank 0 then tells the peer why with an ABORT frame.
//!
//! - A fake rank 1 that answers the group setup with a malformed frame makes rank 0's init fail
//!   promptly, naming it.
//!
//! Ranks run on threads started by hand; every join has a watchdog so a hang fails the test.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::cpu::mesh::OpCode;
use crate::error::DistError;
use crate::group::ProcessGroup;
use crate::reduce::ReduceOp;
use crate::rendezvous::env::WorldInfo;
use crate::rendezvous::store::StoreClient;
use crate::wire::{Header, Hello, Service, HEADER_LEN, KIND_ABORT, KIND_DATA, MAX_ABORT_REASON};

/// Timeout of every blocking call of the ranks under test.
const TIMEOUT: Duration = Duration::from_secs(10);
/// How long a hostile frame may take to make rank 0 fail (well under TIMEOUT).
const PROMPT: Duration = Duration::from_secs(3);

/// A port that was free a moment ago.
fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("binding a probe listener");
    l.local_addr().unwrap().port()
}

fn world_info(rank: usize, port: u16, token: &str) -> WorldInfo {
    world_info_with_timeout(rank, port, token, TIMEOUT)
}

fn world_info_with_timeout(rank: usize, port: u16, token: &str, timeout: Duration) -> WorldInfo {
    WorldInfo {
        rank,
        world_size: 2,
        local_rank: rank,
        local_world_size: 2,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        token: token.into(),
        timeout,
        elastic: None,
    }
}

/// A thread whose join is bounded: a hang or a panic fails the test with a message.
struct Guarded<T> {
    what: String,
    rx: mpsc::Receiver<std::thread::Result<T>>,
}

fn spawn_guarded<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> Guarded<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name(what.into())
        .spawn(move || {
            let _ = tx.send(catch_unwind(AssertUnwindSafe(f)));
        })
        .expect("spawning a test thread");
    Guarded { what: what.into(), rx }
}

impl<T> Guarded<T> {
    fn join(self, limit: Duration) -> T {
        match self.rx.recv_timeout(limit) {
            Ok(Ok(v)) => v,
            Ok(Err(p)) => {
                let msg = p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned());
                panic!("{} panicked: {}", self.what, msg.unwrap_or_default())
            }
            Err(_) => panic!("watchdog: {} did not finish within {limit:?}", self.what),
        }
    }
}

/// Rank 0's data-plane address, read from its store as any member would.
fn rank0_data_addr(port: u16, token: &str) -> String {
    let store = StoreClient::connect(&format!("127.0.0.1:{port}"), token, 1, TIMEOUT).expect("connecting to rank 0's store");
    let raw = store.get("world/addr/0").expect("reading rank 0's data-plane address");
    String::from_utf8(raw).expect("a UTF-8 address")
}

/// Reads exactly `buf.len()` bytes within `limit`.
fn read_exact_within(s: &mut TcpStream, buf: &mut [u8], limit: Duration) -> std::io::Result<()> {
    s.set_read_timeout(Some(limit))?;
    s.read_exact(buf)
}

/// Whether the other side closed `s` without sending anything (within `limit`).
fn closed_without_reply(s: &mut TcpStream, limit: Duration) -> Result<(), String> {
    s.set_read_timeout(Some(limit)).unwrap();
    let mut buf = [0u8; 256];
    match s.read(&mut buf) {
        Ok(0) => Ok(()),
        Ok(n) => Err(format!("got {n} bytes back: {:?}", String::from_utf8_lossy(&buf[..n]))),
        Err(e) if matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted) => Ok(()),
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => Err(format!("still open after {limit:?}")),
        Err(e) => Err(format!("read failed: {e}")),
    }
}

fn data_hello(rank: u32, token: &str, group: &str, service: Service) -> Hello {
    Hello { service, rank, world: 2, token: token.into(), group: group.into() }
}

/// Reads rank 0's first group-setup frame (its host and shared-memory offer); returns its
/// header.
fn read_setup_offer(s: &mut TcpStream, case: &str) -> Header {
    let mut hdr = [0u8; HEADER_LEN];
    read_exact_within(s, &mut hdr, TIMEOUT).unwrap_or_else(|e| panic!("{case}: reading rank 0's setup frame: {e}"));
    let h = Header::decode(&hdr).unwrap_or_else(|| panic!("{case}: rank 0's setup frame has bad magic"));
    assert_eq!((h.kind, h.op, h.seq), (KIND_DATA, OpCode::Setup as u8, 0), "{case}: rank 0's setup header {h:?}");
    assert!(h.len <= 64, "{case}: setup offer of {} bytes", h.len);
    let mut body = vec![0u8; h.len as usize];
    read_exact_within(s, &mut body, TIMEOUT).unwrap();
    h
}

/// The fake rank 1's part of the group setup: an offer of zeros (unknown host, no shared
/// memory), so the group stays on TCP.
fn fake_setup(s: &mut TcpStream, case: &str) {
    let h = read_setup_offer(s, case);
    let mut reply = h.encode().to_vec();
    reply.resize(HEADER_LEN + h.len as usize, 0);
    s.write_all(&reply).unwrap();
}

#[test]
fn intruders_are_dropped_and_the_real_ranks_still_connect_and_all_reduce() {
    let port = free_port();
    let token = "hostile-test-token-intruders";
    let start = Instant::now();
    let rank0 = spawn_guarded("rank 0", move || -> Result<(Vec<f32>, Duration), String> {
        let pg = ProcessGroup::init(&world_info(0, port, token)).map_err(|e| format!("init: {e}"))?;
        let joined = start.elapsed();
        let mut x = [1.0f32, -2.5, 3.25, 0.0];
        pg.all_reduce_slice(&mut x, ReduceOp::Sum).map_err(|e| format!("all_reduce: {e}"))?;
        Ok((x.to_vec(), joined))
    });
    let addr = rank0_data_addr(port, token);

    // 1. A handshake with the wrong token.
    let mut wrong_token = TcpStream::connect(&addr).unwrap();
    wrong_token.write_all(&data_hello(1, "not-the-token", "world", Service::Data).encode()).unwrap();
    // 2. Garbage instead of a handshake (write errors are fine: rank 0 may close first).
    let mut garbage = TcpStream::connect(&addr).unwrap();
    let _ = garbage.write_all(&[0xA5; 512]);
    // 3. A connection that never sends anything (kept open until the end).
    let silent = TcpStream::connect(&addr).unwrap();
    // 4. The right token, but for the store service.
    let mut wrong_service = TcpStream::connect(&addr).unwrap();
    wrong_service.write_all(&data_hello(1, token, "world", Service::Store).encode()).unwrap();
    // 5. Valid magic, version and service, then a token length of 65535 (over the limit).
    let mut oversized = TcpStream::connect(&addr).unwrap();
    let mut h = data_hello(1, "", "world", Service::Data).encode();
    h[16..18].copy_from_slice(&u16::MAX.to_le_bytes());
    let _ = oversized.write_all(&h[..18]);
    // 6. A truncated handshake, then the connection closes.
    {
        let mut truncated = TcpStream::connect(&addr).unwrap();
        let _ = truncated.write_all(&data_hello(1, token, "world", Service::Data).encode()[..10]);
    }

    // Every rejected intruder is disconnected without a reply (rank 0 must not hand its own
    // handshake, token included, to an unauthenticated peer), while rank 0 is still waiting
    // for the real rank 1.
    for (name, s) in [
        ("wrong token", &mut wrong_token),
        ("garbage", &mut garbage),
        ("wrong service", &mut wrong_service),
        ("oversized token", &mut oversized),
    ] {
        if let Err(e) = closed_without_reply(s, Duration::from_secs(5)) {
            panic!("intruder with {name}: {e}");
        }
    }

    // The real rank 1 comes up and the collective is right.
    let rank1 = spawn_guarded("rank 1", move || -> Result<Vec<f32>, String> {
        let pg = ProcessGroup::init(&world_info(1, port, token)).map_err(|e| format!("init: {e}"))?;
        let mut x = [0.5f32, 4.0, -0.25, 7.0];
        pg.all_reduce_slice(&mut x, ReduceOp::Sum).map_err(|e| format!("all_reduce: {e}"))?;
        Ok(x.to_vec())
    });
    let want = vec![1.5f32, 1.5, 3.0, 7.0];
    let got1 = rank1.join(Duration::from_secs(20)).unwrap_or_else(|e| panic!("rank 1: {e}"));
    let (got0, joined) = rank0.join(Duration::from_secs(20)).unwrap_or_else(|e| panic!("rank 0: {e}"));
    assert_eq!(got0, want, "rank 0's all_reduce");
    assert_eq!(got1, want, "rank 1's all_reduce");
    // The silent intruder's handshake grace is 10 s; rank 0 must not have waited on it.
    assert!(joined < Duration::from_secs(8), "rank 0 took {joined:?} to join with intruders around");
    drop(silent);
}

/// How rank 0's collective must end after the hostile bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ends {
    /// With an error well before the timeout: the bytes themselves are wrong.
    Promptly,
    /// With a timeout error: the bytes are a valid prefix (a truncated frame on a connection
    /// left open), indistinguishable from a slow peer until the deadline.
    AtTheTimeout,
}

/// Rank 0 of a 2-rank world runs an all_reduce of 4 f32 against a fake rank 1 that completes
/// the handshake, reads rank 0's frame, and answers with `hostile(&rank0_header)`. Returns
/// rank 0's error, after checking it came promptly, that rank 0 sent an ABORT frame, and that
/// the group stays poisoned (its next collective fails at once instead of half-working).
pub(crate) fn rank0_error_after_hostile_frame(case: &str, hostile: impl FnOnce(&Header) -> Vec<u8>) -> String {
    rank0_error_after_hostile_bytes(case, TIMEOUT, Ends::Promptly, hostile)
}

/// As [`rank0_error_after_hostile_frame`], with the group's `timeout` and how the call must end.
pub(crate) fn rank0_error_after_hostile_bytes(
    case: &str,
    timeout: Duration,
    ends: Ends,
    hostile: impl FnOnce(&Header) -> Vec<u8>,
) -> String {
    let port = free_port();
    let token = "hostile-test-token-frames";
    type Failure = (String, Duration, Result<(), String>, Duration);
    let rank0 = spawn_guarded(&format!("rank 0 ({case})"), move || -> Result<Duration, Failure> {
        let init = |e: DistError| (format!("init: {e}"), Duration::ZERO, Ok(()), Duration::ZERO);
        let pg = ProcessGroup::init(&world_info_with_timeout(0, port, token, timeout)).map_err(init)?;
        let t = Instant::now();
        let mut x = [1.0f32, 2.0, 3.0, 4.0];
        match pg.all_reduce_slice(&mut x, ReduceOp::Sum) {
            Ok(()) => Ok(t.elapsed()),
            Err(e) => {
                let first = t.elapsed();
                // The group must stay poisoned: the next call fails without touching the peer.
                let t = Instant::now();
                let again = pg.all_reduce_slice(&mut x, ReduceOp::Sum).map_err(|e| e.to_string());
                Err((e.to_string(), first, again, t.elapsed()))
            }
        }
    });
    let addr = rank0_data_addr(port, token);

    // The fake rank 1: a correct handshake.
    let mut s = TcpStream::connect(&addr).unwrap();
    s.write_all(&data_hello(1, token, "world", Service::Data).encode()).unwrap();
    let reply = Hello::read(&mut s, Instant::now() + TIMEOUT, "rank 0").unwrap_or_else(|e| panic!("{case}: handshake: {e}"));
    assert_eq!((reply.service, reply.rank, reply.group.as_str()), (Service::Data, 0, "world"), "{case}: rank 0's handshake");
    fake_setup(&mut s, case);

    // Rank 0's all_reduce frame: a header and 16 bytes.
    let mut hdr = [0u8; HEADER_LEN];
    read_exact_within(&mut s, &mut hdr, TIMEOUT).unwrap_or_else(|e| panic!("{case}: reading rank 0's frame: {e}"));
    let h = Header::decode(&hdr).unwrap_or_else(|| panic!("{case}: rank 0 sent a header with bad magic"));
    assert_eq!((h.kind, h.len), (KIND_DATA, 16), "{case}: rank 0's header {h:?}");
    let mut body = [0u8; 16];
    read_exact_within(&mut s, &mut body, TIMEOUT).unwrap();

    // The hostile answer; the connection stays open, so only the frame can end the call.
    let _ = s.write_all(&hostile(&h));
    let err = match rank0.join(timeout + Duration::from_secs(10)) {
        Ok(t) => panic!("{case}: rank 0's all_reduce succeeded after {t:?}"),
        Err((e, t, again, t_again)) => {
            match ends {
                Ends::Promptly => {
                    assert!(t < PROMPT, "{case}: rank 0 took {t:?} to fail: {e}");
                    assert!(
                        !e.contains("timed out"),
                        "{case}: rank 0 waited for the timeout instead of rejecting the frame: {e}"
                    );
                }
                Ends::AtTheTimeout => {
                    assert!(e.contains("timed out"), "{case}: expected a timeout error: {e}");
                    assert!(
                        t >= timeout.mul_f64(0.9) && t < timeout + PROMPT,
                        "{case}: the timeout of {timeout:?} fired after {t:?}"
                    );
                }
            }
            match again {
                Ok(()) => panic!("{case}: the group worked again after failing with: {e}"),
                Err(e2) => assert!(t_again < PROMPT, "{case}: the poisoned group's next call took {t_again:?} to fail: {e2}"),
            }
            e
        }
    };
    // Rank 0 tells the peer why it gave up: an ABORT frame with a bounded reason.
    let mut hdr = [0u8; HEADER_LEN];
    read_exact_within(&mut s, &mut hdr, PROMPT).unwrap_or_else(|e| panic!("{case}: no ABORT frame from rank 0: {e}"));
    let h = Header::decode(&hdr).unwrap_or_else(|| panic!("{case}: rank 0's ABORT frame has bad magic"));
    assert_eq!(h.kind, KIND_ABORT, "{case}: expected an ABORT frame, got {h:?}");
    assert!(h.len <= MAX_ABORT_REASON, "{case}: abort reason of {} bytes", h.len);
    let mut reason = vec![0u8; h.len as usize];
    read_exact_within(&mut s, &mut reason, PROMPT).unwrap();
    let reason = String::from_utf8_lossy(&reason);
    // A refused frame names its sender; a timeout names the ranks it was waiting for.
    let peer = if ends == Ends::Promptly { "rank 1" } else { "rank(s) [1]" };
    assert!(reason.contains("rank 0 failed") && reason.contains(peer), "{case}: abort reason {reason:?}");
    err
}

fn assert_names_rank1(case: &str, err: &str, also: &str) {
    assert!(err.contains("rank 1"), "{case}: the error does not name the peer: {err}");
    assert!(err.contains(also), "{case}: the error does not mention {also:?}: {err}");
}

#[test]
fn frame_with_bad_magic_fails_the_collective_naming_the_peer() {
    let err = rank0_error_after_hostile_frame("bad magic", |h| {
        let mut b = h.encode().to_vec();
        b[0..4].copy_from_slice(b"EVIL");
        b.extend_from_slice(&[0u8; 16]);
        b
    });
    assert_names_rank1("bad magic", &err, "magic");
}

#[test]
fn data_header_claiming_u64_max_bytes_fails_without_allocating() {
    // Identical to the header rank 0 expects except for the length.
    let err = rank0_error_after_hostile_frame("len u64::MAX", |h| Header { len: u64::MAX, ..*h }.encode().to_vec());
    assert_names_rank1("len u64::MAX", &err, &u64::MAX.to_string());
    // And with nothing else right either (another op, dtype and call number).
    let err = rank0_error_after_hostile_frame("len u64::MAX, other call", |_| {
        Header { kind: KIND_DATA, op: 7, dtype: 3, redop: 0, seq: 99, step: 1, len: u64::MAX, meta: 0 }.encode().to_vec()
    });
    assert_names_rank1("len u64::MAX, other call", &err, "all_to_all");
}

#[test]
fn abort_header_with_oversized_reason_fails_without_allocating() {
    for len in [MAX_ABORT_REASON + 1, u64::MAX] {
        let case = format!("abort reason of {len} bytes");
        let err =
            rank0_error_after_hostile_frame(&case, |_| Header { kind: KIND_ABORT, len, ..Default::default() }.encode().to_vec());
        assert_names_rank1(&case, &err, &len.to_string());
    }
}

#[test]
fn header_of_unknown_kind_fails_the_collective_naming_the_peer() {
    let err = rank0_error_after_hostile_frame("unknown kind", |h| Header { kind: 77, ..*h }.encode().to_vec());
    assert_names_rank1("unknown kind", &err, "all_reduce");
}

#[test]
fn valid_abort_from_the_peer_is_reported_with_its_reason() {
    let err = rank0_error_after_hostile_frame("well-formed abort", |_| {
        let reason = b"out of memory on the fake rank";
        let mut b = Header { kind: KIND_ABORT, len: reason.len() as u64, ..Default::default() }.encode().to_vec();
        b.extend_from_slice(reason);
        b
    });
    assert_names_rank1("well-formed abort", &err, "out of memory on the fake rank");
}

#[test]
fn header_split_across_writes_then_truncated_body_reports_the_closed_peer() {
    // A correct header sent in two pieces, half the body, then the fake rank 1 disappears.
    let port = free_port();
    let token = "hostile-test-token-truncated";
    let rank0 = spawn_guarded("rank 0 (truncated body)", move || -> Result<(), String> {
        let pg = ProcessGroup::init(&world_info(0, port, token)).map_err(|e| format!("init: {e}"))?;
        let mut x = [1.0f32, 2.0, 3.0, 4.0];
        pg.all_reduce_slice(&mut x, ReduceOp::Sum).map_err(|e| e.to_string())
    });
    let addr = rank0_data_addr(port, token);
    let mut s = TcpStream::connect(&addr).unwrap();
    s.write_all(&data_hello(1, token, "world", Service::Data).encode()).unwrap();
    Hello::read(&mut s, Instant::now() + TIMEOUT, "rank 0").unwrap();
    fake_setup(&mut s, "truncated body");
    let mut frame = [0u8; HEADER_LEN + 16];
    read_exact_within(&mut s, &mut frame, TIMEOUT).unwrap();
    let start = Instant::now();
    s.write_all(&frame[..13]).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    s.write_all(&frame[13..HEADER_LEN + 8]).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    drop(s);
    let err = rank0.join(TIMEOUT + Duration::from_secs(10)).expect_err("rank 0's all_reduce succeeded with half a frame");
    assert!(start.elapsed() < PROMPT, "rank 0 took {:?} to notice: {err}", start.elapsed());
    assert!(err.contains("rank 1") && err.contains("closed"), "{err}");
}

#[test]
fn malformed_setup_frame_fails_init_naming_the_peer() {
    // A setup answer of the wrong length, then one claiming u64::MAX bytes, then an unknown op.
    type Answer = fn(&Header) -> Vec<u8>;
    let cases: [(&str, Answer); 3] = [
        ("short offer", |h| {
            let mut b = Header { len: 8, ..*h }.encode().to_vec();
            b.extend_from_slice(&[0u8; 8]);
            b
        }),
        ("offer of u64::MAX bytes", |h| Header { len: u64::MAX, ..*h }.encode().to_vec()),
        ("another op", |h| {
            let mut b = Header { op: OpCode::AllReduce as u8, ..*h }.encode().to_vec();
            b.resize(HEADER_LEN + h.len as usize, 0);
            b
        }),
    ];
    for (case, hostile) in cases {
        let port = free_port();
        let token = "hostile-test-token-setup";
        let rank0 = spawn_guarded(&format!("rank 0 ({case})"), move || {
            let t = Instant::now();
            let r = ProcessGroup::init(&world_info(0, port, token)).map(|_| ()).map_err(|e| e.to_string());
            (r, t.elapsed())
        });
        let addr = rank0_data_addr(port, token);
        let mut s = TcpStream::connect(&addr).unwrap();
        s.write_all(&data_hello(1, token, "world", Service::Data).encode()).unwrap();
        Hello::read(&mut s, Instant::now() + TIMEOUT, "rank 0").unwrap();
        let h = read_setup_offer(&mut s, case);
        let start = Instant::now();
        let _ = s.write_all(&hostile(&h));
        let (res, _) = rank0.join(TIMEOUT + Duration::from_secs(10));
        let err = res.err().unwrap_or_else(|| panic!("{case}: rank 0 joined after a malformed setup frame"));
        assert!(start.elapsed() < PROMPT, "{case}: rank 0 took {:?} to fail: {err}", start.elapsed());
        assert_names_rank1(case, &err, "group setup");
    }
}

// ------------------------------------------------------------------ the message cap

#[test]
fn peer_announced_sizes_over_the_cap_fail_every_rank_before_allocating_and_poison_the_group() {
    use crate::threads::ThreadWorld;
    const CAP: u64 = 4096;
    let out = ThreadWorld::new(2)
        .timeout(TIMEOUT)
        .max_message_bytes_for_test(CAP)
        .run(|pg| {
            assert_eq!(pg.max_message_bytes(), CAP);
            // Exactly the cap is accepted: 4 + 1020 f32.
            let fits = vec![1f32; if pg.rank() == 0 { 4 } else { 1020 }];
            let (got, counts) = pg.all_gather_v_slice(&fits, &[])?;
            assert_eq!((got.len(), counts), (1024, vec![4, 1020]));
            // Rank 1 announces 2000 f32: 8032 bytes in all, over the cap of rank 0 (and its own).
            let over = vec![1f32; if pg.rank() == 0 { 8 } else { 2000 }];
            let err = pg.all_gather_v_slice(&over, &[]).expect_err("a gather over the cap succeeded").to_string();
            let after = pg.barrier().expect_err("the group still worked after the refused gather").to_string();
            Ok((err, after))
        })
        .unwrap();
    for (rank, (err, after)) in out.iter().enumerate() {
        assert!(err.contains("over the limit of 4096 bytes"), "rank {rank}: {err}");
        assert!(err.contains("[8, 2000]"), "rank {rank}: {err}");
        assert!(!after.is_empty(), "rank {rank}");
    }
}

#[test]
fn the_default_cap_is_this_ranks_share_of_the_host_memory() {
    use crate::settings::{host_memory, message_cap};
    let one = crate::threads::run_threads(1, |pg| Ok(pg.max_message_bytes())).unwrap()[0];
    let three = crate::threads::run_threads(3, |pg| Ok(pg.max_message_bytes())).unwrap();
    if let Some(v) = std::env::var_os("ALLGRAD_MAX_MESSAGE_BYTES") {
        let why = format!("ALLGRAD_MAX_MESSAGE_BYTES={} overrides the default this test checks", v.to_string_lossy());
        return allgrad_testkit::skip(allgrad_testkit::Need::Unset("ALLGRAD_MAX_MESSAGE_BYTES"), &why);
    }
    let memory = host_memory().expect("no figure for the host's memory (sysconf and the cgroup both failed)");
    assert_eq!(one, memory);
    assert_eq!(three, vec![memory / 3; 3]);
    assert_eq!(message_cap(Some(memory), 3), memory / 3);
    // Below the old fixed 64 GiB wherever the host has less memory than that.
    assert!(memory >= 64 << 30 || one < crate::settings::DEFAULT_MAX_MESSAGE_BYTES);
}
