//! Collectives with a root (broadcast, reduce), point-to-point messages, the barrier, and
//! `run_threads` itself.

use crate::common::*;

// ------------------------------------------------------------------ broadcast and reduce

#[test]
fn broadcast_from_every_root_delivers_the_roots_tensor() {
    for w in 1..=4 {
        world(w, |pg| {
            let r = pg.rank();
            for dtype in DTYPES {
                for n in SIZES {
                    for root in 0..w {
                        let s = salt(&format!("broadcast/{root}"), dtype, n);
                        let x = tensor(dtype, &gen(dtype, Kind::General, r, s, 0..n), &[n]);
                        let y = pg.broadcast(&x, root)?;
                        let what = format!("broadcast from {root} W={w} {dtype:?} n={n} on rank {r}");
                        check(&what, &y, dtype, &[n], true, &gen(dtype, Kind::General, root, s, 0..n));
                    }
                }
            }
            Ok(())
        });
    }
}

#[test]
fn reduce_to_every_root_matches_serial_reference_and_leaves_non_roots_their_input() {
    for w in 1..=4 {
        world(w, |pg| {
            let r = pg.rank();
            for dtype in DTYPES {
                for n in SIZES {
                    for kind in [Kind::General, Kind::Prod] {
                        let s = salt("reduce", dtype, n);
                        let parts: Vec<Vec<f64>> = (0..w).map(|q| gen(dtype, kind, q, s, 0..n)).collect();
                        let x = tensor(dtype, &parts[r], &[n]);
                        for op in OPS.into_iter().filter(|op| kind_for(*op) == kind) {
                            for root in 0..w {
                                let y = pg.reduce(&x, root, op)?;
                                let what = format!("reduce({op:?}) to {root} W={w} {dtype:?} n={n} on rank {r}");
                                if r == root {
                                    check(&what, &y, dtype, &[n], exact_op(op, dtype), &fold(op, dtype, &parts));
                                } else {
                                    check(&what, &y, dtype, &[n], true, &parts[r]);
                                }
                            }
                        }
                    }
                }
            }
            Ok(())
        });
    }
}

// ------------------------------------------------------------------ send/recv and barrier

#[test]
fn send_recv_passes_every_dtype_and_size_around_the_ring() {
    for w in 2..=4 {
        world(w, |pg| {
            let r = pg.rank();
            let (right, left) = ((r + 1) % w, (r + w - 1) % w);
            for dtype in DTYPES {
                for n in SIZES {
                    let s = salt("ring", dtype, n);
                    let x = tensor(dtype, &gen(dtype, Kind::General, r, s, 0..n), &[n]);
                    // Rank 0 starts the pass; every other rank receives before it sends on, so
                    // large messages cannot deadlock on full socket buffers.
                    let y = if r == 0 {
                        pg.send(&x, right)?;
                        pg.recv(&[n][..], dtype, &Device::Cpu, left)?
                    } else {
                        let y = pg.recv(&[n][..], dtype, &Device::Cpu, left)?;
                        pg.send(&x, right)?;
                        y
                    };
                    let what = format!("recv from {left} W={w} {dtype:?} n={n} on rank {r}");
                    check(&what, &y, dtype, &[n], true, &gen(dtype, Kind::General, left, s, 0..n));
                }
            }
            // Several messages between the same pair (not ring neighbours at W = 4) arrive in order.
            let (a, b) = (0, w - 1 - usize::from(w == 4));
            if r == a {
                for k in 0..5 {
                    pg.send(&tensor(DType::I64, &[k as f64, -(k as f64)], &[2]), b)?;
                }
            } else if r == b {
                for k in 0..5 {
                    let y = pg.recv(&[2][..], DType::I64, &Device::Cpu, a)?;
                    check(&format!("message {k} from {a}"), &y, DType::I64, &[2], true, &[k as f64, -(k as f64)]);
                }
            }
            Ok(())
        });
    }
}

#[test]
fn send_to_self_or_out_of_range_is_rejected() {
    world(2, |pg| {
        let x = tensor(DType::F32, &[1.0], &[1]);
        assert!(pg.send(&x, pg.rank()).is_err(), "send to self");
        assert!(pg.send(&x, 2).is_err(), "send to rank 2 of 2");
        assert!(pg.recv(&[1][..], DType::F32, &Device::Cpu, 5).is_err(), "recv from rank 5 of 2");
        // The group is still usable.
        let y = pg.all_reduce(&tensor(DType::F32, &[pg.rank() as f64 + 1.0], &[1]), ReduceOp::Sum)?;
        check("all_reduce after rejected calls", &y, DType::F32, &[1], true, &[3.0]);
        Ok(())
    });
}

#[test]
fn barrier_holds_every_rank_until_all_arrive() {
    for w in 1..=4 {
        let arrived = AtomicUsize::new(0);
        world(w, |pg| {
            let r = pg.rank();
            for round in 1..=5 {
                // Ranks arrive at different times.
                std::thread::sleep(Duration::from_millis((r * 7 % 11) as u64));
                arrived.fetch_add(1, Ordering::SeqCst);
                pg.barrier()?;
                let seen = arrived.load(Ordering::SeqCst);
                assert_eq!(seen, round * w, "rank {r} left barrier {round} with {seen} arrivals");
                // Nobody starts the next round before everyone has looked.
                pg.barrier()?;
            }
            Ok(())
        });
    }
}

#[test]
fn run_threads_returns_every_ranks_result_in_rank_order() {
    let out = run_threads(3, |pg| Ok((pg.rank(), pg.world_size(), pg.world_info().rank))).unwrap();
    assert_eq!(out, vec![(0, 3, 0), (1, 3, 1), (2, 3, 2)]);
}
