//! The binomial-tree path of large groups (ALLGRAD_TREE_FROM ranks or more, default 32), run
//! here on small worlds by lowering the threshold to 2 (`ThreadWorld::tree_from`), with
//! shared memory off so that every call goes over TCP: all_reduce (every op and dtype),
//! all_gather (equal and uneven sizes) and reduce_scatter against the serial f64 reference,
//! results bitwise identical on every rank, the barrier, mismatched calls and a departed rank
//! failing every rank with the same messages as the full mesh, and the frames a call costs.
//! Every test checks that the tree path ran (the group's path counters), so that it fails if
//! the full-mesh path ran instead.

use crate::common::*;

const TIMEOUT: Duration = Duration::from_secs(30);

fn tree_world(w: usize) -> ThreadWorld {
    ThreadWorld::new(w).timeout(TIMEOUT).shm(false).tree_from(2)
}

fn run<T: Send>(w: usize, f: impl Fn(ProcessGroup) -> candle_core::Result<T> + Sync) -> Vec<T> {
    tree_world(w).run(f).unwrap_or_else(|e| panic!("tree world of {w} ranks failed: {e}"))
}

/// Whether `msg` names rank `r` ("rank 2", not "rank 21").
fn names_rank(msg: &str, r: usize) -> bool {
    let needle = format!("rank {r}");
    msg.match_indices(&needle).any(|(i, _)| !msg[i + needle.len()..].starts_with(|c: char| c.is_ascii_digit()))
}

#[test]
fn tree_all_reduce_matches_the_serial_reference_bitwise_on_every_rank() {
    for w in 2..=7 {
        let digests = run(w, |pg| {
            let r = pg.rank();
            let mut out = Vec::new();
            for dtype in DTYPES {
                for n in [0, 1, 7, 1000] {
                    for kind in [Kind::General, Kind::Prod, Kind::Rough, Kind::RoughProd] {
                        if is_int(dtype) && matches!(kind, Kind::Rough | Kind::RoughProd) {
                            continue;
                        }
                        // Products of W factors up to 3 overflow u8 past W = 5 (the reference
                        // does not wrap).
                        if dtype == DType::U8 && kind == Kind::Prod && w > 5 {
                            continue;
                        }
                        let s = salt("tree all_reduce", dtype, n);
                        let parts: Vec<Vec<f64>> = (0..w).map(|q| gen(dtype, kind, q, s, 0..n)).collect();
                        let x = tensor(dtype, &parts[r], &[n]);
                        let prod = matches!(kind, Kind::Prod | Kind::RoughProd);
                        for op in OPS.into_iter().filter(|op| (*op == ReduceOp::Prod) == prod) {
                            let what = format!("tree all_reduce({op:?}) W={w} {dtype:?} n={n} {kind:?}");
                            let before = pg.all_reduce_paths();
                            let y = pg.all_reduce(&x, op)?;
                            let after = pg.all_reduce_paths();
                            assert_eq!(after.tree, before.tree + 1, "{what}: the tree path did not run ({after:?})");
                            assert_eq!((after.direct, after.ring), (0, 0), "{what}: {after:?}");
                            if matches!(kind, Kind::General | Kind::Prod) {
                                check(
                                    &format!("{what} on rank {r}"),
                                    &y,
                                    dtype,
                                    &[n],
                                    exact_op(op, dtype),
                                    &fold(op, dtype, &parts),
                                );
                            } else {
                                // Rounding inputs: close to the reference (sums bounded by the sum
                                // of magnitudes); equality across ranks is checked below.
                                let scale: Vec<f64> = match op {
                                    ReduceOp::Sum | ReduceOp::Avg => fold(
                                        ReduceOp::Sum,
                                        dtype,
                                        &parts.iter().map(|p| p.iter().map(|x| x.abs()).collect()).collect::<Vec<_>>(),
                                    ),
                                    _ => fold(op, dtype, &parts).iter().map(|x| x.abs()).collect(),
                                };
                                let scale: Vec<f64> =
                                    scale.iter().map(|s| if op == ReduceOp::Avg { s / w as f64 } else { *s }).collect();
                                check_scaled(&what, dtype, exact_op(op, dtype), &read(&y), &fold(op, dtype, &parts), &scale);
                            }
                            out.push((what, bits_digest(&y)));
                        }
                    }
                }
            }
            Ok(out)
        });
        for r in 1..w {
            for (a, b) in digests[0].iter().zip(&digests[r]) {
                assert_eq!(a, b, "W={w}: rank {r}'s result differs bitwise from rank 0's");
            }
        }
    }
}

