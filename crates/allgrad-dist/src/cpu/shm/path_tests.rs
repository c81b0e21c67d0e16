//! The shared-memory path from the inside: tiny slots, so that every collective runs in many
//! pieces and both slot sets; failures injected at a chosen barrier of one rank, which must
//! make every other rank fail promptly, naming it, whether the rank fails loudly (ABORT frames
//! and the abort word) or vanishes as a killed process would (connections closed, nothing
//! else), or stalls (the others time out, naming it); with a window of 2 connections per look,
//! a killed rank that no running rank's first look covers (the window must move for anyone to
//! see it); and the setup that declines shared memory when a member does not want it.

use std::time::{Duration, Instant};

use crate::cpu::mesh::PeerWatch;
use crate::cpu::segment::SLOT_ALIGN;
use crate::cpu::shm::ops::{Fault, FAULT};
use crate::cpu::shm::setup::ShmConfig;
use crate::group::ProcessGroup;
use crate::reduce::{Elem, ReduceOp};
use crate::settings::Settings;
use crate::threads::ThreadWorld;
use candle_core::WithDType;

const OPS: [ReduceOp; 5] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Prod, ReduceOp::Max, ReduceOp::Min];

/// Rank r's element i: small non-negative values, so every op is exact in every dtype.
fn val(r: usize, i: usize, op: ReduceOp) -> f64 {
    match op {
        ReduceOp::Prod => [1.0, 2.0, 1.0, 0.5][(i + r) % 4],
        _ => ((i * 7 + r * 3) % 9) as f64,
    }
}

fn input<T: Elem>(r: usize, n: usize, op: ReduceOp) -> Vec<T> {
    (0..n).map(|i| T::from_f64(val(r, i, op))).collect()
}

fn reduced(w: usize, i: usize, op: ReduceOp) -> f64 {
    let xs: Vec<f64> = (0..w).map(|r| val(r, i, op)).collect();
    match op {
        ReduceOp::Sum => xs.iter().sum(),
        ReduceOp::Avg => xs.iter().sum::<f64>() / w as f64,
        ReduceOp::Prod => xs.iter().product(),
        ReduceOp::Max => xs.iter().cloned().fold(f64::MIN, f64::max),
        ReduceOp::Min => xs.iter().cloned().fold(f64::MAX, f64::min),
    }
}

/// Runs every shared-memory collective of `T` on one group with `n` elements per rank and
/// checks the results exactly (integer averages truncate toward zero).
fn check_all<T: Elem>(pg: &ProcessGroup, n: usize, int: bool) -> candle_core::Result<()> {
    let (w, r) = (pg.world_size(), pg.rank());
    let want = |i: usize, op: ReduceOp| {
        let v = reduced(w, i, op);
        if int && op == ReduceOp::Avg {
            v.trunc()
        } else {
            v
        }
    };
    for op in OPS {
        if int && matches!(op, ReduceOp::Prod) {
            continue; // halves do not exist in integers
        }
        let mut buf = input::<T>(r, n, op);
        pg.all_reduce_slice(&mut buf, op)?;
        for (i, x) in buf.iter().enumerate() {
            assert_eq!(x.to_f64(), want(i, op), "all_reduce({op:?}) of {n} x {:?} on W={w}, element {i}", T::DTYPE);
        }
        // reduce_scatter with uneven blocks (rank 1 gets none).
        let counts: Vec<usize> = (0..w).map(|j| if j == 1 { 0 } else { n / 2 + j }).collect();
        let total: usize = counts.iter().sum();
        let x = input::<T>(r, total, op);
        let got = pg.reduce_scatter_slice(&x, op, &counts)?;
        let off: usize = counts[..r].iter().sum();
        for (i, g) in got.iter().enumerate() {
            assert_eq!(g.to_f64(), want(off + i, op), "reduce_scatter({op:?}) {counts:?} on rank {r}, element {i}");
        }
    }
    // all_gather, equal and uneven.
    let own = input::<T>(r, n, ReduceOp::Sum);
    let all = pg.all_gather_slice(&own)?;
    for j in 0..w {
        assert!(all[j * n..(j + 1) * n].iter().zip(input::<T>(j, n, ReduceOp::Sum)).all(|(a, b)| a.to_f64() == b.to_f64()));
    }
    let mine = input::<T>(r, n / (r + 1), ReduceOp::Sum);
    let (all, counts) = pg.all_gather_v_slice(&mine, &[])?;
    let want: Vec<f64> = (0..w).flat_map(|j| input::<T>(j, n / (j + 1), ReduceOp::Sum)).map(|x| x.to_f64()).collect();
    assert_eq!(counts, (0..w).map(|j| n / (j + 1)).collect::<Vec<_>>());
    assert_eq!(all.iter().map(|x| x.to_f64()).collect::<Vec<_>>(), want, "uneven all_gather on rank {r}");
    Ok(())
}

