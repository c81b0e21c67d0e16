//! Ring passes (`ProcessGroup::ring_pass`): blocks delivered by the schedule on W = 1..6, both
//! ways and one way, passed on by neighbours whole or sent straight from their owners in
//! chunks (received in place, or split from one frame when a peer sends several), with sizes
//! known from the one check; a block whose size changes mid-pass and ranks that open different
//! passes fail on every rank, naming the ranks, never hang. The exchange of tensors
//! (`RingPass::exchange_tensors`, the ring losses' tensor form; on the CPU through the host
//! path) delivers the same chunks, with the caller's work on the chunks before running beside
//! it, and refuses a chunk of another size the same way.

use std::time::Duration;

use allgrad_dist::{ProcessGroup, RingMessage, RingSchedule, RingSetting, ThreadWorld};
use candle_core::{DType, Device, Tensor};

/// Rank r's block: `rows(r)` rows of 3 values that name the rank and the position.
fn block(r: usize) -> Vec<f64> {
    (0..rows(r) * 3).map(|i| (r * 1000 + i) as f64).collect()
}

fn rows(r: usize) -> usize {
    (r * 3 + 1) % 4 + 1
}

fn world(w: usize) -> ThreadWorld {
    ThreadWorld::new(w).timeout(Duration::from_secs(20)).watchdog(Some(Duration::from_secs(60)))
}

#[test]
fn every_rank_receives_every_other_block_once_in_the_schedules_order() {
    for w in 1..=6 {
        for bidirectional in [true, false] {
            let seen = world(w)
                .run(|pg| {
                    let me = pg.rank();
                    let sched = RingSchedule { world: w, bidirectional };
                    let pass = pg.ring_pass("test ring", rows(me), 3, 4, &[RingSetting { name: "test", value: 7 }])?;
                    assert_eq!(pass.rows(), (0..w).map(rows).collect::<Vec<_>>());
                    let mut seen = vec![me];
                    let (mut up, mut down) = (block(me), block(me));
                    for s in 1..=sched.steps() {
                        let both = s <= sched.steps_down();
                        let (o_up, o_down) = (sched.origin(me, s, false), sched.origin(me, s, true));
                        let mut next_up = vec![0.0; pass.len_of(o_up)];
                        let mut next_down = vec![0.0; if both { pass.len_of(o_down) } else { 0 }];
                        let mut sends = vec![RingMessage {
                            peer: sched.next(me, false),
                            origin: sched.origin(me, s - 1, false),
                            chunk: 0,
                            data: &up[..],
                        }];
                        let mut recvs =
                            vec![RingMessage { peer: sched.prev(me, false), origin: o_up, chunk: 0, data: &mut next_up[..] }];
                        if both {
                            sends.push(RingMessage {
                                peer: sched.next(me, true),
                                origin: sched.origin(me, s - 1, true),
                                chunk: 0,
                                data: &down[..],
                            });
                            recvs.push(RingMessage {
                                peer: sched.prev(me, true),
                                origin: o_down,
                                chunk: 0,
                                data: &mut next_down[..],
                            });
                        }
                        pass.exchange(&sends, &mut recvs, || ())?;
                        drop((sends, recvs));
                        assert_eq!(next_up, block(o_up), "W={w} rank {me} step {s} up");
                        seen.push(o_up);
                        up = next_up;
                        if both {
                            assert_eq!(next_down, block(o_down), "W={w} rank {me} step {s} down");
                            seen.push(o_down);
                            down = next_down;
                        }
                    }
                    let counts = pg.ring_counts();
                    assert_eq!((counts.passes, counts.checks), (1, 1));
                    seen.sort();
                    Ok(seen)
                })
                .unwrap();
            for (r, s) in seen.iter().enumerate() {
                assert_eq!(s, &(0..w).collect::<Vec<_>>(), "W={w} bidirectional={bidirectional} rank {r}");
            }
        }
    }
}

/// Rows `range` of rank r's block.
fn rows_of(r: usize, range: std::ops::Range<usize>) -> Vec<f64> {
    block(r)[range.start * 3..range.end * 3].to_vec()
}

