//! Failures: a departed peer and mismatched collectives fail every rank quickly, naming the
//! culprit (and both calls), on the TCP and shared-memory paths.
//!
//! The ranks here are threads, so a "departed" peer is one that returns from its rank
//! function at once, dropping its group (its sockets close, as a finished process's would).
//! Peers that are really killed (SIGKILL of a rank process, mid-collective, on the
//! shared-memory, TCP ring and TCP direct paths) are in `shm_processes.rs`, and through the
//! launcher in the repository's `tests/repo/launch.rs` and `tests/repo/two_hosts.rs`.

use crate::common::*;

// ------------------------------------------------------------------ failures

/// Whether `msg` names rank `r` ("rank 2", not "rank 21").
fn names_rank(msg: &str, r: usize) -> bool {
    let needle = format!("rank {r}");
    msg.match_indices(&needle).any(|(i, _)| !msg[i + needle.len()..].starts_with(|c: char| c.is_ascii_digit()))
}

/// Rank `dead` of a `w`-rank world returns at once (dropping its group, so its sockets close
/// as a killed process's would) while the others run an all_reduce of `n` f32, with shared
/// memory on or off. Returns the error of `run_threads` and the time it took.
fn run_with_departed_rank(w: usize, dead: usize, n: usize, shm: bool) -> (String, Duration) {
    let start = Instant::now();
    let res = ThreadWorld::new(w).timeout(Duration::from_secs(30)).shm(shm).run(|pg| {
        if pg.rank() == dead {
            return Ok(());
        }
        let x = tensor(DType::F32, &gen(DType::F32, Kind::General, pg.rank(), 7, 0..n), &[n]);
        pg.all_reduce(&x, ReduceOp::Sum)?;
        Ok(())
    });
    let elapsed = start.elapsed();
    match res {
        Ok(_) => panic!("W={w}: all_reduce succeeded although rank {dead} was gone"),
        Err(e) => (e.to_string(), elapsed),
    }
}

/// Like [`run_with_departed_rank`], but every survivor returns its own error text.
fn survivors_errors_with_departed_rank(w: usize, dead: usize, n: usize, shm: bool) -> Vec<(usize, String)> {
    let out = world_with(w, shm, |pg| {
        let r = pg.rank();
        if r == dead {
            return Ok(None);
        }
        let x = tensor(DType::F32, &gen(DType::F32, Kind::General, r, 7, 0..n), &[n]);
        Ok(Some(match pg.all_reduce(&x, ReduceOp::Sum) {
            Ok(_) => "all_reduce succeeded".to_string(),
            Err(e) => e.to_string(),
        }))
    });
    out.into_iter().enumerate().filter_map(|(r, e)| e.map(|e| (r, e))).collect()
}

fn assert_departed_rank_is_reported(w: usize, dead: usize, n: usize, shm: bool) {
    let (err, elapsed) = run_with_departed_rank(w, dead, n, shm);
    assert!(elapsed < Duration::from_secs(10), "W={w}, rank {dead} gone, n={n}: took {elapsed:?}: {err}");
    assert!(names_rank(&err, dead), "W={w}, n={n}: the error does not name rank {dead}: {err}");

    let start = Instant::now();
    for (r, err) in survivors_errors_with_departed_rank(w, dead, n, shm) {
        assert!(names_rank(&err, dead), "W={w}, n={n}: rank {r}'s error does not name rank {dead}: {err}");
    }
    assert!(start.elapsed() < Duration::from_secs(10), "W={w}, n={n}: survivors took {:?}", start.elapsed());
}

#[test]
fn departed_peer_fails_all_reduce_naming_it_within_10s_w3() {
    assert_departed_rank_is_reported(3, 2, 4, true);
    assert_departed_rank_is_reported(3, 0, 4, true);
}

#[test]
fn departed_peer_fails_all_reduce_naming_it_within_10s_w2() {
    assert_departed_rank_is_reported(2, 1, 4, true);
    // Ring path and shared memory (with one peer there is no one else to blame).
    assert_departed_rank_is_reported(2, 0, LARGE, false);
    assert_departed_rank_is_reported(2, 0, LARGE, true);
}

