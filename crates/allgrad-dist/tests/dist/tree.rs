//! The binomial-tree path of large groups (ALLGRAD_TREE_FROM ranks or more, default 32), run
//! here on small worlds by lowering the threshold to 2 (`ThreadWorld::tree_from`), with
//! shared memory off so that every call goes over TCP: all_reduce (every op and dtype),
//! all_gather (equal and uneven sizes) and reduce_scatter against the serial f64 reference,
//! results bitwise identical on every rank, the barrier, mismatched calls and a departed rank
//! failing every rank with the same messages as the full mesh, and the frames a call costs;
//! all_to_all in Bruck's rounds (equal and uneven blocks, empty ones, a large block on one
//! rank), against the serial reference and bitwise against the direct path, here and above
//! the default threshold. Every test checks that the tree path ran (the group's path
//! counters), so that it fails if the full-mesh path ran instead.

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
    for w in 2..=8 {
        let arrived = AtomicUsize::new(0);
        run(w, |pg| {
            let r = pg.rank();
            for round in 1..=3 {
                // Ranks arrive at different times; in the first round the last rank, a leaf deep
                // in the tree, arrives well after the others.
                let wait = if round == 1 && r == w - 1 { 300 } else { (r * 7 % 11) as u64 };
                std::thread::sleep(Duration::from_millis(wait));
                arrived.fetch_add(1, Ordering::SeqCst);
                let (frames, paths) = (pg.wire_counts(), pg.pairwise_paths());
                pg.barrier()?;
                let seen = arrived.load(Ordering::SeqCst);
                assert_eq!(seen, round * w, "W={w}: rank {r} left barrier {round} with {seen} arrivals");
                let after = pg.pairwise_paths();
                assert_eq!(after.barrier_tree, paths.barrier_tree + 1, "W={w}: the tree barrier did not run ({after:?})");
                assert_eq!(after.barrier_direct, 0, "W={w}: {after:?}");
                // Through the tree: one frame up to the parent and one down to each child, and
                // as many back, where the full mesh sends and receives W - 1.
                let d = pg.wire_counts();
                let links = tree_children(r, w) + (r != 0) as usize;
                assert_eq!(
                    (d.frames_sent - frames.frames_sent, d.frames_received - frames.frames_received),
                    (links as u64, links as u64),
                    "W={w}: rank {r}'s barrier frames"
                );
                // Nobody starts the next round before everyone has looked.
                pg.barrier()?;
            }
            Ok(())
        });
    }
}

/// The children of rank `r` in the binomial tree of `w` ranks rooted at 0.
fn tree_children(r: usize, w: usize) -> usize {
    let lowbit = if r == 0 { usize::MAX } else { r & r.wrapping_neg() };
    (0..usize::BITS).map(|k| 1usize << k).take_while(|d| *d < lowbit && r + d < w).count()
}

/// Bruck's rounds in a group of `w` ranks: ceil(log2(w)).
fn bruck_rounds(w: usize) -> u64 {
    (0..usize::BITS).map(|k| 1usize << k).take_while(|d| *d < w).count() as u64
}

/// Which path an all_to_all took, from the group's counters before and after it.
fn all_to_all_path(before: allgrad_dist::PairwisePaths, after: allgrad_dist::PairwisePaths) -> &'static str {
    let d = (
        after.all_to_all_direct - before.all_to_all_direct,
        after.all_to_all_bruck - before.all_to_all_bruck,
        after.all_to_all_bruck_sizes - before.all_to_all_bruck_sizes,
    );
    match d {
        (1, 0, 0) => "direct",
        (0, 1, 0) => "bruck",
        (0, 0, 1) => "bruck sizes",
        _ => panic!("one all_to_all counted {d:?} (direct, bruck, bruck sizes)"),
    }
}