#[test]
fn chunks_sent_straight_from_their_owners_arrive_once_each_with_several_messages_per_peer_split() {
    for w in 1..=6 {
        for bidirectional in [true, false] {
            let seen = world(w)
                .run(|pg| {
                    let me = pg.rank();
                    let sched = RingSchedule { world: w, bidirectional };
                    // Chunks of 2 rows: blocks of 1 to 4 rows take 1 or 2 chunks, the second
                    // empty for the smaller ones.
                    let pass = pg.ring_pass("chunked ring", rows(me), 3, 2, &[])?;
                    assert_eq!(pass.chunks(), (0..w).map(rows).max().unwrap().div_ceil(2));
                    let mut seen: Vec<(usize, usize)> = (0..pass.chunks()).map(|k| (me, k)).collect();
                    for s in 1..=sched.steps() {
                        let both = s <= sched.steps_down();
                        for k in 0..pass.chunks() {
                            let mine = rows_of(me, pass.chunk_range(me, k));
                            // Each message goes twice, as two messages in one frame when the two
                            // directions meet one peer (W = 2 one way: both to rank 1 − me).
                            let mut sends = Vec::new();
                            let mut recvs_from = Vec::new();
                            for down in [false, true] {
                                if down && !both {
                                    continue;
                                }
                                if !mine.is_empty() {
                                    sends.push((sched.visitor(me, s, down), me, k));
                                }
                                let o = sched.origin(me, s, down);
                                if pass.chunk_len(o, k) > 0 {
                                    recvs_from.push((o, k));
                                }
                            }
                            // A second copy of each message, to the same peer, after the first.
                            let sends2: Vec<_> = sends.iter().chain(sends.iter()).copied().collect();
                            let msgs: Vec<RingMessage<&[f64]>> = sends2
                                .iter()
                                .map(|&(p, o, k)| RingMessage { peer: p, origin: o, chunk: k, data: &mine[..] })
                                .collect();
                            let mut bufs: Vec<Vec<f64>> = recvs_from
                                .iter()
                                .chain(recvs_from.iter())
                                .map(|&(o, k)| vec![0.0; pass.chunk_len(o, k)])
                                .collect();
                            let order: Vec<(usize, usize)> = recvs_from.iter().chain(recvs_from.iter()).copied().collect();
                            let mut recvs: Vec<RingMessage<&mut [f64]>> = order
                                .iter()
                                .zip(bufs.iter_mut())
                                .map(|(&(o, k), b)| RingMessage { peer: o, origin: o, chunk: k, data: &mut b[..] })
                                .collect();
                            pass.exchange(&msgs, &mut recvs, || ())?;
                            drop(recvs);
                            for (&(o, k), b) in order.iter().zip(&bufs) {
                                assert_eq!(b, &rows_of(o, pass.chunk_range(o, k)), "W={w} rank {me} step {s} chunk {k} of {o}");
                            }
                            seen.extend(recvs_from);
                        }
                    }
                    seen.sort();
                    Ok((seen, pass.chunks()))
                })
                .unwrap();
            for (r, (s, chunks)) in seen.iter().enumerate() {
                let want: Vec<(usize, usize)> =
                    (0..w).flat_map(|o| (0..*chunks).filter(move |&k| k * 2 < rows(o) || o == r).map(move |k| (o, k))).collect();
                assert_eq!(s, &want, "W={w} bidirectional={bidirectional} rank {r}");
            }
        }
    }
}

