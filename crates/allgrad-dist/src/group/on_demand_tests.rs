//! Connections on demand, at the level of one rank's acceptor and opener and of meshes built
//! by hand: a second connection from a rank, another job's token, another group's name and a
//! rank that is not a higher member are refused (and counted, where they are also logged);
//! a connection a call needs that cannot be opened fails the call on the rank that tried,
//! naming both ranks and the cause, and on the ranks that wait for it or for the ranks that
//! failed, through the ABORT frames of the connections they hold, well before the timeout.
//!
//! Ranks run on threads started by hand; every join has a watchdog so a hang fails the test.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::on_demand::{formation_peers, Acceptor, OnDemand};
use crate::cpu::mesh::{Mesh, OpCode, Opener, RecvOp, SendOp};
use crate::error::{DistError, DistResult};
use crate::wire::{Header, Hello, Service, KIND_DATA};

const TOKEN: &str = "on-demand-test-token";
const GROUP: &str = "world";

fn hello(rank: usize, world: usize, token: &str, group: &str) -> Hello {
    Hello { service: Service::Data, rank: rank as u32, world: world as u32, token: token.into(), group: group.into() }
}

fn listener() -> TcpListener {
    TcpListener::bind("127.0.0.1:0").expect("binding a test listener")
}

/// Rank `me`'s opener in a group of `members.len()` ranks whose listeners are at `addrs`,
/// presenting `token` and `group`.
fn opener(me: usize, members: &[usize], addrs: &[SocketAddr], token: &str, group: &str) -> OnDemand {
    let h = hello(members[me], members.len(), token, group);
    let acceptor = Acceptor::start(listener(), h.clone(), me, members).unwrap();
    let addrs = addrs.to_vec();
    OnDemand::new(acceptor, h, members, Box::new(move |p: usize| -> DistResult<SocketAddr> { Ok(addrs[p]) }))
}