/// The all_to_all cases of the Bruck tests, each checked against the serial reference on
/// rank `pg.rank()`: equal blocks of every dtype, uneven ones with empty blocks, rows of no
/// elements, and a block of 4 KiB from the last rank to rank 0 only (every other block 48
/// bytes or less), so that one rank alone sees a large block. Returns each case's name, the
/// path it took (`all_to_all_path`), the frames this rank sent, and the bits received.
fn all_to_all_cases(pg: &ProcessGroup) -> candle_core::Result<Vec<(String, &'static str, u64, u64)>> {
    let (w, r) = (pg.world_size(), pg.rank());
    let mut out = Vec::new();
    let mut one = |what: String, x: &Tensor, send: &[usize], want: &[f64], want_sizes: &[usize]| -> candle_core::Result<()> {
        let (before, frames) = (pg.pairwise_paths(), pg.wire_counts().frames_sent);
        let (y, got) = pg.all_to_all_sizes(x, send)?;
        let path = all_to_all_path(before, pg.pairwise_paths());
        let sent = pg.wire_counts().frames_sent - frames;
        assert_eq!(got, want_sizes, "{what} on rank {r}: received sizes");
        let mut dims = vec![want_sizes.iter().sum()];
        dims.extend_from_slice(&x.dims()[1..]);
        check(&format!("{what} on rank {r}"), &y, x.dtype(), &dims, true, want);
        out.push((what, path, sent, bits_digest(&y)));
        Ok(())
    };
    for dtype in DTYPES {
        // Equal blocks: row j of [W, n] goes to rank j.
        for n in [1, 5] {
            let s = salt("bruck all_to_all", dtype, n);
            let x = tensor(dtype, &gen(dtype, Kind::General, r, s, 0..w * n), &[w, n]);
            let want: Vec<f64> = (0..w).flat_map(|q| gen(dtype, Kind::General, q, s, r * n..(r + 1) * n)).collect();
            one(format!("all_to_all W={w} {dtype:?} [{w}, {n}]"), &x, &vec![1; w], &want, &vec![1; w])?;
        }
    }
    for dtype in [DType::F32, DType::F64, DType::U8, DType::I64] {
        // Uneven blocks of 3 columns, some empty: rank q sends split(q, j) rows to rank j; and
        // a 4 KiB block from the last rank to rank 0 in the large case.
        for large in [false, true] {
            let split = |q: usize, j: usize| {
                let rows = if (q + j) % 3 == 1 { 0 } else { 1 + (q + 2 * j) % 2 };
                if large && q == w - 1 && j == 0 {
                    (4096 / dtype.size_in_bytes()).div_ceil(COLS)
                } else {
                    rows
                }
            };
            let s = salt("bruck all_to_all_sizes", dtype, large as usize);
            let send: Vec<usize> = (0..w).map(|j| split(r, j)).collect();
            let rows: usize = send.iter().sum();
            let x = tensor(dtype, &gen(dtype, Kind::General, r, s, 0..rows * COLS), &[rows, COLS]);
            let recv: Vec<usize> = (0..w).map(|q| split(q, r)).collect();
            let mut want = Vec::new();
            for (q, from_q) in recv.iter().enumerate() {
                let sent_by_q: Vec<usize> = (0..w).map(|j| split(q, j)).collect();
                let off = offsets(&sent_by_q)[r];
                want.extend(gen(dtype, Kind::General, q, s, off * COLS..(off + from_q) * COLS));
            }
            one(format!("all_to_all_sizes W={w} {dtype:?} large={large} send {send:?}"), &x, &send, &want, &recv)?;
        }
    }
    // Rows of no elements: the row counts themselves go through.
    let x = Tensor::zeros((w, 0), DType::F32, &Device::Cpu)?;
    let before = pg.pairwise_paths();
    let (y, got) = pg.all_to_all_sizes(&x, &vec![1; w])?;
    let path = all_to_all_path(before, pg.pairwise_paths());
    assert_eq!((y.dims(), got), (&[w, 0][..], vec![1; w]), "all_to_all of empty rows W={w}");
    out.push((format!("all_to_all of empty rows W={w}"), path, 0, 0));
    Ok(out)
}