#[test]
fn tree_all_gather_and_reduce_scatter_match_the_serial_reference() {
    for w in [2, 3, 5, 8] {
        run(w, |pg| {
            let r = pg.rank();
            for dtype in [DType::F32, DType::F64, DType::U8, DType::I64] {
                // Equal sizes, and uneven ones (whose sizes are gathered first, also through the
                // tree), a rank with no rows among them.
                for uneven in [false, true] {
                    let rows: Vec<usize> = (0..w).map(|q| if uneven { uneven_rows(q, w, 2) } else { 3 }).collect();
                    let s = salt("tree all_gather", dtype, uneven as usize);
                    let parts: Vec<Vec<f64>> = (0..w).map(|q| gen(dtype, Kind::General, q, s, 0..rows[q] * COLS)).collect();
                    let x = tensor(dtype, &parts[r], &[rows[r], COLS]);
                    let frames = pg.wire_counts().frames_sent;
                    let y = if uneven {
                        let (y, sizes) = pg.all_gather_with_sizes(&x)?;
                        assert_eq!(sizes, rows, "W={w}: gathered row counts");
                        y
                    } else {
                        pg.all_gather(&x)?
                    };
                    // The tree path, twice (the sizes go first): one frame up to the parent and
                    // one down to each child, where the full mesh sends W - 1.
                    let sent = pg.wire_counts().frames_sent - frames;
                    let lowbit = if r == 0 { usize::MAX } else { r & r.wrapping_neg() };
                    let children = (0..usize::BITS).map(|k| 1usize << k).take_while(|d| *d < lowbit && r + d < w).count();
                    assert_eq!(sent, 2 * (children + (r != 0) as usize) as u64, "W={w} rank {r}: frames sent");
                    let want: Vec<f64> = parts.concat();
                    let what = format!("tree all_gather W={w} {dtype:?} uneven={uneven}");
                    check(&what, &y, dtype, &[want.len() / COLS, COLS], true, &want);
                }
                for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg] {
                    let counts: Vec<usize> = (0..w).map(|q| if q == 1 { 0 } else { 2 + q }).collect();
                    let n: usize = counts.iter().sum();
                    let s = salt("tree reduce_scatter", dtype, n);
                    let parts: Vec<Vec<f64>> = (0..w).map(|q| gen(dtype, Kind::General, q, s, 0..n)).collect();
                    if is_int(dtype) && op == ReduceOp::Avg {
                        continue;
                    }
                    let before = pg.all_reduce_paths().tree;
                    let y = pg.reduce_scatter_sizes(&tensor(dtype, &parts[r], &[n]), op, &counts)?;
                    assert_eq!(pg.all_reduce_paths().tree, before + 1, "W={w}: reduce_scatter did not take the tree");
                    let start: usize = counts[..r].iter().sum();
                    let want = &fold(op, dtype, &parts)[start..start + counts[r]];
                    check(
                        &format!("tree reduce_scatter({op:?}) W={w} {dtype:?}"),
                        &y,
                        dtype,
                        &[counts[r]],
                        exact_op(op, dtype),
                        want,
                    );
                }
            }
            Ok(())
        });
    }
}