#[test]
fn departed_peer_fails_all_reduce_naming_it_at_w4_direct_path() {
    assert_departed_rank_is_reported(4, 2, 4, true);
}

#[test]
fn departed_peer_fails_shared_memory_all_reduce_naming_it_on_every_rank() {
    // Large calls of thread ranks go through shared memory; a rank process killed in the middle of
    // one is tested in the crate's own tests (src/cpu/shm/path_tests.rs) and with processes
    // (shm_processes.rs).
    if !shm_available() {
        return allgrad_testkit::skip(allgrad_testkit::Need::DevShm, "no /dev/shm: there is no shared-memory path to fail");
    }
    for w in [3, 4] {
        for dead in [0, 2] {
            assert_departed_rank_is_reported(w, dead, LARGE, true);
        }
    }
}

#[test]
fn departed_peer_fails_ring_all_reduce_on_every_rank_within_10s() {
    // Ring path (shared memory off), rank 2 gone. At W = 3 it is a neighbour of both survivors;
    // at W = 4 it is not a ring neighbour of rank 0, which can only learn of the failure
    // through ranks 1 and 3. Every survivor must fail, promptly.
    for w in [3, 4] {
        for _ in 0..3 {
            let (err, elapsed) = run_with_departed_rank(w, 2, LARGE, false);
            assert!(elapsed < Duration::from_secs(10), "W={w}: took {elapsed:?}: {err}");
            let start = Instant::now();
            let errs = survivors_errors_with_departed_rank(w, 2, LARGE, false);
            assert!(start.elapsed() < Duration::from_secs(10), "W={w}: survivors took {:?}", start.elapsed());
            assert_eq!(errs.len(), w - 1);
            for (r, e) in errs {
                assert!(e != "all_reduce succeeded", "W={w}: rank {r}'s all_reduce succeeded although rank 2 was gone");
            }
        }
    }
}

#[test]
fn departed_peer_on_ring_path_is_named_by_every_rank() {
    // As above, and every error (run_threads' and each survivor's) must name rank 2.
    // Repeated, since the outcome depends on timing (about half the runs fail).
    for _ in 0..5 {
        assert_departed_rank_is_reported(3, 2, LARGE, false);
        assert_departed_rank_is_reported(4, 2, LARGE, false);
    }
}

const MISMATCH_TIMEOUT: Duration = Duration::from_secs(10);

#[test]
fn mismatched_collectives_fail_on_every_rank_naming_both_calls() {
    for w in 2..=4 {
        // Propagated: run_threads reports the mismatch.
        let start = Instant::now();
        let res = ThreadWorld::new(w).timeout(MISMATCH_TIMEOUT).run(|pg| {
            let x = tensor(DType::F32, &[pg.rank() as f64, 1.0, 2.0, 3.0], &[4]);
            if pg.rank() == 1 {
                pg.all_gather(&x)?;
            } else {
                pg.all_reduce(&x, ReduceOp::Sum)?;
            }
            Ok(())
        });
        let err = res.err().unwrap_or_else(|| panic!("W={w}: mismatched collectives succeeded")).to_string();
        assert!(start.elapsed() < MISMATCH_TIMEOUT, "W={w}: took {:?}: {err}", start.elapsed());
        assert!(err.contains("all_reduce") && err.contains("all_gather"), "W={w}: {err}");

        // Every rank gets an error naming both calls.
        let errs = ThreadWorld::new(w)
            .timeout(MISMATCH_TIMEOUT)
            .run(|pg| {
                let x = tensor(DType::F32, &[pg.rank() as f64, 1.0, 2.0, 3.0], &[4]);
                let res = if pg.rank() == 1 { pg.all_gather(&x) } else { pg.all_reduce(&x, ReduceOp::Sum) };
                Ok(res.err().map(|e| e.to_string()))
            })
            .unwrap_or_else(|e| panic!("W={w}: {e}"));
        for (r, e) in errs.iter().enumerate() {
            let e = e.as_deref().unwrap_or_else(|| panic!("W={w}: rank {r}'s call succeeded"));
            assert!(e.contains("all_reduce") && e.contains("all_gather"), "W={w}: rank {r}: {e}");
        }
    }
}