/// The frames rank `r` of `w` sends in an all_to_all of a tree group: one up the tree, then
/// one per Bruck round for the sizes, then one per round for the data (`bruck`) or one to
/// every peer (`bruck sizes`).
fn bruck_frames(path: &str, r: usize, w: usize) -> u64 {
    let data = if path == "bruck" { bruck_rounds(w) } else { w as u64 - 1 };
    (r != 0) as u64 + bruck_rounds(w) + data
}

/// all_to_all of large groups goes through Bruck's log2(W) rounds: the serial reference on
/// every rank, the direct path's bits (the same calls in a group below the threshold), 1 + 2
/// ceil(log2(W)) frames sent per rank (a check up the tree, sizes, then blocks) where the
/// direct path sends 2(W - 1), and every rank agreeing to send the data directly when one rank
/// alone has a block too large for Bruck.
#[test]
fn bruck_all_to_all_matches_the_serial_reference_and_the_direct_path_bitwise() {
    for w in 2..=9 {
        let bruck = run(w, |pg| all_to_all_cases(&pg));
        let direct = ThreadWorld::new(w)
            .timeout(TIMEOUT)
            .shm(false)
            .run(|pg| all_to_all_cases(&pg))
            .unwrap_or_else(|e| panic!("direct world of {w} ranks failed: {e}"));
        for r in 0..w {
            for (b, d) in bruck[r].iter().zip(&direct[r]) {
                let what = format!("{} on rank {r}", b.0);
                assert_eq!(d.1, "direct", "{what}: below the threshold");
                let large = b.0.contains("large=true");
                assert_eq!(b.1, if large { "bruck sizes" } else { "bruck" }, "{what}: the path");
                assert_eq!(b.3, d.3, "{what}: Bruck's result differs bitwise from the direct path's");
                if !b.0.contains("empty rows") {
                    assert_eq!(b.2, bruck_frames(b.1, r, w), "{what}: frames sent");
                    assert_eq!(d.2, 2 * (w as u64 - 1), "{what}: frames sent by the direct path");
                }
            }
        }
    }
}

/// Above the default threshold (32 ranks), with no setting: all_to_all takes Bruck's rounds
/// and the barrier the tree, with the direct path's bits (the same calls with the threshold
/// raised past the group).
#[test]
fn above_the_default_threshold_all_to_all_and_the_barrier_take_log2_w_rounds() {
    // The default threshold is 32.
    let w = 33;
    let calls = |pg: ProcessGroup| {
        let r = pg.rank();
        let cases = all_to_all_cases(&pg)?;
        // The barrier's frames: one up to the parent and one down to each child.
        let (frames, paths) = (pg.wire_counts(), pg.pairwise_paths());
        pg.barrier()?;
        let barrier = pg.pairwise_paths();
        let sent = pg.wire_counts().frames_sent - frames.frames_sent;
        let tree = barrier.barrier_tree - paths.barrier_tree;
        let direct = barrier.barrier_direct - paths.barrier_direct;
        Ok((cases, (tree, direct, sent, tree_children(r, w) + (r != 0) as usize)))
    };
    let tree = ThreadWorld::new(w).timeout(TIMEOUT).shm(false).run(calls).unwrap_or_else(|e| panic!("W={w}: {e}"));
    let mesh = ThreadWorld::new(w)
        .timeout(TIMEOUT)
        .shm(false)
        .tree_from(w + 1)
        .run(calls)
        .unwrap_or_else(|e| panic!("W={w} below the threshold: {e}"));
    for r in 0..w {
        let ((t_cases, t_barrier), (m_cases, m_barrier)) = (&tree[r], &mesh[r]);
        assert_eq!((t_barrier.0, t_barrier.1), (1, 0), "rank {r}: the barrier did not take the tree");
        assert_eq!(t_barrier.2, t_barrier.3 as u64, "rank {r}: barrier frames through the tree");
        assert_eq!((m_barrier.0, m_barrier.1, m_barrier.2), (0, 1, w as u64 - 1), "rank {r}: the full mesh's barrier");
        for (b, d) in t_cases.iter().zip(m_cases) {
            let what = format!("{} on rank {r}", b.0);
            let large = b.0.contains("large=true");
            assert_eq!((b.1, d.1), (if large { "bruck sizes" } else { "bruck" }, "direct"), "{what}: the paths");
            assert_eq!(b.3, d.3, "{what}: Bruck's result differs bitwise from the direct path's");
            if !b.0.contains("empty rows") {
                assert_eq!(b.2, bruck_frames(b.1, r, w), "{what}: frames sent");
            }
        }
    }
}