/// Waits (at most 5 s) for `cond`.
fn eventually(what: &str, cond: impl Fn() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < Duration::from_secs(5), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn formation_connects_the_tree_and_the_ring_only() {
    // Rank 0 of 8: children 1, 2, 4, ring 1 and 7. Rank 6 of 8: parent 4, child 7, ring 5, 7.
    assert_eq!(formation_peers(0, 8), vec![1, 2, 4, 7]);
    assert_eq!(formation_peers(6, 8), vec![4, 5, 7]);
    assert_eq!(formation_peers(1, 2), vec![0]);
    // Every edge is known to both of its ends.
    for w in [2, 3, 5, 32, 33, 128] {
        for r in 0..w {
            for p in formation_peers(r, w) {
                assert!(formation_peers(p, w).contains(&r), "W={w}: {r} -> {p} but not back");
            }
        }
    }
}

#[test]
fn a_second_connection_another_token_or_group_or_a_lower_rank_is_refused() {
    let members = [0, 1, 2, 3];
    let l = listener();
    let addr = l.local_addr().unwrap();
    let acceptor = Acceptor::start(l, hello(0, 4, TOKEN, GROUP), 0, &members).unwrap();
    let inbox = acceptor.inbox().clone();
    let take = |p: usize| inbox.take_for_test(p);
    let addrs = [addr; 4];
    let deadline = || Instant::now() + Duration::from_secs(5);

    // Rank 2 of this job and group: accepted, and handed to the group.
    let two = opener(2, &members, &addrs, TOKEN, GROUP);
    let first = two.dial(0, deadline()).expect("rank 2's first connection");
    eventually("rank 2's connection in the inbox", || take(2));
    assert_eq!(inbox.refused(), 0);

    // Rank 2 again: refused, and the first connection stays the group's.
    let e = two.dial(0, deadline()).expect_err("a second connection from rank 2 was accepted").to_string();
    assert!(e.contains("refused"), "{e}");
    eventually("the second connection refused", || inbox.refused() == 1);

    // Rank 3 with another job's token, then with another group's name: refused.
    let e = opener(3, &members, &addrs, "another-job", GROUP).dial(0, deadline()).expect_err("a wrong token was accepted");
    assert!(e.to_string().contains("refused"), "{e}");
    eventually("the wrong token refused", || inbox.refused() == 2);
    let e = opener(3, &members, &addrs, TOKEN, "world/1").dial(0, deadline()).expect_err("another group was accepted");
    assert!(e.to_string().contains("refused"), "{e}");
    eventually("the other group refused", || inbox.refused() == 3);
    // A rank below the acceptor's never connects to it: refused.
    let mut stray = TcpStream::connect(addr).unwrap();
    crate::wire::write_all_by(&mut stray, &hello(0, 4, TOKEN, GROUP).encode(), deadline(), "test").unwrap();
    eventually("the lower rank refused", || inbox.refused() == 4);
    assert!(!take(3), "a refused connection reached the group");

    // The refusals did not count as rank 3's connection: its own still comes through.
    opener(3, &members, &addrs, TOKEN, GROUP).dial(0, deadline()).expect("rank 3's connection");
    eventually("rank 3's connection in the inbox", || take(3));
    assert_eq!(inbox.refused(), 4);
    drop(first);
}

/// A mesh of group rank `me` of `w` with no connections but `pairs` (peer, stream).
fn mesh(me: usize, w: usize, pairs: Vec<(usize, TcpStream)>, opener: OnDemand, timeout: Duration) -> Mesh {
    let mut peers: Vec<Option<TcpStream>> = (0..w).map(|_| None).collect();
    for (p, s) in pairs {
        s.set_nonblocking(true).unwrap();
        peers[p] = Some(s);
    }
    let mut m = Mesh::new(GROUP.into(), me, (0..w).collect(), peers, timeout);
    m.set_opener(Box::new(opener));
    m
}

/// Two connected ends.
fn pair() -> (TcpStream, TcpStream) {
    let l = listener();
    let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    (a, b)
}

/// Every rank of `meshes` sends 8 bytes to every other and receives theirs, each on a
/// thread; returns each rank's outcome and how long it took, or fails after `limit`.
fn all_pairs(meshes: Vec<Mesh>, limit: Duration) -> Vec<(DistResult<()>, Duration)> {
    let w = meshes.len();
    let (tx, rx) = mpsc::channel();
    for mut m in meshes {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let start = Instant::now();
            let h = Header { kind: KIND_DATA, op: OpCode::AllToAll as u8, seq: 1, len: 8, ..Default::default() };
            let data = [m.rank as u8; 8];
            let mut bufs = vec![[0u8; 8]; w];
            let r = m.rank;
            let mut sends: Vec<SendOp> = (0..w).filter(|p| *p != r).map(|p| SendOp { peer: p, header: h, data: &data }).collect();
            let mut recvs: Vec<RecvOp> = bufs
                .iter_mut()
                .enumerate()
                .filter(|(p, _)| *p != r)
                .map(|(p, b)| RecvOp { peer: p, expect: h, data: b, acc: None })
                .collect();
            let res = m.exchange(&mut sends, &mut recvs, "all_to_all (test)");
            drop(recvs);
            let res = res.and_then(|_| match (0..w).find(|p| *p != r && bufs[*p] != [*p as u8; 8]) {
                Some(p) => Err(DistError::Invalid(format!("rank {r} got {:?} from rank {p}", bufs[p]))),
                None => Ok(()),
            });
            let _ = tx.send((r, res, start.elapsed()));
            // The mesh stays up until its peers are done with it.
            std::thread::sleep(Duration::from_millis(500));
        });
    }
    let mut out: Vec<Option<(DistResult<()>, Duration)>> = (0..w).map(|_| None).collect();
    for _ in 0..w {
        let (r, res, t) = rx.recv_timeout(limit).expect("a rank hung");
        out[r] = Some((res, t));
    }
    out.into_iter().map(Option::unwrap).collect()
}

