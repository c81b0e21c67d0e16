//! `attention` (fused multi-head self-attention over packed q|k|v) against a plain f64 loop
//! computation of the forward, against Candle's own differentiable ops for the gradient (f64,
//! 1e-10; f32 against the f64 reference, 1e-5), against finite differences in f64, with
//! padding masks that differ per sequence and dropout masks; padded keys contribute exactly
//! nothing; `attention_composed` (the path off the CPU) agrees; errors name the shapes. The
//! causal forms (`causal_attention`, `causal_attention_composed`) against the same references
//! with later keys left out, and later keys contribute exactly nothing.

use allgrad_nn::{attention, attention_composed, causal_attention, causal_attention_composed};
use candle_core::{DType, Device, Result, Tensor, Var};

use crate::common::{assert_close, err_text, fd_grad, rand_tensor, to_f64_vec};

/// One case: batch, length, heads, head size, and for each sequence its number of real tokens
/// (keys beyond it are padding).
#[derive(Clone, Copy)]
struct Case {
    b: usize,
    len: usize,
    heads: usize,
    d: usize,
    dropout: bool,
    /// Query t sees keys 0..=t only.
    causal: bool,
}

impl Case {
    fn h(&self) -> usize {
        self.heads * self.d
    }

    /// The fused op of this case: causal or not.
    fn fused(&self, qkv: &Tensor, bias: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
        if self.causal {
            causal_attention(qkv, bias, self.heads, mask)
        } else {
            attention(qkv, bias, self.heads, mask)
        }
    }

    /// The composed op of this case.
    fn composed(&self, qkv: &Tensor, bias: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
        if self.causal {
            causal_attention_composed(qkv, bias, self.heads, mask)
        } else {
            attention_composed(qkv, bias, self.heads, mask)
        }
    }

    /// Real tokens of sequence `i`: all for the first, fewer (at least one) for the others.
    fn real(&self, i: usize) -> usize {
        (self.len - (i * 2) % self.len).max(1)
    }

    fn qkv(&self, seed: u64, dtype: DType) -> Tensor {
        // Scaled so that the scores spread over a few units and the softmax is not uniform.
        (rand_tensor(&[self.b, self.len, 3 * self.h()], seed, DType::F64) * 2.0).unwrap().to_dtype(dtype).unwrap()
    }