#[test]
fn a_block_that_changes_size_mid_pass_fails_every_rank_naming_the_rank_by_its_next_call() {
    let w = 4;
    let errors = world(w)
        .run(|pg| {
            let me = pg.rank();
            let sched = RingSchedule { world: w, bidirectional: false };
            let pass = pg.ring_pass("test ring", rows(me), 3, 4, &[])?;
            let mut cur = block(me);
            for s in 1..=sched.steps() {
                // Rank 1 sends one row too many at step 2.
                let send = if me == 1 && s == 2 { [cur.clone(), vec![0.0; 3]].concat() } else { cur.clone() };
                let o = sched.origin(me, s, false);
                let mut next = vec![0.0; pass.len_of(o)];
                let sends = [RingMessage {
                    peer: sched.next(me, false),
                    origin: sched.origin(me, s - 1, false),
                    chunk: 0,
                    data: &send[..],
                }];
                let mut recvs = [RingMessage { peer: sched.prev(me, false), origin: o, chunk: 0, data: &mut next[..] }];
                if let Err(e) = pass.exchange(&sends, &mut recvs, || ()) {
                    return Ok(e.to_string());
                }
                cur = next;
            }
            // A rank whose own exchanges all completed (its neighbours sent before they failed)
            // learns of the failure at its next call on the group, which must not succeed.
            Ok(match pg.barrier() {
                Ok(()) => "no error".into(),
                Err(e) => e.to_string(),
            })
        })
        .unwrap();
    assert!(
        errors[1].contains("rank 1 would send a block of rank 0")
            && errors[1].contains("changed size mid-pass")
            && errors[1].contains(&format!("announced {} rows", rows(0))),
        "{}",
        errors[1]
    );
    for (r, e) in errors.iter().enumerate() {
        assert!(e != "no error" && e.contains("rank 1"), "rank {r}: {e}");
    }
}

#[test]
fn ranks_that_open_different_passes_fail_on_every_rank_naming_both_values() {
    let errors = world(3)
        .run(|pg| {
            let me = pg.rank();
            let value = if me == 0 { 2 } else { 1 };
            Ok(pg
                .ring_pass("test ring", 2, 3, 4, &[RingSetting { name: "directions", value }])
                .map(|_| ())
                .unwrap_err()
                .to_string())
        })
        .unwrap();
    for (r, e) in errors.iter().enumerate() {
        assert!(
            e.contains("directions differs") && e.contains("rank(s) [0]: 2") && e.contains("rank(s) [1, 2]: 1"),
            "rank {r}: {e}"
        );
    }
    // Another row width is another pass too.
    let errors =
        world(2).run(|pg| Ok(pg.ring_pass("test ring", 2, 3 + pg.rank(), 4, &[]).map(|_| ()).unwrap_err().to_string())).unwrap();
    for e in &errors {
        assert!(e.contains("the row width differs") && e.contains("rank(s) [1]: 4"), "{e}");
    }
}

/// What one rank got from a pass of chunks sent straight from their owners through
/// `exchange_tensors`: each received (origin, chunk) with its values, and the sums of the
/// chunks computed during the exchange after the one that brought them (as the ring losses
/// score them), in the same order.
type TensorRing = (Vec<((usize, usize), Vec<f64>)>, Vec<f64>);

fn tensor_ring(
    pg: &ProcessGroup,
    bidirectional: bool,
    chunk_rows: usize,
    wrong_at: Option<(usize, usize)>,
) -> candle_core::Result<TensorRing> {
    let dev = Device::Cpu;
    let (me, w) = (pg.rank(), pg.world_size());
    let sched = RingSchedule { world: w, bidirectional };
    assert!(!pg.ring_on_nccl(&dev)?, "CPU tensors never go through NCCL");
    let pass = pg.ring_pass("test tensor ring", rows(me), 3, chunk_rows, &[])?;
    let mine = Tensor::from_vec(block(me), (rows(me), 3), &dev)?;
    let (mut got, mut sums) = (Vec::new(), Vec::new());
    let mut prev: Vec<Tensor> = Vec::new();
    for s in 1..=sched.steps() {
        let dirs: &[bool] = if s <= sched.steps_down() { &[false, true] } else { &[false] };
        for k in 0..pass.chunks() {
            let range = pass.chunk_range(me, k);
            let own = if range.is_empty() {
                None
            } else if wrong_at == Some((me, s)) {
                // One row too many.
                Some(mine.narrow(0, range.start, range.len())?.flatten_all()?.pad_with_zeros(0, 0, 3)?)
            } else {
                Some(mine.narrow(0, range.start, range.len())?.flatten_all()?)
            };
            let sends: Vec<RingMessage<&Tensor>> = match &own {
                None => Vec::new(),
                Some(t) => {
                    dirs.iter().map(|&d| RingMessage { peer: sched.visitor(me, s, d), origin: me, chunk: k, data: t }).collect()
                }
            };
            let recvs: Vec<RingMessage<()>> = dirs
                .iter()
                .map(|&d| sched.origin(me, s, d))
                .filter(|&o| pass.chunk_len(o, k) > 0)
                .map(|o| RingMessage { peer: o, origin: o, chunk: k, data: () })
                .collect();
            let (during, fresh) = pass.exchange_tensors(&sends, &recvs, DType::F64, &dev, || {
                prev.iter().map(|t| t.sum_all()).collect::<candle_core::Result<Vec<_>>>()
            })?;
            for t in during? {
                sums.push(t.to_scalar::<f64>()?);
            }
            for (m, t) in recvs.iter().zip(&fresh) {
                got.push(((m.origin, m.chunk), t.to_vec1::<f64>()?));
            }
            prev = fresh;
        }
    }
    for t in &prev {
        sums.push(t.sum_all()?.to_scalar::<f64>()?);
    }
    pass.settle(&dev)?;
    Ok((got, sums))
}