#[test]
fn many_pieces_in_tiny_slots_give_exact_results() {
    for w in 2..=4 {
        ThreadWorld::new(w)
            .shm(true)
            .timeout(Duration::from_secs(30))
            .shm_slot_bytes(SLOT_ALIGN)
            .run(|pg| {
                assert!(pg.shared_memory(), "W={w}: no shared memory");
                // Odd sizes, from just over the threshold (one 64 KiB u8 message is 16 pieces).
                for n in [(64 << 10) + 1, 100_003] {
                    check_all::<f32>(&pg, n / 4, false)?;
                    check_all::<half::bf16>(&pg, n / 2, false)?;
                    check_all::<u8>(&pg, n, true)?;
                    check_all::<i64>(&pg, n / 8 + 5, true)?;
                }
                Ok(())
            })
            .unwrap_or_else(|e| panic!("W={w}: {e}"));
    }
}

#[test]
fn collectives_across_the_threshold_and_groups_interleave() {
    // Calls on and off the fast path, on the world and on a subgroup, one after another: the
    // slot sets and barrier counts stay in step.
    ThreadWorld::new(4)
        .shm(true)
        .timeout(Duration::from_secs(30))
        .shm_slot_bytes(2 * SLOT_ALIGN)
        .run(|pg| {
            let sub = pg.new_group(&[3, 0, 2])?;
            for round in 0..3 {
                for n in [5, 16 << 10, 70_001] {
                    check_all::<f64>(&pg, n + round, false)?;
                    if let Some(sub) = &sub {
                        assert!(sub.shared_memory());
                        check_all::<u32>(sub, n + 2 * round, true)?;
                    }
                }
            }
            Ok(())
        })
        .unwrap();
}

/// A `w`-rank world in which rank `bad` meets `fault` at its shared-memory barrier number
/// `at` (counting from 0) of an all_reduce (`which` = 0), all_gather (1) or reduce_scatter
/// (2) in many pieces. Returns every other rank's error and how long the world took.
fn survivors_errors(w: usize, bad: usize, at: u32, fault: Fault, which: usize, timeout: Duration) -> (Vec<String>, Duration) {
    let start = Instant::now();
    let n = 200_000;
    let out = ThreadWorld::new(w)
        .shm(true)
        .timeout(timeout)
        .shm_slot_bytes(SLOT_ALIGN)
        .run(|pg| {
            assert!(pg.shared_memory());
            // A first call that completes, so that the fault lands mid-way through the job.
            let mut x = input::<f32>(pg.rank(), n, ReduceOp::Sum);
            pg.all_reduce_slice(&mut x, ReduceOp::Sum)?;
            if pg.rank() == bad {
                FAULT.set(Some((at, fault)));
            }
            let res = match which {
                0 => pg.all_reduce_slice(&mut x, ReduceOp::Max),
                1 => pg.all_gather_slice(&x).map(|_| ()),
                _ => pg
                    .reduce_scatter_slice(
                        &x,
                        ReduceOp::Sum,
                        &vec![n / w; w - 1].into_iter().chain([n - n / w * (w - 1)]).collect::<Vec<_>>(),
                    )
                    .map(|_| ()),
            };
            FAULT.set(None);
            Ok(res.err().map(|e| e.to_string()))
        })
        .unwrap_or_else(|e| panic!("W={w}: {e}"));
    let errs = out
        .into_iter()
        .enumerate()
        .filter(|(r, _)| *r != bad)
        .map(|(r, e)| e.unwrap_or_else(|| panic!("W={w}: rank {r}'s call succeeded although rank {bad} {fault:?}ed")))
        .collect();
    (errs, start.elapsed())
}

