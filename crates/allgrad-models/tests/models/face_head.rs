//! The class-sharded face head against an independent plain f64 computation (loss, and
//! gradients by central finite differences), on W = 1, 2, 3, 4 thread-ranks with an uneven
//! class split and different data on every rank; Partial FC sampling; the world-size
//! invariance check; insightface's `* world_size` rule against ours.

use allgrad_dist::testing::check_world_size_invariance;
use allgrad_dist::{all_gather, run_threads, ProcessGroup, ReduceOp};
use allgrad_models::face::{CentreUpdate, FaceHead, HeadConfig, Margin, MarginConfig, RowRange};
use candle_core::{Device, Tensor, Var, D};

use crate::support;
use crate::support::face::{grad_or_zeros, rank_batch, rows_of};

const B: usize = 7; // global batch: 2+2+2+1 on 4 ranks, 3+2+2 on 3
const DIM: usize = 5;
const C: usize = 10; // classes: uneven over 3 and 4 ranks
const SEED: u64 = 3;
const STEP: usize = 2;

fn labels() -> Vec<usize> {
    vec![4, 0, 9, 4, 7, 2, 5]
}

/// Embeddings with rows of different scales (asymmetric per rank).
fn embeddings() -> Vec<f64> {
    (0..B * DIM).map(|k| ((k * 37 % 23) as f64 - 11.0) / 7.0 * (1.0 + (k / DIM) as f64 * 0.3)).collect()
}

fn config(margin: MarginConfig, rate: f64) -> HeadConfig {
    // The dense gradient: these tests read the centres' gradient from the backward's store.
    support::face::config(C, margin, rate, CentreUpdate::Dense)
}

/// The head for `rank` of `world` and its centres (`[c_r, D]`).
fn head(cfg: &HeadConfig, rank: usize, world: usize) -> candle_core::Result<(FaceHead, Var)> {
    support::face::head(cfg, DIM, SEED, rank, world)
}

/// All centres, `[C, D]`, from a one-rank head.
fn all_centres(cfg: &HeadConfig) -> Vec<f64> {
    head(cfg, 0, 1).unwrap().1.as_tensor().flatten_all().unwrap().to_vec1::<f64>().unwrap()
}

// ---- The independent reference: plain f64 ----

fn margined(m: Margin, t: f64) -> f64 {
    let t = t.clamp(-1.0, 1.0);
    let theta = t.acos();
    if m.m1 * theta + m.m2 > std::f64::consts::PI {
        t - m.m3 - m.m2 * m.m2.sin()
    } else {
        (m.m1 * theta + m.m2).cos() - m.m3
    }
}

fn unit(v: &[f64]) -> Vec<f64> {
    let n = v.iter().map(|x| x * x).sum::<f64>().sqrt();
    v.iter().map(|x| x / n).collect()
}

/// Mean over the batch of the margin softmax cross-entropy over the classes `classes`.
fn plain_loss(emb: &[f64], centres: &[f64], labels: &[usize], m: Margin, classes: &[usize]) -> f64 {
    let mut total = 0.0;
    for (i, &y) in labels.iter().enumerate() {
        let e = unit(&emb[i * DIM..(i + 1) * DIM]);
        let logits: Vec<f64> = classes
            .iter()
            .map(|&c| {
                let w = unit(&centres[c * DIM..(c + 1) * DIM]);
                let cos: f64 = e.iter().zip(&w).map(|(a, b)| a * b).sum();
                m.s * if c == y { margined(m, cos) } else { cos }
            })
            .collect();
        let mx = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = mx + logits.iter().map(|z| (z - mx).exp()).sum::<f64>().ln();
        total += lse - logits[classes.iter().position(|c| *c == y).unwrap()];
    }
    total / labels.len() as f64
}