/// Small broadcasts and reduces of a large group go through the tree, from and to every root:
/// a broadcast gives every rank the root's bits; a reduce gives the root the serial reference
/// (exact inputs) and the tree all_reduce's bits (rounding inputs: the same association), and
/// leaves every other rank's input as it was. A broadcast costs each rank at most its children's
/// frames, never the W - 1 of the direct path's root.
#[test]
fn tree_broadcast_and_reduce_match_the_serial_reference_from_every_root() {
    for w in [2, 3, 5, 6, 8] {
        run(w, |pg| {
            let r = pg.rank();
            for dtype in [DType::F32, DType::F64, DType::I64, DType::U8] {
                for n in [0, 1, 7, 300] {
                    for root in 0..w {
                        let s = salt("tree broadcast", dtype, n * 16 + root);
                        let parts: Vec<Vec<f64>> = (0..w).map(|q| gen(dtype, Kind::General, q, s, 0..n)).collect();
                        let what = format!("tree broadcast W={w} {dtype:?} n={n} root={root}");
                        let (before, frames) = (pg.rooted_paths(), pg.wire_counts().frames_sent);
                        let y = pg.broadcast(&tensor(dtype, &parts[r], &[n]), root)?;
                        let after = pg.rooted_paths();
                        assert_eq!(after.broadcast_tree, before.broadcast_tree + 1, "{what}: the tree did not run ({after:?})");
                        assert_eq!((after.broadcast_direct, after.broadcast_chain), (0, 0), "{what}: {after:?}");
                        let rel = (r + w - root) % w;
                        let lowbit = if rel == 0 { usize::MAX } else { rel & rel.wrapping_neg() };
                        let children = (0..usize::BITS).map(|k| 1usize << k).take_while(|d| *d < lowbit && rel + d < w).count();
                        assert_eq!(pg.wire_counts().frames_sent - frames, children as u64, "{what} rank {r}: frames sent");
                        check(&what, &y, dtype, &[n], true, &parts[root]);

                        for kind in [Kind::General, Kind::Rough] {
                            if is_int(dtype) && kind == Kind::Rough {
                                continue;
                            }
                            let s = salt("tree reduce", dtype, n * 16 + root);
                            let parts: Vec<Vec<f64>> = (0..w).map(|q| gen(dtype, kind, q, s, 0..n)).collect();
                            let x = tensor(dtype, &parts[r], &[n]);
                            for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Avg] {
                                if is_int(dtype) && op == ReduceOp::Avg {
                                    continue;
                                }
                                let what = format!("tree reduce({op:?}) W={w} {dtype:?} n={n} root={root} {kind:?}");
                                let before = pg.rooted_paths();
                                let y = pg.reduce(&x, root, op)?;
                                let after = pg.rooted_paths();
                                assert_eq!(after.reduce_tree, before.reduce_tree + 1, "{what}: the tree did not run ({after:?})");
                                assert_eq!((after.reduce_direct, after.reduce_ring), (0, 0), "{what}: {after:?}");
                                if r != root {
                                    assert_eq!(bits_digest(&y), bits_digest(&x), "{what}: rank {r}'s input changed");
                                } else if kind == Kind::General {
                                    check(&what, &y, dtype, &[n], exact_op(op, dtype), &fold(op, dtype, &parts));
                                }
                                // The root's bits are the all_reduce's, on every rank's word.
                                let all = pg.all_reduce(&x, op)?;
                                let root_bits = pg.broadcast(&Tensor::new(&[bits_digest(&y) as i64], &Device::Cpu)?, root)?;
                                assert_eq!(
                                    root_bits.to_vec1::<i64>()?[0] as u64,
                                    bits_digest(&all),
                                    "{what}: the root's result differs bitwise from the tree all_reduce's"
                                );
                            }
                        }
                    }
                }
            }
            Ok(())
        });
    }
}

#[test]
fn tree_barrier_holds_every_rank_until_all_arrive() {
    let w = 6;
    let arrived = AtomicUsize::new(0);
    run(w, |pg| {
        // Rank 5, a leaf deep in the tree, arrives last.
        if pg.rank() == 5 {
            std::thread::sleep(Duration::from_millis(300));
        }
        arrived.fetch_add(1, Ordering::SeqCst);
        let frames = pg.wire_counts();
        pg.barrier()?;
        assert_eq!(arrived.load(Ordering::SeqCst), w, "rank {} left the barrier early", pg.rank());
        // Through the tree: rank 0 exchanges with its children 1, 2 and 4 only.
        if pg.rank() == 0 {
            let d = pg.wire_counts();
            assert_eq!((d.frames_sent - frames.frames_sent, d.frames_received - frames.frames_received), (3, 3));
        }
        Ok(())
    });
}

#[test]
fn mismatched_calls_fail_every_rank_through_the_tree_naming_both_calls() {
    // (the odd rank, its call, the others' call): a leaf and an inner node of the tree.
    for (w, odd) in [(5, 4), (7, 2), (8, 3)] {
        for (odd_op, op) in [("all_gather", "all_reduce"), ("barrier", "all_reduce"), ("all_reduce", "reduce_scatter")] {
            let case = format!("W={w}: rank {odd} {odd_op}, the others {op}");
            let start = Instant::now();
            let errs = tree_world(w)
                .run(|pg| {
                    let x = tensor(DType::F32, &vec![pg.rank() as f64; 2 * w], &[w, 2]);
                    let res = match if pg.rank() == odd { odd_op } else { op } {
                        "all_gather" => pg.all_gather(&x).map(|_| ()),
                        "barrier" => pg.barrier().map_err(Into::into),
                        "reduce_scatter" => pg.reduce_scatter(&x, ReduceOp::Sum).map(|_| ()),
                        _ => pg.all_reduce(&x, ReduceOp::Sum).map(|_| ()),
                    };
                    Ok(res.err().map(|e| e.to_string()))
                })
                .unwrap_or_else(|e| panic!("{case}: {e}"));
            assert!(start.elapsed() < Duration::from_secs(10), "{case}: took {:?}", start.elapsed());
            for (r, e) in errs.iter().enumerate() {
                let e = e.as_deref().unwrap_or_else(|| panic!("{case}: rank {r}'s call succeeded"));
                assert!(e.contains("collective mismatch") && e.contains(odd_op) && e.contains(op), "{case}: rank {r}: {e}");
                assert!(names_rank(e, odd), "{case}: rank {r}'s error does not name rank {odd}: {e}");
            }
        }
    }
}