fn names_rank(msg: &str, r: usize) -> bool {
    let needle = format!("rank {r}");
    msg.match_indices(&needle).any(|(i, _)| !msg[i + needle.len()..].starts_with(|c: char| c.is_ascii_digit()))
}

#[test]
fn a_rank_killed_mid_collective_is_named_by_every_other_rank_within_seconds() {
    for w in 2..=4 {
        for (k, bad) in [0, w - 1].into_iter().enumerate() {
            for at in [0, 3] {
                let which = (w + k + at as usize) % 3;
                let (errs, took) = survivors_errors(w, bad, at, Fault::Kill, which, Duration::from_secs(60));
                let case = format!("W={w}, rank {bad} killed at barrier {at} of collective {which}");
                assert!(took < Duration::from_secs(5), "{case}: took {took:?}");
                for e in errs {
                    assert!(names_rank(&e, bad) && e.contains("closed"), "{case}: {e}");
                }
            }
        }
    }
}

#[test]
fn a_rank_failing_mid_collective_is_named_with_its_reason_by_every_other_rank() {
    for w in 2..=4 {
        for (k, bad) in [w - 1, 0].into_iter().enumerate() {
            for at in [0, 5] {
                let which = (w + k + at as usize) % 3;
                let (errs, took) = survivors_errors(w, bad, at, Fault::Abort, which, Duration::from_secs(60));
                let case = format!("W={w}, rank {bad} failing at barrier {at} of collective {which}");
                assert!(took < Duration::from_secs(5), "{case}: took {took:?}");
                for e in errs {
                    assert!(names_rank(&e, bad) && e.contains("failure injected by a test"), "{case}: {e}");
                }
            }
        }
    }
}

#[test]
fn with_a_window_of_two_a_killed_rank_is_found_by_ranks_whose_window_had_to_move() {
    // W = 8, two connections per look. Rank 7 vanishes as a killed process would at a
    // shared-memory barrier of an all_reduce. The only survivors whose first look covers it
    // (by the rule the waiters use) pause for PAUSE before they arrive, so they look at
    // nothing meanwhile: the others must see rank 7 gone on a later look of their own (or from
    // the abort word of one that did) long before the paused ones arrive, and every survivor
    // must name it. With the window stuck at the first look, nobody sees it before PAUSE.
    const W: usize = 8;
    const WINDOW: usize = 2;
    const DEAD: usize = 7;
    const AT: u32 = 2;
    const PAUSE: Duration = Duration::from_secs(2);
    let first_look_covers_dead = |r: usize| PeerWatch::new(r, WINDOW, W).covers(0).any(|p| p == DEAD);
    let paused: Vec<usize> = (0..W).filter(|&r| r != DEAD && first_look_covers_dead(r)).collect();
    assert_eq!(paused, [5, 6]);
    // Every survivor's looks cover every peer within W / WINDOW looks.
    for r in (0..W).filter(|&r| r != DEAD) {
        let w = PeerWatch::new(r, WINDOW, W);
        let mut seen: Vec<usize> = (0..W / WINDOW).flat_map(|k| w.covers(k)).collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..W).collect::<Vec<_>>(), "rank {r}");
    }
    let n = 200_000;
    let out = ThreadWorld::new(W)
        .shm(true)
        .timeout(Duration::from_secs(60))
        .shm_slot_bytes(SLOT_ALIGN)
        .peer_window(WINDOW)
        .run(|pg| {
            let r = pg.rank();
            assert!(pg.shared_memory());
            assert_eq!(pg.peer_window(), WINDOW);
            // A first call that completes, so that the fault lands mid-way through the job.
            let mut x = input::<f32>(r, n, ReduceOp::Sum);
            pg.all_reduce_slice(&mut x, ReduceOp::Sum)?;
            if r == DEAD {
                FAULT.set(Some((AT, Fault::Kill)));
            } else if paused.contains(&r) {
                FAULT.set(Some((AT, Fault::Pause(PAUSE))));
            }
            let start = Instant::now();
            let res = pg.all_reduce_slice(&mut x, ReduceOp::Max);
            FAULT.set(None);
            Ok((res.err().map(|e| e.to_string()), start.elapsed()))
        })
        .unwrap_or_else(|e| panic!("{e}"));
    for (r, (err, took)) in out.into_iter().enumerate().filter(|(r, _)| *r != DEAD) {
        let e = err.unwrap_or_else(|| panic!("rank {r}'s all_reduce succeeded although rank {DEAD} was killed"));
        assert!(names_rank(&e, DEAD), "rank {r}'s error does not name rank {DEAD}: {e}");
        if paused.contains(&r) {
            assert!(took >= PAUSE && took < PAUSE + Duration::from_secs(5), "paused rank {r} took {took:?}: {e}");
        } else {
            assert!(took < PAUSE / 2, "rank {r} took {took:?} to fail (its first look does not cover rank {DEAD}): {e}");
        }
    }
}