#[test]
fn mismatched_calls_fail_every_rank_through_the_tree_naming_both_calls() {
    // (the odd rank, its call, the others' call): a leaf and an inner node of the tree.
    for (w, odd) in [(5, 4), (7, 2), (8, 3)] {
        for (odd_op, op) in [
            ("all_gather", "all_reduce"),
            ("barrier", "all_reduce"),
            ("all_reduce", "reduce_scatter"),
            ("all_to_all", "all_reduce"),
            ("barrier", "all_to_all"),
        ] {
            let case = format!("W={w}: rank {odd} {odd_op}, the others {op}");
            let start = Instant::now();
            let errs = tree_world(w)
                .run(|pg| {
                    let x = tensor(DType::F32, &vec![pg.rank() as f64; 2 * w], &[w, 2]);
                    let res = match if pg.rank() == odd { odd_op } else { op } {
                        "all_gather" => pg.all_gather(&x).map(|_| ()),
                        "barrier" => pg.barrier().map_err(Into::into),
                        "reduce_scatter" => pg.reduce_scatter(&x, ReduceOp::Sum).map(|_| ()),
                        "all_to_all" => pg.all_to_all(&x).map(|_| ()),
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
fn a_departed_rank_fails_every_survivor_of_a_tree_all_reduce_or_bruck_all_to_all_naming_it() {
    // A leaf, an inner node and the root of the tree.
    for call in ["all_reduce", "all_to_all"] {
        for (w, dead) in [(6, 5), (8, 4), (5, 0)] {
            let start = Instant::now();
            let errs = tree_world(w)
                .run(|pg| {
                    if pg.rank() == dead {
                        return Ok(None);
                    }
                    let res = if call == "all_reduce" {
                        pg.all_reduce(&tensor(DType::F32, &[1.0, 2.0, 3.0], &[3]), ReduceOp::Sum).map(|_| ())
                    } else {
                        pg.all_to_all(&tensor(DType::F32, &vec![1.0; 2 * w], &[w, 2])).map(|_| ())
                    };
                    Ok(Some(res.err().map(|e| e.to_string())))
                })
                .unwrap_or_else(|e| panic!("{call} W={w}: {e}"));
            assert!(start.elapsed() < Duration::from_secs(10), "{call} W={w}, rank {dead} gone: took {:?}", start.elapsed());
            for (r, e) in errs.iter().enumerate().filter(|(r, _)| *r != dead) {
                let e = e.as_ref().unwrap().as_deref().unwrap_or_else(|| panic!("{call} W={w}: rank {r}'s call succeeded"));
                assert!(names_rank(e, dead), "{call} W={w}: rank {r}'s error does not name rank {dead}: {e}");
            }
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
            let before = pg.wire_counts().frames_sent;
            pg.all_to_all_v_slice(&[1.0f32; 4], &[1; 4], &[])?;
            pg.barrier()?;
            // Sizes and data to every peer, then the barrier's frame to every peer.
            assert_eq!(pg.wire_counts().frames_sent - before, 3 * (w - 1) as u64);
            let p = pg.pairwise_paths();
            assert_eq!(
                (p.all_to_all_direct, p.all_to_all_bruck, p.all_to_all_bruck_sizes, p.barrier_direct, p.barrier_tree),
                (1, 0, 0, 1, 0),
                "{p:?}"
            );
            Ok(())
        })
        .unwrap();
}
