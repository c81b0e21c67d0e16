//! Collectives whose data moves outside the TCP mesh (through NCCL) but whose calls are still
//! checked against each other over it: before the data moves, every rank sends its call's
//! header (operation, reduction, dtype, sequence number, shape digest) to every peer, so
//! ranks that issue different collectives fail with [`DistError::Mismatch`] naming both
//! calls instead of exchanging the wrong bytes or hanging. A failure of the data path
//! poisons the group and tells every peer, as the TCP path does. What the data path may use of
//! the group is an [`Elsewhere`] (`gpu/mod.rs`).

// Used by the NCCL backend (feature `nccl`); tested in every build.
#![cfg_attr(not(feature = "nccl"), allow(dead_code))]

use crate::cpu::call::Call;
use crate::cpu::mesh::{OpCode, NCCL_STEP};
#[allow(unused_imports)] // named in the rustdoc above
use crate::error::DistError;
use crate::error::DistResult;
use crate::gpu::Elsewhere;
use crate::reduce::{Elem, ReduceOp};
use crate::wire::digest;

use super::ProcessGroup;

impl ProcessGroup {
    /// Runs `f` as the next collective of this group, after exchanging its header (that of a
    /// call on elements of type `T`) with every peer over TCP. An error of `f` poisons the
    /// group and is sent to every peer.
    pub(crate) fn call_checked<T: Elem, R>(
        &self,
        op: OpCode,
        redop: Option<ReduceOp>,
        meta: &[u64],
        what: impl FnOnce() -> String,
        f: impl FnOnce(Elsewhere<'_>) -> DistResult<R>,
    ) -> DistResult<R> {
        let mut st = self.lock();
        st.mesh.check_usable()?;
        st.seq += 1;
        let what = what();
        let call = Call { op, redop, seq: st.seq, meta: digest(meta), what: &what };
        st.mesh.exchange_header(call.header::<T>(NCCL_STEP, 0), &what)?;
        let st = &mut *st;
        let place = Elsewhere {
            what: &what,
            group: &self.inner.name,
            rank: self.rank(),
            world_size: self.world_size(),
            store: self.inner.ctx.store.as_ref(),
            timeout: self.timeout(),
            mesh: &st.mesh,
            #[cfg(feature = "nccl")]
            nccl: &mut st.nccl,
        };
        f(place).map_err(|e| st.mesh.fail(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::DistError;
    use crate::threads::{run_threads, ThreadWorld};

    /// Runs one checked call per rank, `(op, redop, shape)` chosen by rank; returns each
    /// rank's outcome: the group rank seen by the data path, or the error message.
    fn checked(w: usize, call_of: impl Fn(usize) -> (OpCode, Option<ReduceOp>, Vec<u64>) + Sync) -> Vec<Result<usize, String>> {
        checked_in(ThreadWorld::new(w), call_of)
    }

    /// [`checked`] in the given world.
    fn checked_in(
        world: ThreadWorld,
        call_of: impl Fn(usize) -> (OpCode, Option<ReduceOp>, Vec<u64>) + Sync,
    ) -> Vec<Result<usize, String>> {
        world
            .run(|pg| {
                let (op, redop, meta) = call_of(pg.rank());
                let r = pg.call_checked::<f32, _>(op, redop, &meta, || format!("test call {op:?} {meta:?}"), |p| Ok(p.rank));
                Ok(r.map_err(|e| {
                    let msg = e.to_string();
                    assert!(
                        matches!(
                            e,
                            DistError::Mismatch { .. }
                                | DistError::Poisoned { .. }
                                | DistError::PeerAborted { .. }
                                | DistError::PeerClosed { .. }
                        ),
                        "{msg}"
                    );
                    msg
                }))
            })
            .unwrap()
    }

    #[test]
    fn matching_calls_reach_the_data_path_on_every_rank() {
        for w in [1, 2, 3] {
            let got = checked(w, |_| (OpCode::AllReduce, Some(ReduceOp::Sum), vec![4, 3]));
            assert_eq!(got, (0..w).map(Ok).collect::<Vec<_>>());
        }
    }

    #[test]
    fn different_collectives_fail_on_every_rank_naming_both_calls_before_the_data_path() {
        let got = checked(3, |r| {
            if r == 2 {
                (OpCode::AllGather, None, vec![4, 3])
            } else {
                (OpCode::AllReduce, Some(ReduceOp::Sum), vec![4, 3])
            }
        });
        for (r, g) in got.iter().enumerate() {
            let e = g.as_ref().expect_err("a mismatched call must not reach the data path");
            if r == 2 || e.contains("collective mismatch") {
                assert!(e.contains("all_gather") && e.contains("all_reduce(sum)") && e.contains("through NCCL"), "rank {r}: {e}");
            }
        }
        // Rank 2 talks to both others, so it sees a mismatch, not merely an abort.
        assert!(got[2].as_ref().unwrap_err().contains("collective mismatch"), "{:?}", got[2]);
    }

    #[test]
    fn through_the_tree_of_a_large_group_too_no_rank_reaches_the_data_path_on_a_mismatch() {
        // Tree from 2 ranks: the check of a large group, on 6 ranks.
        let tree = || ThreadWorld::new(6).tree_from(2);
        let got = checked_in(tree(), |_| (OpCode::AllReduce, Some(ReduceOp::Sum), vec![4, 3]));
        assert_eq!(got, (0..6).map(Ok).collect::<Vec<_>>());
        // Rank 3 (a leaf, under rank 2) and rank 4 (an inner node, parent of rank 5) differ in
        // turn.
        for odd in [3, 4] {
            let got = checked_in(tree(), |r| {
                if r == odd {
                    (OpCode::AllGather, None, vec![4, 3])
                } else {
                    (OpCode::AllReduce, Some(ReduceOp::Sum), vec![4, 3])
                }
            });
            for (r, g) in got.iter().enumerate() {
                let e = g.as_ref().expect_err("a mismatched call must not reach the data path");
                assert!(
                    e.contains("collective mismatch")
                        && e.contains("all_gather")
                        && e.contains("all_reduce(sum)")
                        && e.contains("through NCCL"),
                    "rank {r}: {e}"
                );
            }
        }
    }

    #[test]
    fn different_shapes_or_reductions_are_mismatches_too() {
        let got = checked(2, |r| (OpCode::AllReduce, Some(ReduceOp::Sum), vec![4, 3 + r as u64]));
        assert!(got.iter().all(|g| g.as_ref().is_err_and(|e| e.contains("shape digest"))), "{got:?}");
        let got = checked(2, |r| (OpCode::AllReduce, Some(if r == 0 { ReduceOp::Sum } else { ReduceOp::Max }), vec![4]));
        assert!(
            got.iter().all(|g| g.as_ref().is_err_and(|e| e.contains("all_reduce(max)") && e.contains("all_reduce(sum)"))),
            "{got:?}"
        );
    }

    #[test]
    fn a_failing_data_path_poisons_the_group_on_every_rank() {
        let got = run_threads(2, |pg| {
            let first = pg.call_checked::<f32, ()>(
                OpCode::Broadcast,
                None,
                &[1],
                || "broadcast".into(),
                |p| {
                    if p.rank == 1 {
                        Err(DistError::Invalid("the device failed".into()))
                    } else {
                        Ok(())
                    }
                },
            );
            // The next call fails on both ranks, naming rank 1's failure.
            let next = pg.barrier().unwrap_err().to_string();
            Ok((first.is_ok(), next))
        })
        .unwrap();
        assert!(got[0].0 && !got[1].0);
        for (ok, next) in &got {
            assert!(next.contains("the device failed"), "ok={ok}: {next}");
        }
    }
}