fn central_diff(x: &[f64], f: impl Fn(&[f64]) -> f64) -> Vec<f64> {
    let h = 1e-6;
    (0..x.len())
        .map(|k| {
            let (mut a, mut b) = (x.to_vec(), x.to_vec());
            a[k] += h;
            b[k] -= h;
            (f(&a) - f(&b)) / (2.0 * h)
        })
        .collect()
}

/// The classes Partial FC samples at STEP: the positives, plus the hashed negatives of an
/// independent re-implementation of the keyed rule.
fn sampled_classes(rate: f64) -> Vec<usize> {
    // The negatives the keyed rule samples at (SEED, STEP), from its Python re-implementation
    // (not the crate's own `negative_sampled`, so that a bug in the rule cannot cancel out):
    //   python3 scripts/reference/ref_face_sampling.py
    //   crates/allgrad-models/tests/models/face_head.rs: seed 3, step 2, 10 classes, rate 0.3: [2, 3, 5, 6]
    let negatives: Vec<usize> = match rate {
        r if r >= 1.0 => (0..C).collect(),
        r if r == 0.3 && (SEED, STEP, C) == (3, 2, 10) => vec![2, 3, 5, 6],
        _ => panic!("no reference sampling for rate {rate} (add it to scripts/reference/ref_face_sampling.py)"),
    };
    let ls = labels();
    (0..C).filter(|c| ls.contains(c) || negatives.contains(c)).collect()
}

/// Per W: the mean loss over ranks, the embedding gradient and the centres' gradient
/// (trainer's rule: backward of L_r / W), concatenated in rank order.
fn distributed(cfg: &HeadConfig, w: usize) -> (f64, Vec<f64>, Vec<f64>) {
    let emb = embeddings();
    let ls = labels();
    let out = run_threads(w, |pg| {
        let (mut h, centres) = head(cfg, pg.rank(), w)?;
        let (x, labels) = rank_batch(&emb, &ls, DIM, RowRange::split(B, pg.rank(), w))?;
        let loss = h.loss(x.as_tensor(), &labels, SEED, STEP, &pg)?;
        let g = (&loss / w as f64)?.backward()?;
        let gx = g.get(&x).unwrap().flatten_all()?.to_vec1::<f64>()?;
        Ok((loss.to_scalar::<f64>()?, gx, grad_or_zeros(&g, &centres)?))
    })
    .unwrap();
    let loss = out.iter().map(|o| o.0).sum::<f64>() / w as f64;
    (loss, out.iter().flat_map(|o| o.1.clone()).collect(), out.iter().flat_map(|o| o.2.clone()).collect())
}

/// Norm-wise within `tol` (`allgrad_testkit::close`).
fn assert_close(got: &[f64], want: &[f64], tol: f64, what: &str) {
    allgrad_testkit::close::assert_rel(got, want, tol, what);
}

fn check_against_plain(margin: MarginConfig, rate: f64) {
    let cfg = config(margin.clone(), rate);
    let m = margin.margin();
    let (emb, centres, ls) = (embeddings(), all_centres(&cfg), labels());
    let classes = sampled_classes(rate);
    let want_loss = plain_loss(&emb, &centres, &ls, m, &classes);
    let want_ge = central_diff(&emb, |e| plain_loss(e, &centres, &ls, m, &classes));
    let want_gc = central_diff(&centres, |c| plain_loss(&emb, c, &ls, m, &classes));
    for w in [1, 2, 3, 4] {
        let (loss, ge, gc) = distributed(&cfg, w);
        assert!((loss - want_loss).abs() <= 1e-10 * want_loss.abs(), "{margin:?} rate {rate} W={w}: loss {loss} vs {want_loss}");
        // Central differences at h = 1e-6 are good to about 1e-8 of the largest gradient here
        // (measured up to 1.2e-8).
        assert_close(&ge, &want_ge, 1e-7, &format!("{margin:?} rate {rate} W={w}: embedding gradient"));
        assert_close(&gc, &want_gc, 1e-7, &format!("{margin:?} rate {rate} W={w}: centre gradient"));
    }
}