#[test]
fn a_stalled_rank_makes_the_others_time_out_naming_it() {
    let (errs, took) = survivors_errors(3, 1, 2, Fault::Stall, 0, Duration::from_secs(1));
    assert!(took < Duration::from_secs(8), "took {took:?}");
    for e in errs {
        // The first to time out names rank 1; the other may learn of it from that rank's abort.
        assert!(e.contains("waiting for rank(s) [1]") && e.contains("timed out") && e.contains("shared-memory barrier"), "{e}");
    }
}

#[test]
fn a_member_that_declines_keeps_the_whole_group_on_tcp() {
    // Rank 1 runs with shared memory off (as with ALLGRAD_SHM=0 in its environment).
    let out = ThreadWorld::new(3)
        .shm(true)
        .run(|pg| {
            let sub = pg.new_group(&[0, 2])?.map(|g| g.shared_memory());
            let mut x = input::<f32>(pg.rank(), 100_000, ReduceOp::Sum);
            pg.all_reduce_slice(&mut x, ReduceOp::Sum)?;
            assert!(x.iter().enumerate().all(|(i, v)| v.to_f64() == reduced(3, i, ReduceOp::Sum)));
            Ok((pg.shared_memory(), sub))
        })
        .unwrap();
    assert!(out.iter().all(|(world, _)| *world), "{out:?}");
    let declined = ThreadWorld::new(3).shm(true).declining_rank_for_test(1).run(|pg| {
        let mut x = input::<f32>(pg.rank(), 100_000, ReduceOp::Sum);
        pg.all_reduce_slice(&mut x, ReduceOp::Sum)?;
        assert!(x.iter().enumerate().all(|(i, v)| v.to_f64() == reduced(3, i, ReduceOp::Sum)));
        let sub = pg.new_group(&[0, 2])?.map(|g| g.shared_memory());
        Ok((pg.shared_memory(), sub))
    });
    let declined = declined.unwrap();
    assert!(declined.iter().all(|(world, _)| !*world), "{declined:?}");
    // The subgroup of ranks 0 and 2 both want it.
    assert_eq!((declined[0].1, declined[2].1), (Some(true), Some(true)));
}

#[test]
fn allgrad_shm_variables_are_parsed() {
    let cfg = |shm: Option<&str>, slot: Option<&str>| {
        let vars = [("ALLGRAD_SHM", shm), ("ALLGRAD_SHM_SLOT_BYTES", slot)];
        let vars = vars.iter().filter_map(|(k, v)| v.map(|v| (k.to_string(), v.to_string()))).collect();
        Settings::from_vars(&vars).map(|s| ShmConfig::from(&s))
    };
    assert_eq!(cfg(None, None).unwrap(), ShmConfig::default());
    assert!(cfg(Some("1"), None).unwrap().enabled);
    assert!(!cfg(Some("0"), None).unwrap().enabled);
    assert!(!cfg(Some(" 0 "), None).unwrap().enabled);
    assert_eq!(cfg(None, Some("65536")).unwrap().slot_bytes, 65536);
    for (shm, slot) in [(Some("yes"), None), (None, Some("12")), (None, Some("1M"))] {
        let e = cfg(shm, slot).unwrap_err().to_string();
        assert!(e.contains("ALLGRAD_SHM"), "{e}");
    }
}
