//! The rendezvous store's clients that close their connection when idle (as a group's do once
//! it has formed, so that rank 0, which serves the store, holds no connection per rank): each
//! request on a connection of its own unless held, every `add` counted once however requests,
//! holds and closes interleave, a waiting `get` never cut by a close, no connection left open,
//! and a store that has gone named at once.

use std::time::{Duration, Instant};

use allgrad_dist::store::{StoreClient, StoreServer};

fn server() -> (StoreServer, String) {
    let s = StoreServer::start("127.0.0.1:0", "tok").unwrap();
    let a = s.addr().to_string();
    (s, a)
}

/// Waits up to 5 s for the server to serve `n` connections; returns what it serves then.
fn settle(s: &StoreServer, n: usize) -> usize {
    let until = Instant::now() + Duration::from_secs(5);
    while s.connections() != n && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
    }
    s.connections()
}

/// Clients that close their connection when idle: every request on a connection of its own
/// unless held, each `add` counted once however requests, holds and closes interleave
/// (threads sharing a client, holds taken and dropped while requests run), and no connection
/// left open once they are done.
#[test]
fn a_client_that_closes_when_idle_reconnects_and_counts_every_add_once() {
    let (s, addr) = server();
    let c = StoreClient::connect(&addr, "tok", 0, Duration::from_secs(20)).unwrap();
    assert_eq!(settle(&s, 1), 1);
    c.set_close_when_idle(true);
    assert!(!c.is_connected());
    assert_eq!(settle(&s, 0), 0);
    for _ in 0..5 {
        c.add("n", 1).unwrap();
    }
    assert_eq!(c.connections_opened(), 6, "one connection per request after the first");
    {
        let _h = c.hold();
        for _ in 0..5 {
            c.add("n", 1).unwrap();
        }
        assert!(c.is_connected());
        assert_eq!(settle(&s, 1), 1);
    }
    assert_eq!(c.connections_opened(), 7, "one connection for the held run");
    assert!(!c.is_connected());
    // Threads sharing the client, and threads with clients of their own, add while holds
    // come and go.
    const THREADS: usize = 4;
    const ADDS: i64 = 40;
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let (c, addr) = (&c, addr.clone());
            scope.spawn(move || {
                let own = StoreClient::connect(&addr, "tok", t + 1, Duration::from_secs(20)).unwrap();
                own.set_close_when_idle(true);
                for i in 0..ADDS {
                    let _h = (i % 3 == 0).then(|| c.hold());
                    c.add("n", 1).unwrap();
                    let _g = (i % 2 == 0).then(|| own.hold());
                    own.add("n", 1).unwrap();
                }
                assert!(!own.is_connected());
            });
        }
    });
    assert_eq!(c.add("n", 0).unwrap(), 10 + 2 * THREADS as i64 * ADDS);
    assert!(!c.is_connected(), "a connection was left open with no hold alive");
    assert_eq!(settle(&s, 0), 0);
}

/// A `get` that waits keeps its connection while a hold on the same client is dropped (the
/// drop does not wait for it) and is answered once; the connection closes when it ends.
#[test]
fn a_waiting_get_keeps_its_connection_through_a_dropped_hold() {
    let (s, addr) = server();
    let c = StoreClient::connect(&addr, "tok", 0, Duration::from_secs(20)).unwrap();
    c.set_close_when_idle(true);
    let setter = StoreClient::connect(&addr, "tok", 1, Duration::from_secs(20)).unwrap();
    let h = c.hold();
    std::thread::scope(|scope| {
        let waiting = scope.spawn(|| c.get("late"));
        while s.connections() < 2 {
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(50));
        let t = Instant::now();
        drop(h);
        assert!(t.elapsed() < Duration::from_secs(1), "dropping a hold waited for the get");
        std::thread::sleep(Duration::from_millis(100));
        assert!(!waiting.is_finished());
        assert_eq!(s.connections(), 2, "the waiting get lost its connection");
        setter.set("late", b"x").unwrap();
        assert_eq!(waiting.join().unwrap().unwrap(), b"x");
    });
    assert!(!c.is_connected());
    assert_eq!(settle(&s, 1), 1, "only the setter's connection is left");
    assert_eq!(c.connections_opened(), 2);
}

/// The store gone: a client whose connection closed fails its next request at once (the
/// refused reconnect), naming the store, as one that kept its connection does.
#[test]
fn a_store_that_has_gone_fails_the_next_request_at_once_naming_it() {
    let (s, addr) = server();
    let idle = StoreClient::connect(&addr, "tok", 0, Duration::from_secs(20)).unwrap();
    idle.set_close_when_idle(true);
    let kept = StoreClient::connect(&addr, "tok", 1, Duration::from_secs(20)).unwrap();
    idle.set("k", b"v").unwrap();
    kept.set("k", b"v").unwrap();
    drop(s);
    // The server's connection threads notice the stop within 200 ms.
    std::thread::sleep(Duration::from_millis(400));
    for (c, how) in [(&idle, "refused"), (&kept, "")] {
        let t = Instant::now();
        let e = c.get("k").unwrap_err().to_string();
        assert!(t.elapsed() < Duration::from_secs(2), "{:?} to fail: {e}", t.elapsed());
        assert!(e.contains(&addr) && e.contains(how), "{e}");
    }
}