#[test]
fn arcface_loss_and_gradients_on_1_to_4_ranks_equal_plain_f64_and_finite_differences() {
    check_against_plain(MarginConfig::Arcface { m: 0.5, s: 16.0 }, 1.0);
}

#[test]
fn cosface_and_combined_margins_on_1_to_4_ranks_equal_plain_f64_and_finite_differences() {
    check_against_plain(MarginConfig::Cosface { m: 0.4, s: 64.0 }, 1.0);
    check_against_plain(MarginConfig::Combined { m1: 1.1, m2: 0.3, m3: 0.1, s: 30.0 }, 1.0);
}

#[test]
fn partial_fc_on_1_to_4_ranks_equals_the_plain_loss_over_the_sampled_classes() {
    let classes = sampled_classes(0.3);
    assert!(classes.len() < C && classes.len() > 6, "the sample must leave some negatives out: {classes:?}");
    check_against_plain(MarginConfig::Arcface { m: 0.5, s: 16.0 }, 0.3);
    // Unsampled classes get no gradient at all.
    let (_, _, gc) = distributed(&config(MarginConfig::default(), 0.3), 3);
    for c in (0..C).filter(|c| !classes.contains(c)) {
        assert!(gc[c * DIM..(c + 1) * DIM].iter().all(|g| *g == 0.0), "class {c} was not sampled but has a gradient");
    }
}

#[test]
fn the_head_passes_the_world_size_invariance_check() {
    let cfg = config(MarginConfig::default(), 1.0);
    let ls = labels();
    let x = Tensor::from_vec(embeddings(), (B, DIM), &Device::Cpu).unwrap();
    let loss = |x: &Tensor, pg: &ProcessGroup| {
        let rows = RowRange::split(B, pg.rank(), pg.world_size());
        let (mut h, _) = head(&cfg, pg.rank(), pg.world_size())?;
        h.loss(x, &rows_of(&ls, rows, 1), SEED, STEP, pg)
    };
    for report in check_world_size_invariance(&x, &[2, 3, 4], loss).unwrap() {
        report.assert_close(1e-10).unwrap();
    }
}

/// insightface's route, emulated: each rank's logits get ∂L/∂z_r (the single loss's
/// gradient, from a softmax computed with plain collectives), the gather's backward sums the
/// blocks and multiplies by `factor`, and DDP AVERAGES the backbone gradient. Returns the
/// backbone gradient (identical on every rank) and the loss. CosFace, whose margin has slope
/// 1, so applying it without gradient (as insightface does) changes nothing.
fn insightface_backbone_grad(w: usize, factor: f64, cfg: &HeadConfig, x: &[f64], a0: &[f64]) -> (Vec<f64>, f64) {
    let m = cfg.margin.margin();
    let ls = labels();
    let out = run_threads(w, |pg| {
        let rows = RowRange::split(B, pg.rank(), w);
        let (h, centres) = head(cfg, pg.rank(), w)?;
        let range = h.range();
        let a = Var::from_vec(a0.to_vec(), (4, DIM), &Device::Cpu)?;
        let xr = Tensor::from_vec(rows_of(x, rows, 4), (rows.len, 4), &Device::Cpu)?;
        let e = l2(&xr.matmul(a.as_tensor())?)?;
        // Value e, gradient times `factor`.
        let e = ((&e * factor)? - (&e * (factor - 1.0))?.detach())?;
        let all = all_gather(&e, &pg)?;
        let cos = all.matmul(&l2(centres.as_tensor())?.t()?)?;
        let onehot: Vec<f64> =
            ls.iter().flat_map(|y| (range.start..range.end()).map(move |c| f64::from(u8::from(c == *y)))).collect();
        let onehot = Tensor::from_vec(onehot, (B, range.len), &Device::Cpu)?;
        let logits = ((cos - (&onehot * m.m3)?)? * m.s)?;
        let z = logits.detach();
        let mx = pg.all_reduce(&z.max_keepdim(D::Minus1)?, ReduceOp::Max)?;
        let ex = z.broadcast_sub(&mx)?.exp()?;
        let sum = pg.all_reduce(&ex.sum_keepdim(D::Minus1)?, ReduceOp::Sum)?;
        let grad = ((ex.broadcast_div(&sum)? - &onehot)? / B as f64)?;
        let tgt = pg.all_reduce(&(&z * &onehot)?.sum_keepdim(D::Minus1)?, ReduceOp::Sum)?;
        let loss = ((sum.log()? + mx)? - tgt)?.mean_all()?.to_scalar::<f64>()?;
        let g = (logits * grad)?.sum_all()?.backward()?;
        let ga = pg.all_reduce(g.get(&a).unwrap(), ReduceOp::Avg)?; // DDP
        Ok((ga.flatten_all()?.to_vec1::<f64>()?, loss))
    })
    .unwrap();
    out[0].clone()
}

