//! Subgroups made with `new_group`: members in the order given, collectives on them.

use crate::common::*;

// ------------------------------------------------------------------ subgroups

#[test]
fn subgroups_follow_the_given_rank_order_and_run_collectives() {
    world(4, |pg| {
        let g = pg.rank();
        // Invalid subgroups are refused locally (nothing is exchanged, nothing desyncs).
        assert!(pg.new_group(&[1, 1]).is_err(), "duplicate ranks");
        assert!(pg.new_group(&[4]).is_err(), "rank out of range");
        assert!(pg.new_group(&[]).is_err(), "empty group");

        let a = pg.new_group(&[3, 1])?;
        let b = pg.new_group(&[0, 2])?;
        let single = pg.new_group(&[2])?;
        let (sub, members) = match g {
            3 | 1 => {
                assert!(b.is_none(), "rank {g} is not in [0, 2]");
                (a.expect("ranks 3 and 1 are in [3, 1]"), [3, 1])
            }
            _ => {
                assert!(a.is_none(), "rank {g} is not in [3, 1]");
                (b.expect("ranks 0 and 2 are in [0, 2]"), [0, 2])
            }
        };
        assert_eq!(sub.members(), &members[..]);
        assert_eq!(sub.world_size(), 2);
        assert_eq!(sub.shared_memory(), expect_shm(2), "subgroup {members:?}");
        let me = members.iter().position(|m| *m == g).unwrap();
        assert_eq!(sub.rank(), me, "global rank {g} in {members:?}");
        assert_eq!(single.is_some(), g == 2);

        for dtype in [DType::F32, DType::BF16, DType::I64] {
            for n in [7, LARGE] {
                let s = salt("subgroup", dtype, n);
                // Inputs are keyed by global rank.
                for kind in [Kind::General, Kind::Prod] {
                    let parts: Vec<Vec<f64>> = members.iter().map(|m| gen(dtype, kind, *m, s, 0..n)).collect();
                    let x = tensor(dtype, &parts[me], &[n]);
                    for op in OPS.into_iter().filter(|op| kind_for(*op) == kind) {
                        let y = sub.all_reduce(&x, op)?;
                        let what = format!("subgroup {members:?} all_reduce({op:?}) {dtype:?} n={n} on rank {g}");
                        check(&what, &y, dtype, &[n], exact_op(op, dtype), &fold(op, dtype, &parts));
                    }
                    if kind == Kind::General {
                        let y = sub.all_gather(&x)?;
                        check(
                            &format!("subgroup {members:?} all_gather on rank {g}"),
                            &y,
                            dtype,
                            &[2 * n],
                            true,
                            &parts.concat(),
                        );
                        for (root, want) in parts.iter().enumerate() {
                            let y = sub.broadcast(&x, root)?;
                            check(
                                &format!("subgroup {members:?} broadcast from {root} on rank {g}"),
                                &y,
                                dtype,
                                &[n],
                                true,
                                want,
                            );
                        }
                        let xs = tensor(dtype, &gen(dtype, kind, members[me], s, 0..2 * n), &[2, n]);
                        let mine: Vec<Vec<f64>> = members.iter().map(|m| gen(dtype, kind, *m, s, me * n..(me + 1) * n)).collect();
                        let y = sub.reduce_scatter(&xs, ReduceOp::Sum)?;
                        check(
                            &format!("subgroup {members:?} reduce_scatter on rank {g}"),
                            &y,
                            dtype,
                            &[1, n],
                            is_int(dtype),
                            &fold(ReduceOp::Sum, dtype, &mine),
                        );
                        // Point to point uses group ranks.
                        if me == 0 {
                            sub.send(&x, 1)?;
                        } else {
                            let y = sub.recv(&[n][..], dtype, &Device::Cpu, 0)?;
                            check(&format!("subgroup {members:?} recv on rank {g}"), &y, dtype, &[n], true, &parts[0]);
                        }
                    }
                }
            }
        }
        sub.barrier()?;
        if let Some(single) = single {
            assert_eq!((single.rank(), single.world_size(), single.members()), (0, 1, &[2][..]));
            let x = tensor(DType::F32, &[1.5, -2.0], &[2]);
            check("single-rank subgroup", &single.all_reduce(&x, ReduceOp::Sum)?, DType::F32, &[2], true, &[1.5, -2.0]);
        }
        // The world group still works, interleaved with the subgroup.
        let y = pg.all_reduce(&tensor(DType::F64, &[g as f64, 1.0], &[2]), ReduceOp::Sum)?;
        check(&format!("world all_reduce after subgroups on rank {g}"), &y, DType::F64, &[2], true, &[6.0, 4.0]);
        let y = sub.all_reduce(&tensor(DType::U32, &[g as f64], &[1]), ReduceOp::Max)?;
        check(
            &format!("subgroup all_reduce after world on rank {g}"),
            &y,
            DType::U32,
            &[1],
            true,
            &[members[0].max(members[1]) as f64],
        );
        Ok(())
    });
}
