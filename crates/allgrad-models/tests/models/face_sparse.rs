//! The face head's row-sparse centre gradient (`head.update: sparse`) against its dense one
//! (`head.update: dense`, whose values `face_head.rs` checks against plain f64 and finite
//! differences): on W = 1, 2, 3, 4 thread-ranks with an uneven class split and different
//! data per rank, ArcFace and CosFace, Partial FC at 0.3 and 0.1, the sparse gradient's rows
//! are the dense gradient's non-zero rows, bit for bit, and the dense gradient is exactly zero
//! in every other row; the centres themselves get no gradient; the rows announced before the
//! loss (`rows_to_read`) are the rows read; the loss and the embeddings' gradient are the
//! same bit for bit. Bad labels are refused with the key.

use allgrad_dist::{run_threads, ProcessGroup};
use allgrad_models::face::{CentreUpdate, FaceHead, HeadConfig, MarginConfig, RowRange};
use candle_core::{DType, Device, Tensor};

use crate::support;
use crate::support::face::{grad_or_zeros, rank_batch};

const B: usize = 9; // global batch: uneven over 2 and 4 ranks
const DIM: usize = 6;
const C: usize = 50; // classes: uneven over 3 and 4 ranks
const SEED: u64 = 4;
const STEP: usize = 3;

fn labels() -> Vec<usize> {
    vec![7, 0, 49, 7, 23, 31, 12, 40, 23]
}

/// Embeddings with rows of different scales.
fn embeddings() -> Vec<f64> {
    (0..B * DIM).map(|k| ((k * 29 % 31) as f64 - 15.0) / 9.0 * (1.0 + (k / DIM) as f64 * 0.2)).collect()
}

fn config(margin: MarginConfig, rate: f64, update: CentreUpdate) -> HeadConfig {
    support::face::config(C, margin, rate, update)
}

/// The head for `rank` of `world` and its centres (`[c_r, DIM]`).
fn head(cfg: &HeadConfig, rank: usize, world: usize) -> candle_core::Result<(FaceHead, candle_core::Var)> {
    support::face::head(cfg, DIM, SEED, rank, world)
}

/// What one rank computes: its loss, its embeddings' gradient, its centres' dense gradient
/// (zeros where the backward formed none), and the sparse rows with their gradient.
struct RankOut {
    loss: u64,
    emb_grad: Vec<u64>,
    dense: Vec<f64>,
    planned: Option<Vec<u32>>,
    sparse: Option<(Vec<u32>, Vec<f64>)>,
}

fn rank_run(cfg: &HeadConfig, pg: &ProcessGroup) -> candle_core::Result<RankOut> {
    let (rank, w) = (pg.rank(), pg.world_size());
    let (mut h, centres) = head(cfg, rank, w)?;
    let (x, ls) = rank_batch(&embeddings(), &labels(), DIM, RowRange::split(B, rank, w))?;
    let planned = h.rows_to_read(&ls, SEED, STEP, pg)?;
    let loss = h.loss(x.as_tensor(), &ls, SEED, STEP, pg)?;
    let g = (&loss / w as f64)?.backward()?;
    let f64s = |t: &Tensor| t.flatten_all()?.to_vec1::<f64>();
    let dense = grad_or_zeros(&g, &centres)?;
    let sparse = match h.sparse_rows() {
        None => None,
        Some(sp) => {
            let values = match &sp.leaf {
                Some(l) => f64s(g.get(l).expect("the leaf has a gradient"))?,
                None => Vec::new(),
            };
            Some((sp.rows, values))
        }
    };
    Ok(RankOut {
        loss: loss.to_scalar::<f64>()?.to_bits(),
        emb_grad: f64s(g.get(&x).expect("the embeddings have a gradient"))?.into_iter().map(f64::to_bits).collect(),
        dense,
        planned,
        sparse,
    })
}

fn check(margin: MarginConfig, rate: f64) {
    let mut informative = false;
    for w in [1, 2, 3, 4] {
        let dense = run_threads(w, |pg| rank_run(&config(margin.clone(), rate, CentreUpdate::Dense), &pg)).unwrap();
        let sparse = run_threads(w, |pg| rank_run(&config(margin.clone(), rate, CentreUpdate::Sparse), &pg)).unwrap();
        for (r, (d, s)) in dense.iter().zip(&sparse).enumerate() {
            let what = format!("{margin:?} rate {rate} W={w} rank {r}");
            assert_eq!(s.loss, d.loss, "{what}: loss");
            assert_eq!(s.emb_grad, d.emb_grad, "{what}: embedding gradient");
            assert!(d.sparse.is_none() && d.planned.is_none(), "{what}: the dense head reports sparse rows");
            assert!(s.dense.iter().all(|v| *v == 0.0), "{what}: the centres got a dense gradient in the sparse mode");
            let (rows, values) = s.sparse.clone().expect("the sparse head reports its rows");
            assert_eq!(s.planned.as_ref(), Some(&rows), "{what}: rows_to_read announced other rows than the loss read");
            assert_eq!(values.len(), rows.len() * DIM, "{what}");
            for local in 0..d.dense.len() / DIM {
                let row = &d.dense[local * DIM..(local + 1) * DIM];
                match rows.binary_search(&(local as u32)) {
                    Ok(i) => {
                        let got: Vec<u64> = values[i * DIM..(i + 1) * DIM].iter().map(|v| v.to_bits()).collect();
                        let want: Vec<u64> = row.iter().map(|v| v.to_bits()).collect();
                        assert_eq!(got, want, "{what}: gradient of sampled row {local}");
                        informative |= row.iter().any(|v| *v != 0.0);
                    }
                    Err(_) => assert!(row.iter().all(|v| *v == 0.0), "{what}: row {local} was not sampled but has a gradient"),
                }
            }
            let local = d.dense.len() / DIM;
            assert!(rows.len() < local || rate == 1.0, "{what}: every row sampled ({local}): nothing left out");
        }
    }
    assert!(informative, "{margin:?} rate {rate}: every sampled row's gradient is zero");
}

#[test]
fn sparse_centre_gradients_are_the_dense_gradients_rows_bitwise_on_1_to_4_ranks() {
    check(MarginConfig::Arcface { m: 0.5, s: 16.0 }, 0.3);
    check(MarginConfig::Arcface { m: 0.5, s: 64.0 }, 0.1);
    check(MarginConfig::Cosface { m: 0.4, s: 64.0 }, 0.1);
}

#[test]
fn without_sampling_the_gradient_stays_dense_and_no_rows_are_announced() {
    let out = run_threads(2, |pg| rank_run(&config(MarginConfig::default(), 1.0, CentreUpdate::Sparse), &pg)).unwrap();
    for o in out {
        assert!(o.sparse.is_none() && o.planned.is_none());
        assert!(o.dense.iter().any(|v| *v != 0.0), "no dense gradient without sampling");
    }
}

#[test]
fn a_label_out_of_range_is_refused_naming_head_num_classes() {
    for update in [CentreUpdate::Sparse, CentreUpdate::Dense] {
        let err = run_threads(1, |pg| {
            let (mut h, _) = head(&config(MarginConfig::default(), 0.5, update), 0, 1)?;
            let x = Tensor::ones((2, DIM), DType::F64, &Device::Cpu)?;
            h.rows_to_read(&[3, C], SEED, 0, &pg)?;
            h.loss(&x, &[3, C], SEED, 0, &pg)
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains("label 50") && err.contains("head.num_classes = 50"), "{update:?}: {err}");
    }
}
