//! Randomised hostile frames at the data plane: a seeded generator mutates the frame a fake
//! peer sends in answer to rank 0's all_reduce (magic, kind, op, dtype, reduce op, call
//! number (a reordered frame), step, length (oversized or short), shape digest), each with a
//! random body. Every case must end in a clean error naming the peer, promptly (not at the
//! timeout), with an ABORT frame sent to the peer, no panic, and the group left poisoned (its
//! next call fails at once); the checks are those of
//! `hostile_tests::rank0_error_after_hostile_frame`. Truncated frames on a connection the peer
//! keeps open (a valid prefix: part of the header, or the header and part of the body) end in
//! a timeout error at the group's deadline, with the same checks. The numbers of cases are
//! printed.

use std::time::{Duration, Instant};

use super::hostile_tests::{rank0_error_after_hostile_bytes, rank0_error_after_hostile_frame, Ends};
use crate::wire::{Header, HEADER_LEN, KIND_ABORT, KIND_DATA};

/// Cases per run, and a bound on the whole run well under a minute.
const CASES: u64 = 200;
const BUDGET: Duration = Duration::from_secs(50);

/// The case generator: the project's one keyed stream, so a failing case replays by seed.
struct Rng(allgrad_rng::KeyedRng);

impl Rng {
    fn new(seed: u64, what: &str) -> Rng {
        Rng(allgrad_rng::stream(&[allgrad_rng::name_key(what), seed]))
    }
    fn next(&mut self) -> u64 {
        rand::RngCore::next_u64(&mut self.0)
    }
    /// A value different from `not`.
    fn other_u64(&mut self, not: u64) -> u64 {
        let v = self.next();
        if v == not {
            v ^ 1
        } else {
            v
        }
    }
}

/// The hostile frame of case `seed`, from the header rank 0 sent (which the fake peer's
/// answer must equal to be accepted); returns a description and the bytes.
fn hostile_frame(seed: u64, h: &Header) -> (String, Vec<u8>) {
    let mut rng = Rng::new(seed, "data-plane fuzz");
    let mut m = *h;
    let what = match rng.next() % 9 {
        0 => "magic",
        1 => {
            // Any kind but data and abort (an abort is a valid frame with its own tests).
            m.kind = loop {
                let k = rng.next() as u8;
                if k != KIND_DATA && k != KIND_ABORT {
                    break k;
                }
            };
            "kind"
        }
        2 => {
            m.op = h.op.wrapping_add(1 + (rng.next() % 254) as u8);
            "op"
        }
        3 => {
            m.dtype = h.dtype.wrapping_add(1 + (rng.next() % 254) as u8);
            "dtype"
        }
        4 => {
            m.redop = h.redop.wrapping_add(1 + (rng.next() % 254) as u8);
            "reduce op"
        }
        5 => {
            // A frame of another call: earlier or later.
            m.seq = h.seq.wrapping_add(1 + rng.next() % 1000).wrapping_sub(if rng.next().is_multiple_of(2) { 0 } else { 1001 });
            if m.seq == h.seq {
                m.seq += 1;
            }
            "call number (reordered)"
        }
        6 => {
            m.step = rng.other_u64(h.step as u64) as u32;
            if m.step == h.step {
                m.step ^= 1;
            }
            "step"
        }
        7 => {
            m.len = if rng.next().is_multiple_of(2) { rng.other_u64(h.len) | (1 << 40) } else { rng.next() % h.len };
            "length"
        }
        _ => {
            m.meta = rng.other_u64(h.meta);
            "shape digest"
        }
    };
    let mut bytes = m.encode().to_vec();
    if what == "magic" {
        let bad = (rng.next() as u32 | 1).to_le_bytes();
        for (i, b) in bad.iter().enumerate() {
            bytes[i] ^= b | 1; // every magic byte changes
        }
    }
    let body = (rng.next() % 33) as usize;
    bytes.extend((0..body).map(|_| rng.next() as u8));
    (format!("seed {seed}: {what} ({m:?}, {body}-byte body)"), bytes)
}

#[test]
fn random_malformed_frames_each_end_in_a_prompt_clean_error() {
    let start = Instant::now();
    let mut cases = 0;
    for seed in 0..CASES {
        if start.elapsed() > BUDGET {
            break;
        }
        let mut case = String::new();
        let err = rank0_error_after_hostile_frame(&format!("fuzz seed {seed}"), |h| {
            let (what, bytes) = hostile_frame(seed, h);
            case = what;
            bytes
        });
        assert!(err.contains("rank 1"), "{case}: the error does not name the peer: {err}");
        cases += 1;
    }
    println!("{cases} hostile frames at the data plane, each refused cleanly in {:?}", start.elapsed());
    assert!(cases >= 10, "only {cases} cases ran within {BUDGET:?}");
}

/// Cases of truncated frames, each waiting for a short group timeout.
const TRUNCATED_CASES: u64 = 8;
const SHORT_TIMEOUT: Duration = Duration::from_millis(1500);

#[test]
fn truncated_frames_on_an_open_connection_end_at_the_timeout_and_poison_the_group() {
    let start = Instant::now();
    for seed in 0..TRUNCATED_CASES {
        let mut rng = Rng::new(seed, "truncated frames");
        let mut case = String::new();
        let err = rank0_error_after_hostile_bytes(&format!("truncated seed {seed}"), SHORT_TIMEOUT, Ends::AtTheTimeout, |h| {
            // The answer rank 0 expects: its own header and 16 body bytes.
            let mut full = h.encode().to_vec();
            full.extend((0..h.len).map(|_| rng.next() as u8));
            let cut = if rng.next().is_multiple_of(2) {
                1 + (rng.next() % (HEADER_LEN as u64 - 1)) as usize // inside the header
            } else {
                HEADER_LEN + (rng.next() % h.len) as usize // inside the body
            };
            case = format!("seed {seed}: {cut} of {} bytes", full.len());
            full.truncate(cut);
            full
        });
        assert!(err.contains("waiting for rank(s) [1]"), "{case}: the error does not name the peer: {err}");
    }
    println!("{TRUNCATED_CASES} truncated frames on open connections, each ended at the timeout in {:?}", start.elapsed());
}
