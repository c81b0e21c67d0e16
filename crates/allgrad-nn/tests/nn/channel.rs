//! The fused per-channel batch-norm passes against the same computation composed from
//! Candle's broadcast ops (forward and every gradient, f64), on 4-D and 2-D inputs, and on a
//! non-contiguous input.

use allgrad_nn::{channel_affine, channel_moments};
use candle_core::{DType, Device, Result, Tensor, Var};

fn data(seed: u64, shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let v: Vec<f64> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 11) as f64 / (1u64 << 53) as f64 * 4.0 - 1.5
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn channel_shape(x: &Tensor) -> Vec<usize> {
    (0..x.rank()).map(|d| if d == 1 { x.dim(1).unwrap() } else { 1 }).collect()
}

/// A batch-norm-like scalar built from both ops, so every gradient path is used.
fn objective(x: &Tensor, gamma: &Tensor, beta: &Tensor, fused: bool) -> Result<Tensor> {
    let c = x.dim(1)?;
    let n = (x.elem_count() / c) as f64;
    let m = if fused {
        channel_moments(x)?
    } else {
        let flat = x.transpose(0, 1)?.contiguous()?.reshape((c, ()))?;
        Tensor::stack(&[flat.sum(1)?, flat.sqr()?.sum(1)?], 0)?
    };
    let mean = (m.get(0)? / n)?;
    let var = ((m.get(1)? / n)? - mean.sqr()?)?;
    let a = (gamma / (var + 1e-5)?.sqrt()?)?;
    let b = (beta - (&mean * &a)?)?;
    let y = if fused {
        channel_affine(x, &a, &b)?
    } else {
        let s = channel_shape(x);
        x.broadcast_mul(&a.reshape(s.as_slice())?)?.broadcast_add(&b.reshape(s.as_slice())?)?
    };
    let w = data(99, y.dims());
    (y.sqr()? * w)?.sum_all()
}

fn check(x: Tensor) {
    let c = x.dim(1).unwrap();
    let gamma = Var::from_tensor(&(data(5, &[c]) + 2.0).unwrap()).unwrap();
    let beta = Var::from_tensor(&data(6, &[c])).unwrap();
    let xv = Var::from_tensor(&x).unwrap();
    let mut results = Vec::new();
    for fused in [true, false] {
        let out = objective(xv.as_tensor(), gamma.as_tensor(), beta.as_tensor(), fused).unwrap();
        let g = out.backward().unwrap();
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        results.push((
            out.to_scalar::<f64>().unwrap(),
            flat(g.get(&xv).unwrap()),
            flat(g.get(&gamma).unwrap()),
            flat(g.get(&beta).unwrap()),
        ));
    }
    let (f, r) = (&results[0], &results[1]);
    allgrad_testkit::close::assert_elem_rel(&[f.0], &[r.0], 1e-10, f64::MIN_POSITIVE, "value: fused vs composed");
    for (name, a, b) in [("x", &f.1, &r.1), ("gamma", &f.2, &r.2), ("beta", &f.3, &r.3)] {
        allgrad_testkit::close::assert_rel(a, b, 1e-10, &format!("d/d{name}: fused vs composed"));
    }
}

#[test]
fn fused_passes_match_the_composed_reference_on_4d_2d_and_strided_inputs() {
    check(data(1, &[3, 4, 5, 6]));
    check(data(2, &[7, 5]));
    check(data(3, &[2, 3, 4, 1]));
    // Non-contiguous: a transposed view.
    check(data(4, &[4, 3, 6, 5]).transpose(2, 3).unwrap());
}

#[test]
fn f32_sums_are_accumulated_in_f64() {
    // 1e6 values of 0.1 + 1e4: a sequential f32 sum drifts by far more than 1e-3 relative.
    let x = (Tensor::full(0.1f32, (1000, 1, 1000), &Device::Cpu).unwrap() + 1e4).unwrap();
    let m = channel_moments(&x).unwrap().to_dtype(DType::F64).unwrap().to_vec2::<f64>().unwrap();
    let want = 1e6 * (1e4f32 + 0.1f32) as f64;
    assert!((m[0][0] - want).abs() <= 1e-6 * want, "{} vs {want}", m[0][0]);
}

#[test]
fn shape_errors_name_the_shapes() {
    let x = data(1, &[2, 3, 4]);
    let e = channel_affine(&x, &data(2, &[4]), &data(3, &[3])).unwrap_err().to_string();
    assert!(e.contains("3 channels") && e.contains("[4]"), "{e}");
    assert!(channel_moments(&data(1, &[5])).unwrap_err().to_string().contains("[N, C, ...]"));
}
