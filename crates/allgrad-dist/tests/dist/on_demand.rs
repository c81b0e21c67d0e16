//! Groups that connect on demand (ALLGRAD_ON_DEMAND_FROM ranks or more, default 32), run here
//! on small worlds by lowering the threshold to 2 (`ThreadWorld::on_demand_from`): a rank holds
//! after formation only the connections to its parent and children in the binomial tree and to
//! its two ring neighbours, calls through the tree open none, and an all_to_all of large blocks
//! opens the rest (W - 1 in all); every collective gives the same bits as on a group that
//! connected every pair at formation, including the direct paths, whose first calls open every
//! connection in the middle of the call; and a departed rank fails every survivor naming it,
//! whether they wait on a connection it holds, on one it was to open, or on one to it; a rank
//! that finds a failed rank gone reads its reason from the store, through a store connection
//! opened again after formation.
//!
//! The expected connections come from the tree's rule as documented (rank r's parent is r
//! without its lowest set bit; its children r + 1, r + 2, r + 4, ... below that bit and below W)
//! and the ring's (r - 1 and r + 1 modulo W), written here apart from the library's code.

use crate::common::*;

const TIMEOUT: Duration = Duration::from_secs(30);

fn on_demand(w: usize) -> ThreadWorld {
    ThreadWorld::new(w).timeout(TIMEOUT).shm(false).on_demand_from(2)
}

/// Rank `r`'s peers at formation in a group of `w`: tree parent and children, ring neighbours,
/// from the rules as documented (also used by `many_processes`).
pub(crate) fn formation_peers(r: usize, w: usize) -> Vec<usize> {
    let mut out = Vec::new();
    if r > 0 {
        out.push(r - (r & r.wrapping_neg()));
    }
    let below = if r == 0 { usize::MAX } else { r & r.wrapping_neg() };
    let mut d = 1;
    while d < below && r + d < w {
        out.push(r + d);
        d *= 2;
    }
    out.extend([(r + 1) % w, (r + w - 1) % w]);
    out.retain(|p| *p != r);
    out.sort_unstable();
    out.dedup();
    out
}

/// Whether `msg` names rank `r` ("rank 2", not "rank 21").
fn names_rank(msg: &str, r: usize) -> bool {
    let needle = format!("rank {r}");
    msg.match_indices(&needle).any(|(i, _)| !msg[i + needle.len()..].starts_with(|c: char| c.is_ascii_digit()))
}

#[test]
fn a_group_holds_its_tree_and_ring_connections_and_opens_the_others_when_a_call_needs_them() {
    for w in [12, 33] {
        let got = on_demand(w)
            .tree_from(2)
            .run(|pg| {
                let r = pg.rank();
                let formed = pg.connection_count();
                // Calls through the tree and the ring's neighbours open nothing.
                pg.barrier()?;
                let x = pg.all_reduce(&tensor(DType::F32, &[r as f64, 1.0], &[2]), ReduceOp::Sum)?;
                let g = pg.all_gather(&tensor(DType::U32, &[r as f64], &[1]))?;
                let next = (r + 1) % w;
                let prev = (r + w - 1) % w;
                let sent = tensor(DType::F64, &[r as f64; 3], &[3]);
                // Around the ring: even ranks send first, odd ones receive first (W = 33: rank
                // 32 and rank 0 are both even, and 32 receives from 31 before sending to 0).
                let from_prev = if r % 2 == 0 && r != w - 1 {
                    pg.send(&sent, next)?;
                    pg.recv(3, DType::F64, &Device::Cpu, prev)?
                } else {
                    let t = pg.recv(3, DType::F64, &Device::Cpu, prev)?;
                    pg.send(&sent, next)?;
                    t
                };
                let after_small = pg.connection_count();
                // Blocks of 4 KiB, past Bruck's 1 KiB: each goes straight to its rank.
                let n = 1024;
                let vals: Vec<f64> = (0..w * n).map(|i| (r * 100_000 + i) as f64).collect();
                let out = pg.all_to_all(&tensor(DType::F32, &vals, &[w * n]))?;
                let after_large = pg.connection_count();
                Ok((formed, after_small, after_large, read(&x), read(&g), read(&from_prev), read(&out)))
            })
            .unwrap_or_else(|e| panic!("W={w}: {e}"));
        let n = 1024;
        for (r, (formed, small, large, x, g, prev, out)) in got.into_iter().enumerate() {
            let want = formation_peers(r, w).len();
            assert!(want <= 2 + (w as f64).log2().ceil() as usize + 1, "W={w} rank {r}: {want} formation peers");
            assert_eq!(formed, want, "W={w} rank {r}: connections after formation");
            assert_eq!(small, want, "W={w} rank {r}: tree calls and the ring's neighbours opened connections");
            assert_eq!(large, w - 1, "W={w} rank {r}: connections after an all_to_all of large blocks");
            assert_eq!(x, vec![(w * (w - 1) / 2) as f64, w as f64], "W={w} rank {r}: all_reduce");
            assert_eq!(g, (0..w).map(|q| q as f64).collect::<Vec<_>>(), "W={w} rank {r}: all_gather");
            assert_eq!(prev, vec![((r + w - 1) % w) as f64; 3], "W={w} rank {r}: recv from the previous rank");
            let want: Vec<f64> = (0..w).flat_map(|q| (r * n..(r + 1) * n).map(move |i| (q * 100_000 + i) as f64)).collect();
            assert_eq!(out, want, "W={w} rank {r}: all_to_all");
        }
    }
}