    fn bias(&self, dtype: DType) -> Tensor {
        let v: Vec<f64> =
            (0..self.b).flat_map(|i| (0..self.len).map(move |k| if k < self.real(i) { 0.0 } else { -1e30 })).collect();
        Tensor::from_vec(v, (self.b, self.len), &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
    }

    /// A keep mask with scale 1/(1-0.25) and about a quarter of the entries 0.
    fn mask(&self, seed: u64, dtype: DType) -> Option<Tensor> {
        if !self.dropout {
            return None;
        }
        let u = to_f64_vec(&rand_tensor(&[self.b, self.heads, self.len, self.len], seed, DType::F64));
        let v: Vec<f64> = u.iter().map(|&u| if u < -0.5 { 0.0 } else { 1.0 / 0.75 }).collect();
        let shape = (self.b, self.heads, self.len, self.len);
        Some(Tensor::from_vec(v, shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap())
    }
}

/// The forward in f64 loops, straight from the definition.
fn loop_reference(c: Case, qkv: &[f64], bias: &[f64], mask: Option<&[f64]>) -> Vec<f64> {
    let (len, h, d) = (c.len, c.h(), c.d);
    let at = |i: usize, t: usize, part: usize, head: usize, e: usize| qkv[(i * len + t) * 3 * h + part * h + head * d + e];
    let mut out = vec![0.0; c.b * len * h];
    for i in 0..c.b {
        for head in 0..c.heads {
            for t in 0..len {
                // A causal query's later keys are left out: score -inf, probability 0.
                let scores: Vec<f64> = (0..len)
                    .map(|k| {
                        if c.causal && k > t {
                            return f64::NEG_INFINITY;
                        }
                        (0..d).map(|e| at(i, t, 0, head, e) * at(i, k, 1, head, e)).sum::<f64>() / (d as f64).sqrt()
                            + bias[i * len + k]
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                for k in 0..len {
                    let mut p = (scores[k] - m).exp() / z;
                    if let Some(mask) = mask {
                        p *= mask[((i * c.heads + head) * len + t) * len + k];
                    }
                    for e in 0..d {
                        out[(i * len + t) * h + head * d + e] += p * at(i, k, 2, head, e);
                    }
                }
            }
        }
    }
    out
}

/// The same attention from Candle's own differentiable ops (its composed softmax, batched
/// matmul, broadcasting), for the gradient.
fn candle_reference(c: Case, qkv: &Tensor, bias: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
    let (b, len, heads, d, h) = (c.b, c.len, c.heads, c.d, c.h());
    let part = |p: usize| qkv.narrow(2, p * h, h)?.reshape((b, len, heads, d))?.permute((0, 2, 1, 3))?.contiguous();
    let (q, k, v) = (part(0)?, part(1)?, part(2)?);
    let scores = q.matmul(&k.transpose(2, 3)?.contiguous()?)?.affine(1.0 / (d as f64).sqrt(), 0.0)?;
    let mut scores = scores.broadcast_add(&bias.reshape((b, 1, 1, len))?)?;
    if c.causal {
        let later: Vec<f64> = (0..len * len).map(|i| if i % len > i / len { -1e30 } else { 0.0 }).collect();
        scores = scores.broadcast_add(&Tensor::from_vec(later, (len, len), qkv.device())?.to_dtype(scores.dtype())?)?;
    }
    let mut p = candle_nn::ops::softmax(&scores, 3)?;
    if let Some(m) = mask {
        p = p.mul(m)?;
    }
    p.matmul(&v)?.permute((0, 2, 1, 3))?.contiguous()?.reshape((b, len, h))
}

/// `Σ out·w` and its gradient with respect to `qkv`.
fn loss_and_grad(f: &dyn Fn(&Tensor) -> Result<Tensor>, qkv: &Tensor, w: &Tensor) -> (Tensor, Tensor) {
    let var = Var::from_tensor(qkv).unwrap();
    let out = f(var.as_tensor()).unwrap();
    let loss = (&out * w).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    (out, grads.get(var.as_tensor()).expect("a gradient for qkv").clone())
}

const CASES: [Case; 9] = [
    Case { b: 2, len: 5, heads: 3, d: 4, dropout: false, causal: false },
    Case { b: 2, len: 5, heads: 3, d: 4, dropout: true, causal: false },
    Case { b: 3, len: 1, heads: 2, d: 3, dropout: true, causal: false },
    Case { b: 1, len: 7, heads: 1, d: 6, dropout: false, causal: false },
    // Long enough that the GEMMs take their packed paths.
    Case { b: 3, len: 40, heads: 2, d: 16, dropout: true, causal: false },
    // Causal, with and without padding bias and dropout.
    Case { b: 2, len: 5, heads: 3, d: 4, dropout: false, causal: true },
    Case { b: 2, len: 5, heads: 3, d: 4, dropout: true, causal: true },
    Case { b: 3, len: 1, heads: 2, d: 3, dropout: false, causal: true },
    Case { b: 3, len: 40, heads: 2, d: 16, dropout: true, causal: true },
];

#[test]
fn forward_and_gradient_match_the_references_in_f64_and_f32() {
    for (n, c) in CASES.into_iter().enumerate() {
        let seed = 10 * n as u64;
        let (qkv64, bias64, mask64) = (c.qkv(seed, DType::F64), c.bias(DType::F64), c.mask(seed + 1, DType::F64));
        let w64 = rand_tensor(&[c.b, c.len, c.h()], seed + 2, DType::F64);
        let expected = Tensor::from_vec(
            loop_reference(c, &to_f64_vec(&qkv64), &to_f64_vec(&bias64), mask64.as_ref().map(to_f64_vec).as_deref()),
            (c.b, c.len, c.h()),
            &Device::Cpu,
        )
        .unwrap();
        let (_, ref_grad) = loss_and_grad(&|x| candle_reference(c, x, &bias64, mask64.as_ref()), &qkv64, &w64);
        let what = format!(
            "case {n} (b {}, len {}, heads {}, d {}, dropout {}, causal {})",
            c.b, c.len, c.heads, c.d, c.dropout, c.causal
        );

        let (out, grad) = loss_and_grad(&|x| c.fused(x, &bias64, mask64.as_ref()), &qkv64, &w64);
        assert_close(&out, &expected, 1e-10, &format!("{what}: f64 output vs loops"));
        assert_close(&grad, &ref_grad, 1e-10, &format!("{what}: f64 gradient vs Candle's ops"));

        let (cout, cgrad) = loss_and_grad(&|x| c.composed(x, &bias64, mask64.as_ref()), &qkv64, &w64);
        assert_close(&cout, &expected, 1e-10, &format!("{what}: composed f64 output vs loops"));
        assert_close(&cgrad, &ref_grad, 1e-10, &format!("{what}: composed f64 gradient vs Candle's ops"));

        let f32s = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        let (bias32, mask32, w32) = (f32s(&bias64), mask64.as_ref().map(f32s), f32s(&w64));
        let (out, grad) = loss_and_grad(&|x| c.fused(x, &bias32, mask32.as_ref()), &f32s(&qkv64), &w32);
        assert_eq!(out.dtype(), DType::F32);
        assert_close(&out, &expected, 1e-5, &format!("{what}: f32 output vs f64 loops"));
        assert_close(&grad, &ref_grad, 1e-5, &format!("{what}: f32 gradient vs f64 Candle ops"));
    }
}

#[test]
fn gradient_matches_finite_differences_in_f64() {
    for c in [
        Case { b: 2, len: 3, heads: 2, d: 2, dropout: true, causal: false },
        Case { b: 2, len: 4, heads: 1, d: 3, dropout: false, causal: false },
        Case { b: 2, len: 4, heads: 2, d: 2, dropout: true, causal: true },
    ] {
        let (qkv, bias, mask) = (c.qkv(3, DType::F64), c.bias(DType::F64), c.mask(4, DType::F64));
        let w = rand_tensor(&[c.b, c.len, c.h()], 5, DType::F64);
        let f = |x: &Tensor| (c.fused(x, &bias, mask.as_ref())? * &w)?.sum_all();
        let (_, grad) = loss_and_grad(&|x| c.fused(x, &bias, mask.as_ref()), &qkv, &w);
        // Central differences at h = 1e-6: the loss's rounding over 2h and an h² term; measured
        // 9.4e-10 of the gradient's norm.
        assert_close(&grad, &fd_grad(&f, &qkv, 1e-6), 1e-8, "gradient vs finite differences");
    }
}

#[test]
fn padded_keys_contribute_exactly_nothing() {
    let c = Case { b: 3, len: 6, heads: 2, d: 3, dropout: true, causal: false };
    for dtype in [DType::F32, DType::F64] {
        let (qkv, bias, mask) = (c.qkv(7, dtype), c.bias(dtype), c.mask(8, dtype));
        // Change the keys and values of every padded position.
        let h = c.h();
        let mut v = to_f64_vec(&qkv);
        for i in 0..c.b {
            for t in c.real(i)..c.len {
                for col in h..3 * h {
                    v[(i * c.len + t) * 3 * h + col] += 5.0;
                }
            }
        }
        let changed = Tensor::from_vec(v, qkv.shape(), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
        let w = rand_tensor(&[c.b, c.len, h], 9, dtype);
        let (out, grad) = loss_and_grad(&|x| attention(x, &bias, c.heads, mask.as_ref()), &qkv, &w);
        let (out2, _) = loss_and_grad(&|x| attention(x, &bias, c.heads, mask.as_ref()), &changed, &w);
        assert_eq!(to_f64_vec(&out), to_f64_vec(&out2), "{dtype:?}: padded keys changed the output");
        let grad = to_f64_vec(&grad);
        for i in 0..c.b {
            for t in c.real(i)..c.len {
                let row = &grad[(i * c.len + t) * 3 * h..(i * c.len + t + 1) * 3 * h];
                assert!(row[h..].iter().all(|g| *g == 0.0), "{dtype:?}: a padded key or value has a gradient");
            }
        }
    }
}

#[test]
fn later_keys_contribute_exactly_nothing_to_a_causal_query() {
    let c = Case { b: 2, len: 6, heads: 2, d: 3, dropout: true, causal: true };
    let h = c.h();
    for dtype in [DType::F32, DType::F64] {
        let (qkv, bias, mask) = (c.qkv(11, dtype), c.bias(dtype), c.mask(12, dtype));
        let w = rand_tensor(&[c.b, c.len, h], 13, dtype);
        let (out, grad) = loss_and_grad(&|x| c.fused(x, &bias, mask.as_ref()), &qkv, &w);
        let (out, grad) = (to_f64_vec(&out), to_f64_vec(&grad));
        // Changing the keys and values from position `from` on leaves every earlier output as it was.
        for from in 1..c.len {
            let mut v = to_f64_vec(&qkv);
            for i in 0..c.b {
                for t in from..c.len {
                    v[(i * c.len + t) * 3 * h + h..(i * c.len + t + 1) * 3 * h].iter_mut().for_each(|x| *x += 5.0);
                }
            }
            let changed = Tensor::from_vec(v, qkv.shape(), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
            let out2 = to_f64_vec(&c.fused(&changed, &bias, mask.as_ref()).unwrap());
            for i in 0..c.b {
                let rows = (i * c.len) * h..(i * c.len + from) * h;
                assert_eq!(out[rows.clone()], out2[rows], "{dtype:?}: keys from {from} on changed an earlier query's output");
            }
        }
        // The last position's key and value reach no query but the last one's own: with the
        // upstream gradient of every other row zero, they get none.
        // Row j / h is position 0 of its sequence when it is a multiple of the length.
        let wl: Vec<f64> = (0..c.b * c.len * h).map(|j| if (j / h).is_multiple_of(c.len) { 1.0 } else { 0.0 }).collect();
        let wl = Tensor::from_vec(wl, (c.b, c.len, h), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
        let (_, g0) = loss_and_grad(&|x| c.fused(x, &bias, mask.as_ref()), &qkv, &wl);
        let g0 = to_f64_vec(&g0);
        for i in 0..c.b {
            for t in 1..c.len {
                let row = &g0[(i * c.len + t) * 3 * h..(i * c.len + t + 1) * 3 * h];
                assert!(row.iter().all(|g| *g == 0.0), "{dtype:?}: position {t} got a gradient from query 0 alone");
            }
        }
        assert!(grad.iter().any(|g| *g != 0.0));
    }
}

#[test]
fn no_gradient_reaches_the_bias_or_the_mask() {
    let c = Case { b: 2, len: 3, heads: 1, d: 2, dropout: true, causal: false };
    let qkv = Var::from_tensor(&c.qkv(1, DType::F64)).unwrap();
    let bias = Var::from_tensor(&c.bias(DType::F64)).unwrap();
    let mask = Var::from_tensor(&c.mask(2, DType::F64).unwrap()).unwrap();
    let loss = attention(qkv.as_tensor(), bias.as_tensor(), 1, Some(mask.as_tensor())).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    assert!(grads.get(qkv.as_tensor()).is_some());
    assert!(grads.get(bias.as_tensor()).is_none() && grads.get(mask.as_tensor()).is_none());
}

#[test]
fn bad_shapes_and_dtypes_are_errors_that_name_them() {
    let c = Case { b: 2, len: 3, heads: 2, d: 2, dropout: true, causal: false };
    let (qkv, bias, mask) = (c.qkv(1, DType::F32), c.bias(DType::F32), c.mask(2, DType::F32).unwrap());
    let e = err_text(attention(&qkv.flatten_all().unwrap(), &bias, 2, None));
    assert!(e.contains("attention") && e.contains("[batch, length, 3 x hidden]"), "{e}");
    let e = err_text(attention(&qkv, &bias, 5, None));
    assert!(e.contains("qkv") && e.contains("5 heads"), "{e}");
    let e = err_text(attention(&qkv, &bias, 0, None));
    assert!(e.contains("0 heads"), "{e}");
    let e = err_text(attention(&qkv, &bias.t().unwrap(), 2, None));
    assert!(e.contains("key bias") && e.contains("[2, 3]"), "{e}");
    let e = err_text(attention(&qkv, &bias, 2, Some(&mask.narrow(3, 0, 2).unwrap())));
    assert!(e.contains("dropout mask") && e.contains("[2, 2, 3, 3]"), "{e}");
    let e = err_text(attention(&qkv, &bias.to_dtype(DType::F64).unwrap(), 2, Some(&mask)));
    assert!(e.contains("dtype") && e.contains("F64"), "{e}");
}