#[test]
fn mismatched_large_collectives_fail_on_every_rank_naming_both_calls() {
    // Large calls go through shared memory (forced on here), which starts with an exchange of
    // call headers over TCP: (rank 1's call, the others' call), both large, or one large and one
    // small (shared memory against the TCP direct path).
    let cases: [(&str, usize, &str, usize); 4] = [
        ("all_gather", LARGE, "all_reduce", LARGE),
        ("reduce_scatter", LARGE, "all_reduce", LARGE),
        ("all_reduce", 4, "all_reduce", LARGE),
        ("all_gather", LARGE, "all_reduce", 4),
    ];
    for (odd, odd_n, common, n) in cases {
        for w in [2, 3] {
            let case = format!("W={w}: rank 1 {odd} of {odd_n}, others {common} of {n}");
            let start = Instant::now();
            let errs = ThreadWorld::new(w)
                .timeout(MISMATCH_TIMEOUT)
                .shm(true)
                .run(|pg| {
                    let (op, n) = if pg.rank() == 1 { (odd, odd_n) } else { (common, n) };
                    let x = tensor(DType::F32, &vec![1.0; n * w], &[w, n]);
                    let res = match op {
                        "all_gather" => pg.all_gather(&x),
                        "reduce_scatter" => pg.reduce_scatter(&x, ReduceOp::Sum),
                        _ => pg.all_reduce(&x, ReduceOp::Sum),
                    };
                    Ok(res.err().map(|e| e.to_string()))
                })
                .unwrap_or_else(|e| panic!("{case}: {e}"));
            assert!(start.elapsed() < MISMATCH_TIMEOUT, "{case}: took {:?}", start.elapsed());
            for (r, e) in errs.iter().enumerate() {
                let e = e.as_deref().unwrap_or_else(|| panic!("{case}: rank {r}'s call succeeded"));
                assert!(e.contains("mismatch") && e.contains(odd) && e.contains(common), "{case}: rank {r}: {e}");
                let named = if r == 1 { (0..w).any(|p| p != 1 && names_rank(e, p)) } else { names_rank(e, 1) };
                assert!(named, "{case}: rank {r}'s error does not name the other side: {e}");
            }
        }
    }
}

#[test]
fn mismatched_shapes_or_dtypes_of_the_same_collective_fail_on_every_rank() {
    // (rank 1's tensor, the others' tensor): same byte count but another shape, another
    // length, another dtype of the same size in bytes.
    let cases: [(DType, &[usize], DType, &[usize]); 3] =
        [(DType::F32, &[2, 2], DType::F32, &[4]), (DType::F32, &[5], DType::F32, &[4]), (DType::U32, &[4], DType::F32, &[4])];
    for (odd_dtype, odd_shape, dtype, shape) in cases {
        for w in [2, 3] {
            let start = Instant::now();
            let errs = ThreadWorld::new(w)
                .timeout(MISMATCH_TIMEOUT)
                .run(|pg| {
                    let (d, s) = if pg.rank() == 1 { (odd_dtype, odd_shape) } else { (dtype, shape) };
                    let n: usize = s.iter().product();
                    let x = tensor(d, &vec![1.0; n], s);
                    Ok(pg.all_reduce(&x, ReduceOp::Sum).err().map(|e| e.to_string()))
                })
                .unwrap_or_else(|e| panic!("W={w}: {e}"));
            let case = format!("W={w}: rank 1 {odd_dtype:?} {odd_shape:?}, others {dtype:?} {shape:?}");
            assert!(start.elapsed() < MISMATCH_TIMEOUT, "{case}: took {:?}", start.elapsed());
            for (r, e) in errs.iter().enumerate() {
                let e = e.as_deref().unwrap_or_else(|| panic!("{case}: rank {r}'s all_reduce succeeded"));
                assert!(e.contains("mismatch") && e.contains("all_reduce"), "{case}: rank {r}: {e}");
                // Rank 1 names one of the others; the others name rank 1.
                let named = if r == 1 { (0..w).any(|p| p != 1 && names_rank(e, p)) } else { names_rank(e, 1) };
                assert!(named, "{case}: rank {r}'s error does not name the other side: {e}");
            }
        }
    }
}
