//! CLIP's and SigLIP's losses over the global batch:
//! - W = 1..4 ranks (uneven shards, asymmetric data) against one process on the global batch:
//!   loss, the gradients of every rank's image and text embeddings (under the trainer's 1/W)
//!   and of the logit scale and bias (summed over ranks, / W), f64 1e-10;
//! - the tiled CLIP loss against the untiled one, the ring SigLIP against the all-gather form;
//! - an independent reference: both losses written as plain f64 loops, values and, by central
//!   differences of those loops, gradients;
//! - the logit scale's clamp at 100.

// The plain references are formulas of (row, column): the loops index by both on purpose.
#![allow(clippy::needless_range_loop)]

use allgrad_dist::{run_threads, ProcessGroup};
use allgrad_models::clip::{clip_loss, clip_loss_tiled, siglip_loss, siglip_loss_ring};
use allgrad_testkit::close::assert_rel;
use candle_core::{DType, Device, Result, Tensor, Var};

const CPU: Device = Device::Cpu;
const D: usize = 5;

/// Row i of the global batch: image and text embeddings, neither normalised nor symmetric.
fn embeddings(n: usize, phase: f64) -> Vec<f64> {
    (0..n * D).map(|j| ((j as f64) * 0.37 + phase).sin() * (1.0 + (j % 7) as f64 * 0.3) + 0.05 * (j / D) as f64).collect()
}

fn flat(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap()
}

#[derive(Clone, Copy, Debug)]
enum Form {
    Clip,
    ClipTiled(usize),
    SiglipGather,
    SiglipRing,
}

fn apply(form: Form, img: &Tensor, txt: &Tensor, s: &Tensor, b: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    match form {
        Form::Clip => clip_loss(img, txt, s, pg),
        Form::ClipTiled(t) => clip_loss_tiled(img, txt, s, t, pg),
        Form::SiglipGather => siglip_loss(img, txt, s, b, pg),
        Form::SiglipRing => siglip_loss_ring(img, txt, s, b, pg),
    }
}

/// Mean over ranks of the losses, image gradient rows, text gradient rows, d scale, d bias.
type Outcome = (f64, Vec<f64>, Vec<f64>, f64, f64);

/// The [`Outcome`] on W ranks, rank r holding rows `n r / W .. n (r + 1) / W`, each rank's
/// backward scaled by 1/W as the trainer does.
fn run(form: Form, w: usize, n: usize, scale: f64, bias: f64) -> Outcome {
    let (img, txt) = (embeddings(n, 0.0), embeddings(n, 1.3));
    let out = run_threads(w, |pg| {
        let r = pg.rank();
        let (lo, hi) = (n * r / w, n * (r + 1) / w);
        let part = |v: &[f64]| Var::from_tensor(&Tensor::from_vec(v[lo * D..hi * D].to_vec(), (hi - lo, D), &CPU)?);
        let (i, t) = (part(&img)?, part(&txt)?);
        let s = Var::from_tensor(&Tensor::new(scale, &CPU)?)?;
        let b = Var::from_tensor(&Tensor::new(bias, &CPU)?)?;
        let loss = apply(form, i.as_tensor(), t.as_tensor(), s.as_tensor(), b.as_tensor(), &pg)?;
        let g = (&loss / w as f64)?.backward()?;
        let get = |v: &Var| g.get(v).map(flat).unwrap_or_else(|| vec![0.0; v.elem_count()]);
        Ok((loss.to_scalar::<f64>()?, get(&i), get(&t), get(&s)[0], get(&b)[0]))
    })
    .unwrap();
    let mut total: Outcome = (0.0, Vec::new(), Vec::new(), 0.0, 0.0);
    for (l, gi, gt, gs, gb) in out {
        total.0 += l / w as f64;
        total.1.extend(gi);
        total.2.extend(gt);
        total.3 += gs;
        total.4 += gb;
    }
    total
}

fn assert_same(got: &Outcome, want: &Outcome, tol: f64, what: &str) {
    assert_rel(&[got.0], &[want.0], tol, &format!("{what}: loss"));
    assert_rel(&got.1, &want.1, tol, &format!("{what}: image gradients"));
    assert_rel(&got.2, &want.2, tol, &format!("{what}: text gradients"));
    assert_rel(&[got.3], &[want.3], tol, &format!("{what}: logit scale gradient"));
    if want.4 != 0.0 || got.4 != 0.0 {
        assert_rel(&[got.4], &[want.4], tol, &format!("{what}: logit bias gradient"));
    }
}

const FORMS: [Form; 6] =
    [Form::Clip, Form::ClipTiled(1), Form::ClipTiled(3), Form::ClipTiled(64), Form::SiglipGather, Form::SiglipRing];

#[test]
fn every_loss_on_w_ranks_equals_one_process_uneven_shards_included() {
    for form in FORMS {
        for n in [12, 10] {
            let one = run(form, 1, n, 1.7, -2.0);
            for w in 2..=4 {
                assert_same(&run(form, w, n, 1.7, -2.0), &one, 1e-10, &format!("{form:?} n={n} W={w}"));
            }
        }
    }
}

#[test]
fn the_tiled_clip_loss_equals_the_untiled_one_and_the_ring_the_gather() {
    for w in [1, 3] {
        let whole = run(Form::Clip, w, 10, 1.7, 0.0);
        for tile in [1, 3, 64] {
            assert_same(&run(Form::ClipTiled(tile), w, 10, 1.7, 0.0), &whole, 1e-10, &format!("tile {tile} W={w}"));
        }
        let gather = run(Form::SiglipGather, w, 10, 1.7, -2.0);
        assert_same(&run(Form::SiglipRing, w, 10, 1.7, -2.0), &gather, 1e-10, &format!("ring vs gather W={w}"));
    }
}

