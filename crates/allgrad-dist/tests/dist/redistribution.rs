//! Collectives that move blocks between ranks: all_gather, reduce_scatter and all_to_all
//! (equal and uneven sizes, rows with no elements) against serial references.

use crate::common::*;

// ------------------------------------------------------------------ all_gather

#[test]
fn all_gather_equal_and_uneven_sizes_match_serial_reference() {
    for w in 1..=4 {
        world(w, |pg| {
            let r = pg.rank();
            for dtype in DTYPES {
                // Equal sizes, 1-D: n elements per rank.
                for n in SIZES {
                    let s = salt("all_gather", dtype, n);
                    let parts: Vec<Vec<f64>> = (0..w).map(|q| gen(dtype, Kind::General, q, s, 0..n)).collect();
                    let y = pg.all_gather(&tensor(dtype, &parts[r], &[n]))?;
                    let what = format!("all_gather W={w} {dtype:?} n={n} on rank {r}");
                    check(&what, &y, dtype, &[w * n], true, &parts.concat());
                }
                // Uneven dim 0 with 3 columns; rank 1 contributes no rows.
                for base in ROW_SIZES {
                    let s = salt("all_gather_uneven", dtype, base);
                    let rows: Vec<usize> = (0..w).map(|q| uneven_rows(q, w, base)).collect();
                    let parts: Vec<Vec<f64>> = (0..w).map(|q| gen(dtype, Kind::General, q, s, 0..rows[q] * COLS)).collect();
                    let x = tensor(dtype, &parts[r], &[rows[r], COLS]);
                    let (y, sizes) = pg.all_gather_with_sizes(&x)?;
                    let what = format!("uneven all_gather W={w} {dtype:?} rows={rows:?} on rank {r}");
                    assert_eq!(sizes, rows, "{what}: sizes");
                    check(&what, &y, dtype, &[rows.iter().sum(), COLS], true, &parts.concat());
                }
            }
            Ok(())
        });
    }
}

#[test]
fn all_gather_of_rows_with_no_elements_reports_each_ranks_row_count() {
    // Shape [r + 1, 0]: the element counts are all zero, the row counts are not.
    for w in 1..=4 {
        world(w, |pg| {
            let r = pg.rank();
            let x = Tensor::zeros((r + 1, 0), DType::F32, &Device::Cpu)?;
            let (y, sizes) = pg.all_gather_with_sizes(&x)?;
            let want: Vec<usize> = (1..=w).collect();
            assert_eq!(sizes, want, "W={w} rank {r}: sizes");
            assert_eq!(y.dims(), &[want.iter().sum::<usize>(), 0], "W={w} rank {r}: shape");
            Ok(())
        });
    }
}

// ------------------------------------------------------------------ reduce_scatter

#[test]
fn reduce_scatter_even_and_uneven_match_serial_reference_for_every_op() {
    for w in 1..=4 {
        world(w, |pg| {
            let r = pg.rank();
            for dtype in DTYPES {
                for kind in [Kind::General, Kind::Prod] {
                    // Dim 0 = W: rank r gets the reduction of row r, n elements.
                    for n in SIZES {
                        let s = salt("reduce_scatter", dtype, n);
                        let x = tensor(dtype, &gen(dtype, kind, r, s, 0..w * n), &[w, n]);
                        // Only row r of every rank's input is needed for the reference.
                        let mine: Vec<Vec<f64>> = (0..w).map(|q| gen(dtype, kind, q, s, r * n..(r + 1) * n)).collect();
                        for op in OPS.into_iter().filter(|op| kind_for(*op) == kind) {
                            let y = pg.reduce_scatter(&x, op)?;
                            let what = format!("reduce_scatter({op:?}) W={w} {dtype:?} [{w}, {n}] on rank {r}");
                            check(&what, &y, dtype, &[1, n], exact_op(op, dtype), &fold(op, dtype, &mine));
                        }
                    }
                    // Uneven split of dim 0 (3 columns); rank 1 gets no rows.
                    for base in ROW_SIZES {
                        let s = salt("reduce_scatter_uneven", dtype, base);
                        let sizes: Vec<usize> = (0..w).map(|q| uneven_rows(q, w, base)).collect();
                        let total: usize = sizes.iter().sum();
                        let x = tensor(dtype, &gen(dtype, kind, r, s, 0..total * COLS), &[total, COLS]);
                        let off = offsets(&sizes)[r];
                        let range = off * COLS..(off + sizes[r]) * COLS;
                        let mine: Vec<Vec<f64>> = (0..w).map(|q| gen(dtype, kind, q, s, range.clone())).collect();
                        for op in OPS.into_iter().filter(|op| kind_for(*op) == kind) {
                            let y = pg.reduce_scatter_sizes(&x, op, &sizes)?;
                            let what = format!("reduce_scatter_sizes({op:?}) W={w} {dtype:?} {sizes:?} on rank {r}");
                            check(&what, &y, dtype, &[sizes[r], COLS], exact_op(op, dtype), &fold(op, dtype, &mine));
                        }
                    }
                }
            }
            Ok(())
        });
    }
}