/// Every collective, each case's result as a bits digest, in a fixed order: all_reduce of rough
/// floats (small, and large over the TCP ring), all_gather and all_to_all of uneven sizes,
/// reduce_scatter, broadcast from and reduce to every root, and send/recv to the rank two ahead
/// (no ring or tree edge).
fn every_collective(pg: &ProcessGroup) -> candle_core::Result<Vec<(String, u64)>> {
    let (w, r) = (pg.world_size(), pg.rank());
    let mut out = Vec::new();
    let input = |tag: &str, n: usize| {
        let s = salt(tag, DType::F32, n);
        tensor(DType::F32, &gen(DType::F32, Kind::Rough, r, s, 0..n), &[n])
    };
    for n in [1, 7, LARGE] {
        let y = pg.all_reduce(&input("on-demand all_reduce", n), ReduceOp::Sum)?;
        out.push((format!("all_reduce n={n}"), bits_digest(&y)));
    }
    let rows = uneven_rows(r, w, 3);
    let g = pg.all_gather(&input("on-demand all_gather", rows * COLS).reshape((rows, COLS))?)?;
    out.push(("all_gather uneven".into(), bits_digest(&g)));
    let rs = pg.reduce_scatter(&input("on-demand reduce_scatter", w * 5), ReduceOp::Sum)?;
    out.push(("reduce_scatter".into(), bits_digest(&rs)));
    for root in 0..w {
        let b = pg.broadcast(&input(&format!("on-demand broadcast {root}"), 9), root)?;
        out.push((format!("broadcast root={root}"), bits_digest(&b)));
        let d = pg.reduce(&input(&format!("on-demand reduce {root}"), 9), root, ReduceOp::Sum)?;
        out.push((format!("reduce root={root}"), bits_digest(&d)));
    }
    let sizes: Vec<usize> = (0..w).map(|q| (r + 2 * q) % 4).collect();
    let total: usize = sizes.iter().sum();
    let (a, got) = pg.all_to_all_sizes(&input("on-demand all_to_all", total), &sizes)?;
    out.push((format!("all_to_all uneven {got:?}"), bits_digest(&a)));
    if w >= 3 {
        // Rank r sends to r + 2 and receives from r - 2; the lower of each pair sends first.
        let (to, from) = ((r + 2) % w, (r + w - 2) % w);
        let mine = input("on-demand p2p", 5);
        let t = if r < from {
            pg.send(&mine, to)?;
            pg.recv(5, DType::F32, &Device::Cpu, from)?
        } else {
            let t = pg.recv(5, DType::F32, &Device::Cpu, from)?;
            pg.send(&mine, to)?;
            t
        };
        out.push(("send/recv two ahead".into(), bits_digest(&t)));
    }
    Ok(out)
}

#[test]
fn every_collective_gives_the_bits_of_a_group_that_connected_every_pair() {
    for w in [2, 3, 4, 5] {
        // Below the tree's threshold: the direct paths, whose first calls need every peer.
        let lazy = on_demand(w).run(|pg| Ok((every_collective(&pg)?, pg.connection_count())));
        let lazy = lazy.unwrap_or_else(|e| panic!("W={w} connecting on demand: {e}"));
        let full = ThreadWorld::new(w)
            .timeout(TIMEOUT)
            .shm(false)
            .on_demand_from(w + 1)
            .run(|pg| Ok((every_collective(&pg)?, pg.connection_count())))
            .unwrap_or_else(|e| panic!("W={w} with every pair connected: {e}"));
        for r in 0..w {
            assert_eq!(lazy[r].0, full[r].0, "W={w} rank {r}: results differ from the full mesh's");
            assert_eq!((lazy[r].1, full[r].1), (w - 1, w - 1), "W={w} rank {r}: connections at the end");
        }
    }
}