// ------------------------------------------------------------------ plain f64 reference

fn normalised(v: &[f64]) -> Vec<Vec<f64>> {
    v.chunks(D)
        .map(|r| {
            let n = r.iter().map(|x| x * x).sum::<f64>().sqrt();
            r.iter().map(|x| x / n).collect()
        })
        .collect()
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// CLIP: mean over i of (CE of image i over texts + CE of text i over images) / 2, logits
/// exp(s) cos (uncapped: the cap is the trainer's clamp of the parameter).
fn clip_plain(img: &[f64], txt: &[f64], s: f64) -> f64 {
    let (a, b) = (normalised(img), normalised(txt));
    let n = a.len();
    let k = s.exp();
    let ce = |x: &Vec<Vec<f64>>, y: &Vec<Vec<f64>>| -> f64 {
        (0..n)
            .map(|i| {
                let l: Vec<f64> = (0..n).map(|j| k * dot(&x[i], &y[j])).collect();
                let m = l.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                m + l.iter().map(|v| (v - m).exp()).sum::<f64>().ln() - l[i]
            })
            .sum::<f64>()
    };
    (ce(&a, &b) + ce(&b, &a)) / (2.0 * n as f64)
}

/// SigLIP: −(1/n) Σ_ij log σ(y_ij (exp(s) cos_ij + bias)).
fn siglip_plain(img: &[f64], txt: &[f64], s: f64, bias: f64) -> f64 {
    let (a, b) = (normalised(img), normalised(txt));
    let n = a.len();
    let mut sum = 0.0;
    for i in 0..n {
        for j in 0..n {
            let z = s.exp() * dot(&a[i], &b[j]) + bias;
            let y = if i == j { 1.0 } else { -1.0 };
            sum += -(1.0 + (-y * z).exp()).ln();
        }
    }
    -sum / n as f64
}

fn plain(form: Form, img: &[f64], txt: &[f64], s: f64, bias: f64) -> f64 {
    match form {
        Form::Clip | Form::ClipTiled(_) => clip_plain(img, txt, s),
        Form::SiglipGather | Form::SiglipRing => siglip_plain(img, txt, s, bias),
    }
}

#[test]
fn values_and_gradients_match_plain_f64_loops_and_their_central_differences() {
    let n = 6;
    for (form, s) in [(Form::Clip, 1.7), (Form::ClipTiled(4), 1.7), (Form::SiglipGather, 1.2), (Form::SiglipRing, 1.2)] {
        let bias = -1.5;
        let (img, txt) = (embeddings(n, 0.0), embeddings(n, 1.3));
        let want = plain(form, &img, &txt, s, bias);
        for w in [1, 3] {
            let got = run(form, w, n, s, bias);
            assert_rel(&[got.0], &[want], 1e-12, &format!("{form:?} W={w}: loss vs plain loops"));
            // Central differences, h = 1e-5: truncation ~h² times the third derivative (below
            // 1e-9 here), rounding ~1e-16 / h; 1e-7 relative bounds both with margin.
            let h = 1e-5;
            let fd = |f: &dyn Fn(f64) -> f64| (f(h) - f(-h)) / (2.0 * h);
            let gi: Vec<f64> = (0..img.len())
                .map(|k| {
                    fd(&|e| {
                        let mut v = img.clone();
                        v[k] += e;
                        plain(form, &v, &txt, s, bias)
                    })
                })
                .collect();
            let gt: Vec<f64> = (0..txt.len())
                .map(|k| {
                    fd(&|e| {
                        let mut v = txt.clone();
                        v[k] += e;
                        plain(form, &img, &v, s, bias)
                    })
                })
                .collect();
            let gs = fd(&|e| plain(form, &img, &txt, s + e, bias));
            assert_rel(&got.1, &gi, 1e-7, &format!("{form:?} W={w}: image gradients vs central differences"));
            assert_rel(&got.2, &gt, 1e-7, &format!("{form:?} W={w}: text gradients vs central differences"));
            assert_rel(&[got.3], &[gs], 1e-7, &format!("{form:?} W={w}: logit scale gradient vs central difference"));
            if matches!(form, Form::SiglipGather | Form::SiglipRing) {
                let gb = fd(&|e| plain(form, &img, &txt, s, bias + e));
                assert_rel(&[got.4], &[gb], 1e-7, &format!("{form:?} W={w}: bias gradient vs central difference"));
            }
        }
    }
}

/// The forward does not cap the scale (OpenCLIP and `transformers` do not: the cap is a clamp
/// of the parameter after each step, which the trainer applies): past ln 100 the logits are
/// `exp(s) · cos` and the scale keeps its gradient (a central difference of the plain loop).
#[test]
fn the_forward_does_not_cap_the_logit_scale_past_ln_100() {
    let s = 100f64.ln() + 0.5;
    let (img, txt) = (embeddings(6, 0.0), embeddings(6, 1.3));
    for form in [Form::Clip, Form::ClipTiled(2)] {
        let got = run(form, 2, 6, s, 0.0);
        assert_rel(&[got.0], &[clip_plain(&img, &txt, s)], 1e-12, &format!("{form:?}: the loss at scale exp(ln 100 + 0.5)"));
        let h = 1e-5;
        let gs = (clip_plain(&img, &txt, s + h) - clip_plain(&img, &txt, s - h)) / (2.0 * h);
        assert!(gs.abs() > 1e-3, "the test needs a scale gradient well away from 0, got {gs}");
        assert_rel(&[got.3], &[gs], 1e-7, &format!("{form:?}: the scale's gradient past ln 100"));
    }
}
