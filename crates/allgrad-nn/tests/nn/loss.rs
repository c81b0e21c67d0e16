//! cross_entropy against Candle's `candle_nn::loss::cross_entropy` (forward and gradient),
//! PyTorch values, and central finite differences in f64.

use allgrad_nn::{cross_entropy, per_row_cross_entropy};
use candle_core::{DType, Device, Tensor, Var};

use crate::common::*;

fn targets(v: &[u32]) -> Tensor {
    Tensor::new(v, &Device::Cpu).unwrap()
}

type Loss = fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>;

fn grad(loss: Loss, logits: &Tensor, t: &Tensor) -> (Tensor, Tensor) {
    let v = Var::from_tensor(logits).unwrap();
    let l = loss(&v, t).unwrap();
    let g = l.backward().unwrap();
    (l, g.get(&v).unwrap().clone())
}

#[test]
fn loss_and_gradient_match_candle() {
    for dtype in [DType::F32, DType::F64] {
        for (n, k, t) in [(4, 5, vec![0u32, 3, 4, 1]), (1, 3, vec![2]), (7, 2, vec![0, 1, 1, 0, 1, 0, 0])] {
            let x = (rand_tensor(&[n, k], n as u64, dtype) * 5.0).unwrap();
            let t = targets(&t);
            let (a, da) = grad(cross_entropy, &x, &t);
            let (b, db) = grad(candle_nn::loss::cross_entropy, &x, &t);
            assert_close(&a, &b, tol(dtype), &format!("loss {n}x{k} {dtype:?}"));
            assert_close(&da, &db, tol(dtype), &format!("gradient {n}x{k} {dtype:?}"));
        }
    }
}

#[test]
fn gradient_matches_finite_differences_f64() {
    let x = (rand_tensor(&[5, 6], 3, DType::F64) * 3.0).unwrap();
    let t = targets(&[5, 0, 2, 2, 3]);
    let (_, g) = grad(cross_entropy, &x, &t);
    let f = |z: &Tensor| cross_entropy(z, &t);
    // Central differences at h = 1e-6: the loss's rounding over 2h (~1e-16·|L|/1e-6 per entry)
    // and an h² term; measured 2.2e-9 of the gradient's norm (the old check, absolute below 1,
    // passed it at 1e-9).
    assert_close(&g, &fd_grad(&f, &x, 1e-6), 1e-8, "dlogits");
}

#[test]
fn matches_pytorch() {
    // l[i,j] = 3 sin(0.7 i + 1.1 j) (4x5), t = [0, 3, 4, 1]; loss = F.cross_entropy(l, t)
    let v: Vec<f64> = (0..20).map(|k| 3.0 * (0.7 * (k / 5) as f64 + 1.1 * (k % 5) as f64).sin()).collect();
    let x = Tensor::from_vec(v, (4, 5), &Device::Cpu).unwrap();
    let (l, g) = grad(cross_entropy, &x, &targets(&[0, 3, 4, 1]));
    assert!((l.to_scalar::<f64>().unwrap() - 4.127982630195257).abs() < 1e-14);
    let want = [
        -0.24090269833073313,
        0.131841432279894,
        0.102870103488007,
        0.005667458422590508,
        0.0005237041402416472,
        0.06236062024915602,
        0.1676408379122254,
        0.018504777025290322,
        -0.2490677241738071,
        0.0005614889871353945,
        0.18622288901735778,
        0.0583238748504772,
        0.0025677595916626986,
        0.00048230688420210016,
        -0.24759683034369978,
        0.20520794529366618,
        -0.23707357970128243,
        0.0009859968906403426,
        0.0015160409059717947,
        0.02936359661100415,
    ];
    assert_close(&g, &Tensor::from_vec(want.to_vec(), (4, 5), &Device::Cpu).unwrap(), 1e-14, "gradient");
}

#[test]
fn stable_for_huge_logits() {
    let x = Tensor::new(&[[1e4f32, 0.0, -1e4], [-3e4, 3e4, 0.0]], &Device::Cpu).unwrap();
    let (l, g) = grad(cross_entropy, &x, &targets(&[0, 0]));
    // Row 0 is certain and right (loss 0), row 1 certain and wrong (loss 6e4); mean 3e4.
    assert_eq!(l.to_scalar::<f32>().unwrap(), 3e4);
    assert_eq!(to_f64_vec(&g), vec![0.0, 0.0, 0.0, -0.5, 0.5, 0.0]);
}

#[test]
fn target_dtypes_agree_and_per_row_losses_average_to_the_loss() {
    let x = rand_tensor(&[3, 4], 1, DType::F32);
    let t32 = targets(&[3, 0, 2]);
    let per_row = per_row_cross_entropy(&x, &t32).unwrap();
    assert_eq!(per_row.dims(), [3]);
    let mean = cross_entropy(&x, &t32).unwrap();
    assert_close(&per_row.mean_all().unwrap(), &mean, 0.0, "mean");
    for dt in [DType::U8, DType::I64] {
        assert_close(&cross_entropy(&x, &t32.to_dtype(dt).unwrap()).unwrap(), &mean, 0.0, "target dtype");
    }
    // A strided (non-contiguous) target view.
    let wide = Tensor::new(&[[3u32, 9], [0, 9], [2, 9]], &Device::Cpu).unwrap();
    let t = wide.narrow(1, 0, 1).unwrap().squeeze(1).unwrap();
    assert_close(&cross_entropy(&x, &t).unwrap(), &mean, 0.0, "strided targets");
}

#[test]
fn bad_targets_are_errors_naming_the_row_and_value() {
    let x = rand_tensor(&[3, 4], 1, DType::F32);
    let e = err_text(cross_entropy(&x, &targets(&[3, 4, 0])));
    assert!(e.contains("target 4 of row 1") && e.contains("0..4"), "{e}");
    let e = err_text(cross_entropy(&x, &Tensor::new(&[0i64, -1, 0], &Device::Cpu).unwrap()));
    assert!(e.contains("target -1 of row 1"), "{e}");
    let e = err_text(cross_entropy(&x, &targets(&[0, 1])));
    assert!(e.contains("(3,)") && e.contains("[2]"), "{e}");
    let e = err_text(cross_entropy(&x, &Tensor::new(&[0f32, 1.0, 2.0], &Device::Cpu).unwrap()));
    assert!(e.contains("F32"), "{e}");
    let e = err_text(cross_entropy(&x.flatten_all().unwrap(), &targets(&[0])));
    assert!(e.contains("[12]"), "{e}");
}