#[test]
fn a_departed_rank_fails_every_survivor_naming_it_when_most_pairs_are_not_connected() {
    // Through the tree (the departed rank's parent and children hold its connections), in
    // Bruck's rounds (connections to r +- 2^k opened in the call), and on the direct path with
    // large blocks, where ranks above it find its listener gone and ranks below wait for it.
    let w = 8;
    for (call, dead) in [("all_reduce", 4), ("all_to_all", 5), ("all_to_all large", 3)] {
        let start = Instant::now();
        let errs = on_demand(w)
            .tree_from(if call == "all_to_all large" { w + 1 } else { 2 })
            .run(|pg| {
                if pg.rank() == dead {
                    return Ok(None);
                }
                let res = match call {
                    "all_reduce" => pg.all_reduce(&tensor(DType::F32, &[1.0, 2.0, 3.0], &[3]), ReduceOp::Sum).map(|_| ()),
                    "all_to_all" => pg.all_to_all(&tensor(DType::F32, &vec![1.0; 2 * w], &[w, 2])).map(|_| ()),
                    _ => pg.all_to_all(&tensor(DType::F32, &vec![1.0; 2048 * w], &[w, 2048])).map(|_| ()),
                };
                Ok(Some(res.err().map(|e| e.to_string())))
            })
            .unwrap_or_else(|e| panic!("{call}: {e}"));
        assert!(start.elapsed() < Duration::from_secs(15), "{call}, rank {dead} gone: took {:?}", start.elapsed());
        for (r, e) in errs.iter().enumerate().filter(|(r, _)| *r != dead) {
            let e = e.as_ref().unwrap().as_deref().unwrap_or_else(|| panic!("{call}: rank {r}'s call succeeded"));
            assert!(names_rank(e, dead), "{call}: rank {r}'s error does not name rank {dead}: {e}");
        }
    }
}

/// A rank that fails leaves its reason in the store, and a rank that later needs a connection
/// to it, finding it gone, reads the reason there: both through store connections opened again
/// after the group formed (each rank closes its connection to the store once formed).
#[test]
fn a_failure_record_is_left_and_read_through_the_store_after_its_connections_closed() {
    let w = 8;
    let (dead, late) = (3, 7);
    // Rank 7's peers at formation are 0 and 6: it has no connection to rank 3.
    assert!(!formation_peers(late, w).contains(&dead));
    let others = std::sync::Barrier::new(w - 1);
    let got = on_demand(w)
        .tree_from(2)
        .run(|pg| {
            let r = pg.rank();
            let store = pg.store().expect("a group of 8 has a store");
            let closed_after_forming = !store.is_connected();
            if r == dead {
                pg.abort("rank 3 ran out of disk");
                return Ok((closed_after_forming, None));
            }
            let mut said = None;
            if r == late {
                // The record, read from a fresh connection (the rank's own closed when it formed).
                let rec = store.get_timeout(&format!("world/failed/{dead}"), TIMEOUT).map_err(candle_core::Error::wrap)?;
                let rec = String::from_utf8_lossy(&rec).into_owned();
                assert!(rec.contains("ran out of disk"), "{rec}");
                assert!(!store.is_connected(), "the store connection stayed open after a request");
                // Rank 3's group, and its listener, go once its thread has returned.
                std::thread::sleep(Duration::from_millis(1500));
                let e = pg.send_slice(&[1.0f32], dead).expect_err("a send to a rank that is gone");
                said = Some(e.to_string());
            }
            // Nobody leaves (closing connections) before rank 7 has its answer.
            others.wait();
            Ok((closed_after_forming, said))
        })
        .unwrap();
    for (r, (closed, _)) in got.iter().enumerate() {
        assert!(closed, "rank {r} kept its store connection open after its group formed");
    }
    let e = got[late].1.as_deref().unwrap();
    assert!(names_rank(e, dead) && e.contains("had failed") && e.contains("ran out of disk"), "{e}");
}