#[test]
fn a_departed_rank_fails_every_survivor_of_a_tree_all_reduce_naming_it() {
    // A leaf, an inner node and the root of the tree.
    for (w, dead) in [(6, 5), (8, 4), (5, 0)] {
        let start = Instant::now();
        let errs = tree_world(w)
            .run(|pg| {
                if pg.rank() == dead {
                    return Ok(None);
                }
                let x = tensor(DType::F32, &[1.0, 2.0, 3.0], &[3]);
                Ok(Some(pg.all_reduce(&x, ReduceOp::Sum).err().map(|e| e.to_string())))
            })
            .unwrap_or_else(|e| panic!("W={w}: {e}"));
        assert!(start.elapsed() < Duration::from_secs(10), "W={w}, rank {dead} gone: took {:?}", start.elapsed());
        for (r, e) in errs.iter().enumerate().filter(|(r, _)| *r != dead) {
            let e = e.as_ref().unwrap().as_deref().unwrap_or_else(|| panic!("W={w}: rank {r}'s all_reduce succeeded"));
            assert!(names_rank(e, dead), "W={w}: rank {r}'s error does not name rank {dead}: {e}");
        }
    }
}

#[test]
fn a_tree_group_on_one_host_sets_up_shared_memory_through_the_tree() {
    if !shm_available() {
        return allgrad_testkit::skip(allgrad_testkit::Need::DevShm, "no /dev/shm: no shared memory to set up");
    }
    // The setup's three rounds through the tree: rank 0 of 8 exchanges with its children 1, 2
    // and 4 only, 3 frames out and 3 in per round; with every peer it would be 7 + 7, 7, 7 + 7.
    let w = 8;
    let n = 100_003;
    tree_world(w)
        .shm(true)
        .run(|pg| {
            assert!(pg.shared_memory(), "rank {}: no shared memory", pg.rank());
            if pg.rank() == 0 {
                let c = pg.wire_counts();
                assert_eq!((c.frames_sent, c.frames_received), (9, 9), "rank 0's setup frames");
            }
            let parts: Vec<Vec<f64>> = (0..w).map(|q| gen(DType::F32, Kind::General, q, 11, 0..n)).collect();
            let y = pg.all_reduce(&tensor(DType::F32, &parts[pg.rank()], &[n]), ReduceOp::Sum)?;
            assert_eq!(pg.all_reduce_paths().shared_memory, 1);
            check(
                "shared-memory all_reduce of a tree group",
                &y,
                DType::F32,
                &[n],
                true,
                &fold(ReduceOp::Sum, DType::F32, &parts),
            );
            Ok(())
        })
        .unwrap();
}

#[test]
fn below_the_threshold_small_calls_keep_the_one_round_full_mesh() {
    // The default threshold (32) leaves a 4-rank group on the direct path: W - 1 frames out
    // per call, and the tree counter untouched.
    let w = 4;
    ThreadWorld::new(w)
        .timeout(TIMEOUT)
        .shm(false)
        .run(|pg| {
            let before = pg.wire_counts().frames_sent;
            pg.all_reduce_slice(&mut [1.0f32; 3], ReduceOp::Sum)?;
            assert_eq!(pg.wire_counts().frames_sent - before, (w - 1) as u64);
            assert_eq!((pg.all_reduce_paths().direct, pg.all_reduce_paths().tree), (1, 0));
            pg.broadcast_slice(&mut [1.0f32; 3], 1)?;
            pg.reduce_slice(&mut [1.0f32; 3], 2, ReduceOp::Sum)?;
            let p = pg.rooted_paths();
            assert_eq!((p.broadcast_direct, p.broadcast_tree, p.reduce_direct, p.reduce_tree), (1, 0, 1, 0), "{p:?}");
            Ok(())
        })
        .unwrap();
}