// ------------------------------------------------------------------ all_to_all

#[test]
fn all_to_all_equal_and_uneven_splits_match_serial_reference() {
    for w in 1..=4 {
        world(w, |pg| {
            let r = pg.rank();
            for dtype in DTYPES {
                // Equal split: row j of [W, n] goes to rank j.
                for n in SIZES.into_iter().filter(|n| *n > 0) {
                    let s = salt("all_to_all", dtype, n);
                    let x = tensor(dtype, &gen(dtype, Kind::General, r, s, 0..w * n), &[w, n]);
                    let want: Vec<f64> = (0..w).flat_map(|q| gen(dtype, Kind::General, q, s, r * n..(r + 1) * n)).collect();
                    let y = pg.all_to_all(&x)?;
                    check(&format!("all_to_all W={w} {dtype:?} [{w}, {n}] on rank {r}"), &y, dtype, &[w, n], true, &want);
                }
                // Size 0 as an empty dim 0.
                let y = pg.all_to_all(&tensor(dtype, &[], &[0]))?;
                check(&format!("all_to_all W={w} {dtype:?} [0] on rank {r}"), &y, dtype, &[0], true, &[]);

                // Uneven splits (3 columns), with some empty blocks: rank q sends split(q, j)
                // rows to rank j.
                for base in ROW_SIZES {
                    let split = |q: usize, j: usize| if (q + j) % 3 == 1 { 0 } else { base + q + 2 * j };
                    let s = salt("all_to_all_sizes", dtype, base);
                    let send: Vec<usize> = (0..w).map(|j| split(r, j)).collect();
                    let rows: usize = send.iter().sum();
                    let x = tensor(dtype, &gen(dtype, Kind::General, r, s, 0..rows * COLS), &[rows, COLS]);
                    let (y, got) = pg.all_to_all_sizes(&x, &send)?;
                    let recv: Vec<usize> = (0..w).map(|q| split(q, r)).collect();
                    let mut want = Vec::new();
                    for (q, from_q) in recv.iter().enumerate() {
                        let sent_by_q: Vec<usize> = (0..w).map(|j| split(q, j)).collect();
                        let off = offsets(&sent_by_q)[r];
                        want.extend(gen(dtype, Kind::General, q, s, off * COLS..(off + from_q) * COLS));
                    }
                    let what = format!("all_to_all_sizes W={w} {dtype:?} send {send:?} on rank {r}");
                    assert_eq!(got, recv, "{what}: received sizes");
                    check(&what, &y, dtype, &[recv.iter().sum(), COLS], true, &want);
                }
            }
            Ok(())
        });
    }
}

#[test]

fn all_to_all_of_rows_with_no_elements_keeps_the_shape() {
    for w in 1..=4 {
        world(w, |pg| {
            let x = Tensor::zeros((w, 0), DType::F32, &Device::Cpu)?;
            let y = pg.all_to_all(&x)?;
            assert_eq!(y.dims(), &[w, 0]);
            let (y, got) = pg.all_to_all_sizes(&x, &vec![1; w])?;
            assert_eq!((y.dims(), got), (&[w, 0][..], vec![1; w]));
            Ok(())
        });
    }
}
