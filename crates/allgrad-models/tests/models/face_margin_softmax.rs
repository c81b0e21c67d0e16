//! The fused margin cross-entropy of the face head (one pass over the cosines, one for their
//! gradient) against its composition of Candle ops (the margined logits, then the parallel
//! softmax cross-entropy): loss and the cosines' gradient on W = 1, 2, 3 thread-ranks, each
//! with its own cosines and some rows whose class another rank holds (a row with none here on
//! some ranks), ArcFace, CosFace and a combined margin whose target logit can exceed the
//! scaled cosine, f64 (1e-12) and f32 (2e-6); and the fused row normalisation against
//! `l2_normalize` with its gradient (f64 1e-13, f32 1e-6), a zero row included. The head as a
//! whole, which takes the fused forms, is held against plain f64 and finite differences in
//! `face_head.rs`.

use allgrad_dist::run_threads;
use allgrad_models::face::softmax::{parallel_margin_cross_entropy, parallel_margin_cross_entropy_composed};
use allgrad_models::face::{Margin, MarginConfig};
use allgrad_rng::{below, normals, stream};
use candle_core::{DType, Device, Tensor, Var};

const B: usize = 11;

/// Rank r's cosines `[B, c_r]` in (-1, 1) and target columns (u32::MAX: another rank's class).
fn inputs(rank: usize, world: usize) -> (Vec<f64>, usize, Vec<u32>) {
    let c = 5 + 3 * rank;
    let z = normals(&mut stream(&[21, rank as u64, world as u64]), B * c);
    let cos = z.iter().map(|v| v.tanh() * 0.95).collect();
    let mut rng = stream(&[22, world as u64]);
    // Each sample's class is on one rank (drawn), at a column drawn there.
    let cols = (0..B)
        .map(|i| {
            let owner = below(&mut rng, world);
            let col = below(&mut rng, c) as u32;
            if owner == rank && i % 5 != 4 {
                col
            } else {
                u32::MAX
            }
        })
        .collect();
    (cos, c, cols)
}

/// Per rank: the loss and the cosines' gradient (of loss / W, the trainer's rule).
fn run(margin: Margin, world: usize, dtype: DType, fused: bool) -> Vec<(f64, Vec<f64>)> {
    run_threads(world, |pg| {
        let (cos, c, cols) = inputs(pg.rank(), world);
        let x = Var::from_tensor(&Tensor::from_vec(cos, (B, c), &Device::Cpu)?.to_dtype(dtype)?)?;
        let loss = if fused {
            parallel_margin_cross_entropy(x.as_tensor(), &cols, margin, &pg)?
        } else {
            parallel_margin_cross_entropy_composed(x.as_tensor(), &cols, margin, &pg)?
        };
        let g = (&loss / world as f64)?.backward()?;
        let grad = g.get(&x).expect("the cosines have a gradient").to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
        Ok((loss.to_dtype(DType::F64)?.to_scalar::<f64>()?, grad))
    })
    .unwrap()
}

#[test]
fn fused_margin_cross_entropy_equals_the_composed_one_on_1_to_3_ranks() {
    let margins = [
        MarginConfig::Arcface { m: 0.5, s: 64.0 }.margin(),
        MarginConfig::Cosface { m: 0.35, s: 30.0 }.margin(),
        MarginConfig::Combined { m1: 0.8, m2: 0.1, m3: -0.2, s: 16.0 }.margin(),
    ];
    for margin in margins {
        for world in [1, 2, 3] {
            for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 2e-6)] {
                let fused = run(margin, world, dtype, true);
                let composed = run(margin, world, dtype, false);
                for (r, ((lf, gf), (lc, gc))) in fused.iter().zip(&composed).enumerate() {
                    let what = format!("{margin:?} W={world} {dtype:?} rank {r}");
                    assert!((lf - lc).abs() <= tol * lc.abs(), "{what}: loss {lf} vs {lc}");
                    let scale = gc.iter().fold(1e-6f64, |m, v| m.max(v.abs()));
                    for (k, (a, b)) in gf.iter().zip(gc).enumerate() {
                        assert!((a - b).abs() <= tol * scale, "{what}: gradient [{k}] {a} vs {b} (scale {scale})");
                    }
                    assert!(gc.iter().any(|v| v.abs() > 1e-4), "{what}: trivial gradient");
                }
            }
        }
    }
}

#[test]
fn a_target_column_past_the_cosines_is_refused() {
    let out = run_threads(1, |pg| {
        let x = Tensor::zeros((2, 3), DType::F64, &Device::Cpu)?;
        parallel_margin_cross_entropy(&x, &[0, 3], MarginConfig::default().margin(), &pg)
    });
    let msg = out.unwrap_err().to_string();
    assert!(msg.contains("[2, 3]") && msg.contains("below c"), "{msg}");
}

#[test]
fn fused_unit_rows_equal_l2_normalize_with_their_gradient_and_a_zero_row() {
    use allgrad_models::face::normalize::unit_rows;
    use allgrad_models::losses::l2_normalize;
    let (n, d) = (9, 7);
    let mut x = normals(&mut stream(&[23]), n * d);
    x[3 * d..4 * d].iter_mut().for_each(|v| *v = 0.0); // a zero row stays zero, gradient g / 1e-12
    let w = normals(&mut stream(&[24]), n * d);
    for (dtype, tol) in [(DType::F64, 1e-13), (DType::F32, 1e-6)] {
        let run = |f: fn(&Tensor) -> candle_core::Result<Tensor>| {
            let v =
                Var::from_tensor(&Tensor::from_vec(x.clone(), (n, d), &Device::Cpu).unwrap().to_dtype(dtype).unwrap()).unwrap();
            let wt = Tensor::from_vec(w.clone(), (n, d), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
            let y = f(v.as_tensor()).unwrap();
            let g = (&y * &wt).unwrap().sum_all().unwrap().backward().unwrap();
            let flat = |t: &Tensor| t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
            (flat(&y), flat(g.get(&v).unwrap()))
        };
        let (yf, gf) = run(unit_rows);
        let (yc, gc) = run(l2_normalize);
        for (k, (a, b)) in yf.iter().zip(&yc).enumerate() {
            assert!((a - b).abs() <= tol, "{dtype:?} value [{k}]: {a} vs {b}");
        }
        let keep = |g: &[f64]| -> Vec<f64> { g.iter().enumerate().filter(|(k, _)| k / d != 3).map(|(_, x)| *x).collect() };
        allgrad_testkit::close::assert_rel(&keep(&gf), &keep(&gc), tol, &format!("{dtype:?} gradient but the zero row"));
        // The zero row: the composed form's gradient is NaN (sqrt's slope at 0 times 0); the
        // norm is the constant floor there, so the gradient is g / 1e-12.
        assert!(gc[3 * d..4 * d].iter().all(|v| v.is_nan()), "{dtype:?}: the composed zero row's gradient is finite");
        for (k, (a, g)) in gf[3 * d..4 * d].iter().zip(&w[3 * d..4 * d]).enumerate() {
            assert!((a - g / 1e-12).abs() <= tol * (g / 1e-12).abs(), "{dtype:?} zero row [{k}]: {a} vs {}", g / 1e-12);
        }
    }
}
