//! The TCPStore client against a tiny fake server that speaks the protocol as described in
//! `torch_store.rs` (and checks the validation magic), plus the torchrun rendezvous through
//! it. The client is also tested against PyTorch's own store in `tests/repo/torchrun.rs`.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::*;
use crate::rendezvous::elastic::{Elastic, STORE_ADDR_KEY};
use crate::{ProcessGroup, ReduceOp, WorldInfo};

type Map = Arc<Mutex<HashMap<String, Vec<u8>>>>;

/// A fake TCPStore: one thread per connection; `silent` never answers anything.
struct Fake {
    addr: String,
    map: Map,
}

impl Fake {
    fn start(silent: bool) -> Fake {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let map: Map = Arc::default();
        let m = map.clone();
        std::thread::spawn(move || {
            for s in l.incoming().flatten() {
                let m = m.clone();
                std::thread::spawn(move || {
                    if silent {
                        std::thread::sleep(Duration::from_secs(30));
                    } else {
                        let _ = serve(s, m);
                    }
                });
            }
        });
        Fake { addr, map }
    }
}

fn rd<const N: usize>(s: &mut TcpStream) -> std::io::Result<[u8; N]> {
    let mut b = [0u8; N];
    s.read_exact(&mut b)?;
    Ok(b)
}
fn rd_bytes(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let n = u64::from_le_bytes(rd(s)?) as usize;
    assert!(n <= MAX_VALUE, "the client sent a length of {n}");
    let mut v = vec![0; n];
    s.read_exact(&mut v)?;
    Ok(v)
}
fn rd_key(s: &mut TcpStream) -> std::io::Result<String> {
    Ok(String::from_utf8(rd_bytes(s)?).unwrap())
}
fn rd_keys(s: &mut TcpStream) -> std::io::Result<Vec<String>> {
    let n = u64::from_le_bytes(rd(s)?);
    (0..n).map(|_| rd_key(s)).collect()
}

fn serve(mut s: TcpStream, map: Map) -> std::io::Result<()> {
    let [q] = rd::<1>(&mut s)?;
    if q != query::VALIDATE || u32::from_le_bytes(rd(&mut s)?) != VALIDATION_MAGIC {
        return Ok(()); // PyTorch's daemons drop connections that do not validate first.
    }
    loop {
        let [q] = rd::<1>(&mut s)?;
        let has = |keys: &[String]| {
            let m = map.lock().unwrap();
            keys.iter().all(|k| m.contains_key(k))
        };
        match q {
            query::SET => {
                let (k, v) = (rd_key(&mut s)?, rd_bytes(&mut s)?);
                map.lock().unwrap().insert(k, v);
            }
            query::GET => {
                let v = map.lock().unwrap().get(&rd_key(&mut s)?).cloned().unwrap_or_default();
                s.write_all(&(v.len() as u64).to_le_bytes())?;
                s.write_all(&v)?;
            }
            query::ADD => {
                let k = rd_key(&mut s)?;
                let d = i64::from_le_bytes(rd(&mut s)?);
                let mut m = map.lock().unwrap();
                let old: i64 = m.get(&k).map(|v| String::from_utf8_lossy(v).parse().unwrap()).unwrap_or(0);
                m.insert(k, (old + d).to_string().into_bytes());
                s.write_all(&(old + d).to_le_bytes())?;
            }
            query::CHECK => {
                let keys = rd_keys(&mut s)?;
                s.write_all(&[if has(&keys) { 0 } else { 1 }])?;
            }
            query::WAIT => {
                let keys = rd_keys(&mut s)?;
                s.set_nonblocking(true)?;
                let reply = loop {
                    if has(&keys) {
                        break 0;
                    }
                    match s.read(&mut [0u8; 1]) {
                        Ok(1) => break 1, // CANCEL_WAIT (the only query a waiting client may send)
                        Ok(_) => return Ok(()),
                        Err(_) => std::thread::sleep(Duration::from_millis(2)),
                    }
                };
                s.set_nonblocking(false)?;
                s.write_all(&[reply])?;
            }
            query::CANCEL_WAIT => s.write_all(&[1])?,
            query::PING => {
                let n: [u8; 4] = rd(&mut s)?;
                s.write_all(&n)?;
            }
            _ => return Ok(()),
        }
    }
}

const T: Duration = Duration::from_secs(5);

#[test]
fn keys_are_written_in_pytorchs_prefix_store_format() {
    let fake = Fake::start(false);
    let store = TorchStore::connect(&fake.addr, T).unwrap().with_prefix("/worker/attempt_3");
    store.ping(77).unwrap();
    store.set("a", b"1").unwrap();
    // SET has no reply: a round trip on the same connection makes sure the server applied it.
    store.ping(78).unwrap();
    let keys: Vec<String> = fake.map.lock().unwrap().keys().cloned().collect();
    assert_eq!(keys, ["//worker/attempt_3/a"]);
    let bare = TorchStore::connect(&fake.addr, T).unwrap();
    assert_eq!(bare.get("/worker/attempt_3/a").unwrap(), b"1");
}