#[test]
fn connections_a_call_needs_are_opened_once_by_the_higher_rank_and_carry_the_call() {
    let w = 4;
    let members: Vec<usize> = (0..w).collect();
    let ls: Vec<TcpListener> = (0..w).map(|_| listener()).collect();
    let addrs: Vec<SocketAddr> = ls.iter().map(|l| l.local_addr().unwrap()).collect();
    // Only the pair 1-2 is connected beforehand.
    let (a, b) = pair();
    let mut pairs: Vec<Vec<(usize, TcpStream)>> = vec![vec![], vec![(2, a)], vec![(1, b)], vec![]];
    let meshes: Vec<Mesh> = ls
        .into_iter()
        .enumerate()
        .map(|(r, l)| {
            let h = hello(r, w, TOKEN, GROUP);
            let acceptor = Acceptor::start(l, h.clone(), r, &members).unwrap();
            let addrs = addrs.clone();
            let o = OnDemand::new(acceptor, h, &members, Box::new(move |p: usize| -> DistResult<SocketAddr> { Ok(addrs[p]) }));
            mesh(r, w, std::mem::take(&mut pairs[r]), o, Duration::from_secs(10))
        })
        .collect();
    for (r, (res, _)) in all_pairs(meshes, Duration::from_secs(30)).into_iter().enumerate() {
        res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}

#[test]
fn a_connection_that_cannot_be_opened_fails_every_rank_naming_both_ranks_and_the_cause() {
    // Ranks 0, 1, 2; 0-2 and 1-2 connected (as a tree would be), 0-1 not. Rank 1 presents
    // another job's token when it connects to rank 0: rank 0 refuses it, rank 1 fails naming
    // rank 0 and the refusal, its ABORT frame reaches rank 2, whose own reaches rank 0, which
    // is waiting for rank 1 to connect: every rank fails, long before the 20 s timeout.
    let w = 3;
    let members: Vec<usize> = (0..w).collect();
    let ls: Vec<TcpListener> = (0..w).map(|_| listener()).collect();
    let addrs: Vec<SocketAddr> = ls.iter().map(|l| l.local_addr().unwrap()).collect();
    let (a, b) = pair();
    let (c, d) = pair();
    let mut pairs: Vec<Vec<(usize, TcpStream)>> = vec![vec![(2, a)], vec![(2, c)], vec![(0, b), (1, d)]];
    let timeout = Duration::from_secs(20);
    let meshes: Vec<Mesh> = ls
        .into_iter()
        .enumerate()
        .map(|(r, l)| {
            let acceptor = Acceptor::start(l, hello(r, w, TOKEN, GROUP), r, &members).unwrap();
            let presents = hello(r, w, if r == 1 { "another-job" } else { TOKEN }, GROUP);
            let addrs = addrs.clone();
            let o =
                OnDemand::new(acceptor, presents, &members, Box::new(move |p: usize| -> DistResult<SocketAddr> { Ok(addrs[p]) }));
            mesh(r, w, std::mem::take(&mut pairs[r]), o, timeout)
        })
        .collect();
    let out = all_pairs(meshes, timeout + Duration::from_secs(10));
    let msgs: Vec<String> = out.iter().map(|(res, _)| res.as_ref().err().map(|e| e.to_string()).unwrap_or_default()).collect();
    for (r, (res, took)) in out.iter().enumerate() {
        let e = res.as_ref().err().unwrap_or_else(|| panic!("rank {r}'s call succeeded: {msgs:?}")).to_string();
        assert!(*took < Duration::from_secs(8), "rank {r} took {took:?} to fail: {e}");
        // Every rank's error carries rank 1's: both ranks of the pair and the cause.
        assert!(
            e.contains("rank 1 could not open its connection to rank 0 on group world") && e.contains("refused"),
            "rank {r}: {e}"
        );
    }
    assert!(matches!(out[1].0, Err(DistError::Connect { rank: 1, peer: 0, .. })), "{msgs:?}");
}