/// The chunks rank `me` should receive, in order, and their sums.
fn expected_tensor_ring(w: usize, me: usize, bidirectional: bool, chunk_rows: usize) -> TensorRing {
    let sched = RingSchedule { world: w, bidirectional };
    let chunks = (0..w).map(rows).max().unwrap().div_ceil(chunk_rows);
    let mut got = Vec::new();
    for s in 1..=sched.steps() {
        let dirs: &[bool] = if s <= sched.steps_down() { &[false, true] } else { &[false] };
        for k in 0..chunks {
            for &d in dirs {
                let o = sched.origin(me, s, d);
                let lo = (k * chunk_rows).min(rows(o));
                let hi = (lo + chunk_rows).min(rows(o));
                if hi > lo {
                    got.push(((o, k), block(o)[lo * 3..hi * 3].to_vec()));
                }
            }
        }
    }
    let sums = got.iter().map(|(_, v)| v.iter().sum()).collect();
    (got, sums)
}

#[test]
fn the_exchange_of_tensors_delivers_every_chunk_with_the_work_on_the_one_before_beside_it() {
    for w in 1..=4 {
        for bidirectional in [true, false] {
            for chunk_rows in 1..=3 {
                let out = world(w).run(|pg| tensor_ring(&pg, bidirectional, chunk_rows, None)).unwrap();
                for (r, got) in out.iter().enumerate() {
                    let want = expected_tensor_ring(w, r, bidirectional, chunk_rows);
                    assert_eq!(got, &want, "W={w} both ways {bidirectional} chunk {chunk_rows} rank {r}");
                    // Every other rank's block arrives whole: its chunks' values, concatenated.
                    for o in (0..w).filter(|&o| o != r) {
                        let whole: Vec<f64> = got.0.iter().filter(|((x, _), _)| *x == o).flat_map(|(_, v)| v.clone()).collect();
                        assert_eq!(whole, block(o), "W={w} rank {r}: rank {o}'s block");
                    }
                }
            }
        }
    }
}

#[test]
fn a_tensor_chunk_of_another_size_fails_on_every_rank_naming_the_rank() {
    let w = 3;
    let errors = world(w)
        .run(|pg| {
            Ok(match tensor_ring(&pg, false, 2, Some((1, 2))) {
                Ok(_) => match pg.barrier() {
                    Ok(()) => "no error".to_string(),
                    Err(e) => e.to_string(),
                },
                Err(e) => e.to_string(),
            })
        })
        .unwrap();
    assert!(errors[1].contains("rank 1 would send chunk") && errors[1].contains("changed size mid-pass"), "{}", errors[1]);
    for (r, e) in errors.iter().enumerate() {
        assert!(e != "no error" && e.contains("rank 1"), "rank {r}: {e}");
    }
}