/// Ours: backward of L_r / W, backbone gradients SUMMED over ranks.
fn our_backbone_grad(w: usize, cfg: &HeadConfig, x: &[f64], a0: &[f64]) -> (Vec<f64>, f64) {
    let ls = labels();
    let out = run_threads(w, |pg| {
        let rows = RowRange::split(B, pg.rank(), w);
        let (mut h, _) = head(cfg, pg.rank(), w)?;
        let a = Var::from_vec(a0.to_vec(), (4, DIM), &Device::Cpu)?;
        let xr = Tensor::from_vec(rows_of(x, rows, 4), (rows.len, 4), &Device::Cpu)?;
        let loss = h.loss(&xr.matmul(a.as_tensor())?, &rows_of(&ls, rows, 1), SEED, STEP, &pg)?;
        let g = (&loss / w as f64)?.backward()?;
        let ga = pg.all_reduce(g.get(&a).unwrap(), ReduceOp::Sum)?;
        Ok((ga.flatten_all()?.to_vec1::<f64>()?, loss.to_scalar::<f64>()?))
    })
    .unwrap();
    out[0].clone()
}

fn l2(x: &Tensor) -> candle_core::Result<Tensor> {
    x.broadcast_div(&x.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?)
}

#[test]
fn insightface_world_size_factor_and_ddp_average_equal_our_rule_and_without_it_the_backbone_gets_one_wth() {
    let cfg = config(MarginConfig::Cosface { m: 0.4, s: 64.0 }, 1.0);
    let x: Vec<f64> = (0..B * 4).map(|k| ((k * 13 % 17) as f64 - 8.0) / 5.0).collect();
    let a0: Vec<f64> = (0..4 * DIM).map(|k| ((k * 7 % 11) as f64 - 5.0) / 4.0).collect();
    let (one, loss1) = our_backbone_grad(1, &cfg, &x, &a0);
    assert!(one.iter().any(|g| g.abs() > 1e-3), "the backbone gradient is trivial: {one:?}");
    for w in [2, 3, 4] {
        let (ours, l) = our_backbone_grad(w, &cfg, &x, &a0);
        assert!((l - loss1).abs() <= 1e-10 * loss1, "W={w}: loss {l} vs {loss1}");
        assert_close(&ours, &one, 1e-10, &format!("W={w}: our backbone gradient vs 1 rank"));
        let (theirs, lt) = insightface_backbone_grad(w, w as f64, &cfg, &x, &a0);
        assert!((lt - loss1).abs() <= 1e-10 * loss1, "W={w}: insightface-style loss {lt} vs {loss1}");
        assert_close(&theirs, &ours, 1e-10, &format!("W={w}: insightface rule (x W, DDP average) vs ours"));
        let (without, _) = insightface_backbone_grad(w, 1.0, &cfg, &x, &a0);
        let scaled: Vec<f64> = ours.iter().map(|g| g / w as f64).collect();
        assert_close(&without, &scaled, 1e-10, &format!("W={w}: without the factor the backbone gets 1/W"));
    }
}