#[test]
fn set_get_add_check_wait_round_trip() {
    let fake = Fake::start(false);
    let store = TorchStore::connect(&fake.addr, T).unwrap().with_prefix("p");
    assert!(!store.check(&["k"]).unwrap());
    store.set("k", b"value").unwrap();
    assert!(store.check(&["k"]).unwrap());
    assert_eq!(store.get("k").unwrap(), b"value");
    assert_eq!(store.add("n", 5).unwrap(), 5);
    assert_eq!(store.add("n", -7).unwrap(), -2);
    assert_eq!(store.get("n").unwrap(), b"-2");
    store.wait(&["k", "n"], T).unwrap();
}

#[test]
fn get_blocks_until_another_client_sets_the_key() {
    let fake = Fake::start(false);
    let addr = fake.addr.clone();
    let setter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        TorchStore::connect(&addr, T).unwrap().set("late", b"x").unwrap();
    });
    let store = TorchStore::connect(&fake.addr, T).unwrap();
    let t0 = Instant::now();
    assert_eq!(store.get("late").unwrap(), b"x");
    assert!(t0.elapsed() >= Duration::from_millis(150), "get returned before the key was set");
    setter.join().unwrap();
}

#[test]
fn a_timed_out_wait_names_the_store_and_is_cancelled() {
    let fake = Fake::start(false);
    let store = TorchStore::connect(&fake.addr, T).unwrap();
    let t0 = Instant::now();
    let err = store.wait(&["never"], Duration::from_millis(300)).unwrap_err().to_string();
    assert!(t0.elapsed() < Duration::from_secs(3));
    assert!(err.contains("timed out") && err.contains(&fake.addr) && err.contains("\"/never\""), "{err}");
    // The wait was cancelled on the server: the connection still answers in step.
    store.set("k", b"v").unwrap();
    assert_eq!(store.get("k").unwrap(), b"v");
}

#[test]
fn a_silent_server_times_out_naming_its_address() {
    let fake = Fake::start(true);
    let store = TorchStore::connect(&fake.addr, Duration::from_millis(300)).unwrap();
    let t0 = Instant::now();
    let err = store.add("k", 1).unwrap_err().to_string();
    assert!(t0.elapsed() < Duration::from_secs(3));
    assert!(err.contains("timed out") && err.contains(&fake.addr), "{err}");
    let again = store.check(&["k"]).unwrap_err().to_string();
    assert!(again.contains("unusable") && again.contains(&fake.addr), "{again}");
}

#[test]
fn an_oversized_value_is_refused_before_allocation() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let _ = rd::<5>(&mut s); // VALIDATE + magic
        let _ = s.write_all(&[0]); // WAIT: ready
        let _ = s.write_all(&u64::MAX.to_le_bytes()); // GET: a value of 2^64-1 bytes
        std::thread::sleep(Duration::from_secs(5));
    });
    let store = TorchStore::connect(&addr, T).unwrap();
    let err = store.get("k").unwrap_err().to_string();
    assert!(err.contains("announced a value") && err.contains(&addr), "{err}");
}

#[test]
fn connecting_to_nothing_fails_within_the_timeout_naming_the_address() {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let t0 = Instant::now();
    let err = TorchStore::connect(&addr, Duration::from_millis(300)).unwrap_err().to_string();
    assert!(t0.elapsed() < Duration::from_secs(3));
    assert!(err.contains(&addr), "{err}");
}

/// Three ranks rendezvous through a fake agent store (rank 0 binds a different port), then
/// all_reduce over allgrad's own mesh.
#[test]
fn ranks_rendezvous_through_an_agent_store() {
    let fake = Fake::start(false);
    let port: u16 = fake.addr.rsplit(':').next().unwrap().parse().unwrap();
    let w = 3;
    let (tx, rx) = std::sync::mpsc::channel();
    for rank in 0..w {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let info = WorldInfo {
                rank,
                world_size: w,
                local_rank: rank,
                local_world_size: w,
                master_addr: "127.0.0.1".into(),
                master_port: port,
                token: "tok".into(),
                timeout: T,
                elastic: Some(Elastic {
                    run_id: "r".into(),
                    restart_count: 1,
                    max_restarts: 1,
                    agent_store: true,
                    by_launch: false,
                }),
            };
            let out = ProcessGroup::init(&info).and_then(|pg| {
                let mut v = vec![(rank + 1) as f64];
                pg.all_reduce_slice(&mut v, ReduceOp::Sum)?;
                Ok((pg.world_info().master_port, v[0]))
            });
            let _ = tx.send((rank, out.map_err(|e| e.to_string())));
        });
    }
    for _ in 0..w {
        let (rank, out) = rx.recv_timeout(Duration::from_secs(20)).expect("a rank hung (watchdog)");
        let (store_port, sum) = out.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(sum, 6.0, "rank {rank}");
        assert_ne!(store_port, port, "rank {rank} used the agent's port for allgrad's store");
    }
    let published = fake.map.lock().unwrap().get(&format!("//worker/attempt_1/{STORE_ADDR_KEY}")).cloned();
    assert!(published.is_some(), "rank 0 did not publish under the round's prefix");
}
