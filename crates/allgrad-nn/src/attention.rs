//! Multi-head scaled dot-product self-attention over packed projections, as one op with a
//! one-op backward.
//!
//! Composed from Candle ops, a transformer's attention is about fifteen graph nodes a layer:
//! each projection's head split (narrow, reshape, transpose, contiguous copy), the scores'
//! matmul with a transposed key, the scale, the mask bias, softmax, dropout, the context's
//! matmul and the merge of the heads. Each node is a pass over its input in the forward, and
//! in the backward Candle adds each node's input gradient into a fresh zero tensor: on a CPU
//! those passes cost about as much as the attention's arithmetic.
//!
//! Here one op takes the packed projections `[b, len, 3·h]` (one GEMM of the stacked query,
//! key and value weights) and, per sequence and head, computes the scores, softmax, dropout
//! and the context with small GEMMs on strided views, writing the heads merged. The backward
//! recomputes the probabilities (`2·len²·d` multiply-adds per head, a small share of the
//! projections' work) rather than keeping them, and writes `∂qkv` in the same packed layout.
//! Sequences run in parallel.

use std::borrow::Cow;

use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Storage, Tensor};
use gemm::Parallelism;
use rayon::prelude::*;

use crate::backend::cpu_float;
use crate::cpu::{contiguous, matmul, narrow, widen, zeros, Float, MatRef};
use crate::error::{fail, NnError};
use crate::simd::SimdPlan;

const OP: &str = "attention";

/// Added to the scores of keys a causal query may not see, in the composed form (the fused
/// kernel leaves them out of the softmax); exp of it underflows to exactly 0.
const LATER: f64 = -1e30;

/// Batch, length, heads and head size of one call.
#[derive(Clone, Copy, Debug)]
struct Dims {
    b: usize,
    len: usize,
    heads: usize,
    d: usize,
    /// Each query sees only the keys at its position and before (a causal mask).
    causal: bool,
}

impl Dims {
    fn hidden(&self) -> usize {
        self.heads * self.d
    }
}

/// Multi-head self-attention `softmax(Q·Kᵀ/√d + bias)·V` with the heads merged.
///
/// - `qkv` `[b, len, 3·h]`: for each position its query, key and value vectors side by side
///   (`h = heads·d`; head `j` in columns `j·d..(j+1)·d` of each part), as one linear layer
///   with the three weights stacked computes them.
/// - `key_bias` `[b, len]`: added to every score of that key (0 for a token, a large negative
///   number for padding). A constant: no gradient flows into it.
/// - `dropout`: an optional scaled keep mask `[b, heads, len, len]` multiplied into the
///   probabilities (a constant).
///
/// Returns the context `[b, len, h]`. On the CPU (f32/f64, and bf16 computed in f32 with an f32
/// bias and mask) a fused kernel, differentiable in `qkv`; elsewhere [`attention_composed`].
///
/// # Errors
/// When the shapes do not fit together (`3·h` not divisible into `heads`, a bias or mask of
/// another shape), or the dtypes or devices differ.
pub fn attention(qkv: &Tensor, key_bias: &Tensor, heads: usize, dropout: Option<&Tensor>) -> Result<Tensor> {
    fused(qkv, key_bias, heads, dropout, false)
}

/// [`attention`] with a causal mask: query `t` sees the keys `0..=t` only (a text
/// transformer's decoder-style attention, as CLIP's text tower runs it), its scores of later
/// keys left out of the softmax (their probabilities exactly 0). On the CPU the same fused
/// kernel; elsewhere [`causal_attention_composed`].
///
/// # Errors
/// As [`attention`].
pub fn causal_attention(qkv: &Tensor, key_bias: &Tensor, heads: usize, dropout: Option<&Tensor>) -> Result<Tensor> {
    fused(qkv, key_bias, heads, dropout, true)
}

fn fused(qkv: &Tensor, key_bias: &Tensor, heads: usize, dropout: Option<&Tensor>, causal: bool) -> Result<Tensor> {
    let _timer = crate::trace::OpTimer::start("attention", crate::trace::Pass::Forward, qkv.device());
    let dims = Dims { causal, ..check(qkv, key_bias, heads, dropout)? };
    if cpu_float(qkv) {
        // With bf16 projections (autocast) the kernel computes in f32: f32 constants.
        let consts = if qkv.dtype() == DType::BF16 {
            let mask = dropout.map(|m| m.to_dtype(DType::F32)).transpose()?;
            Consts::new(&key_bias.to_dtype(DType::F32)?, mask.as_ref())
        } else {
            Consts::new(key_bias, dropout)
        };
        return qkv.apply_op1(AttentionOp { consts, dims });
    }
    let key_bias = key_bias.to_dtype(qkv.dtype())?;
    let mask = dropout.map(|m| m.to_dtype(qkv.dtype())).transpose()?;
    composed(qkv, &key_bias, dims, mask.as_ref())
}

/// [`attention`] written with Candle's differentiable ops (the path for other devices and
/// dtypes): the heads split and merged by reshape and transpose, batched matmuls, and
/// allgrad-nn's softmax and dropout.
///
/// # Errors
/// As [`attention`].
pub fn attention_composed(qkv: &Tensor, key_bias: &Tensor, heads: usize, dropout: Option<&Tensor>) -> Result<Tensor> {
    let dims = check(qkv, key_bias, heads, dropout)?;
    let key_bias = key_bias.to_dtype(qkv.dtype())?;
    let mask = dropout.map(|m| m.to_dtype(qkv.dtype())).transpose()?;
    composed(qkv, &key_bias, dims, mask.as_ref())
}

/// [`causal_attention`] written with Candle's differentiable ops: [`attention_composed`] with
/// a large negative number added to the scores of later keys (made on the device).
///
/// # Errors
/// As [`attention`].
pub fn causal_attention_composed(qkv: &Tensor, key_bias: &Tensor, heads: usize, dropout: Option<&Tensor>) -> Result<Tensor> {
    let dims = Dims { causal: true, ..check(qkv, key_bias, heads, dropout)? };
    let key_bias = key_bias.to_dtype(qkv.dtype())?;
    let mask = dropout.map(|m| m.to_dtype(qkv.dtype())).transpose()?;
    composed(qkv, &key_bias, dims, mask.as_ref())
}

fn composed(qkv: &Tensor, key_bias: &Tensor, dims: Dims, dropout: Option<&Tensor>) -> Result<Tensor> {
    let Dims { b, len, heads, d, causal } = dims;
    let h = dims.hidden();
    let split = |part: usize| -> Result<Tensor> {
        qkv.narrow(2, part * h, h)?.contiguous()?.reshape((b, len, heads, d))?.transpose(1, 2)?.contiguous()
    };
    let (q, k, v) = (split(0)?, split(1)?, split(2)?);
    let mut scores = (q.matmul(&k.t()?)? / (d as f64).sqrt())?.broadcast_add(&key_bias.reshape((b, 1, 1, len))?)?;
    if causal {
        // LATER above the diagonal (key k > query t), 0 elsewhere, from position numbers
        // kept on the device (no upload).
        let pos = crate::transfer::numbers(len, qkv.device())?;
        let later = pos.reshape((1, len))?.broadcast_gt(&pos.reshape((len, 1))?)?.to_dtype(scores.dtype())?;
        scores = scores.broadcast_add(&later.affine(LATER, 0.0)?)?;
    }
    let mut probs = crate::softmax_last_dim(&scores)?;
    if let Some(mask) = dropout {
        probs = crate::dropout_mask(&probs, mask, None)?;
    }
    probs.matmul(&v)?.transpose(1, 2)?.contiguous()?.reshape((b, len, h))
}

fn check(qkv: &Tensor, key_bias: &Tensor, heads: usize, dropout: Option<&Tensor>) -> Result<Dims> {
    let &[b, len, width] = qkv.dims() else {
        return fail(NnError::InputRank {
            op: OP,
            expected: "[batch, length, 3 x hidden]: the packed query, key and value",
            shape: qkv.shape().clone(),
        });
    };
    if heads == 0 || width % (3 * heads) != 0 {
        return fail(NnError::ParamShape {
            op: OP,
            what: "qkv",
            shape: vec![qkv.shape().clone()],
            expected: format!("its last dimension must be 3 x {heads} heads x the head size"),
        });
    }
    let dims = Dims { b, len, heads, d: width / (3 * heads), causal: false };
    if key_bias.dims() != [b, len] {
        return fail(NnError::ParamShape {
            op: OP,
            what: "key bias",
            shape: vec![key_bias.shape().clone()],
            expected: format!("it must be [batch, length] = [{b}, {len}]"),
        });
    }
    if let Some(mask) = dropout {
        if mask.dims() != [b, heads, len, len] {
            return fail(NnError::ParamShape {
                op: OP,
                what: "dropout mask",
                shape: vec![mask.shape().clone()],
                expected: format!("it must be [batch, heads, length, length] = [{b}, {heads}, {len}, {len}]"),
            });
        }
    }
    let others = [Some(key_bias), dropout];
    let dtypes: Vec<DType> = [Some(qkv)].into_iter().chain(others).flatten().map(Tensor::dtype).collect();
    // bf16 projections (autocast) take the model's f32 constants.
    let fits = |d: &DType| *d == qkv.dtype() || (qkv.dtype() == DType::BF16 && *d == DType::F32);
    if !dtypes.iter().all(fits) {
        return fail(NnError::DTypeMismatch { op: OP, what: "qkv, key bias and dropout mask", dtypes });
    }
    if others.into_iter().flatten().any(|t| !t.device().same_device(qkv.device())) {
        return fail(NnError::DeviceMismatch { op: OP });
    }
    Ok(dims)
}

/// The constant inputs (no gradient), held by the op and read from their storage.
#[derive(Clone)]
struct Consts {
    bias: Tensor,
    mask: Option<Tensor>,
}

impl Consts {
    fn new(bias: &Tensor, mask: Option<&Tensor>) -> Self {
        Consts { bias: bias.detach(), mask: mask.map(Tensor::detach) }
    }

    /// Runs `f(bias, mask)` on the CPU slices of the constants.
    fn with<T: Float, R>(&self, f: impl FnOnce(&[T], Option<&[T]>) -> Result<R>) -> Result<R> {
        fn slice<'a, T: Float>(s: &'a Storage, l: &Layout) -> Result<Cow<'a, [T]>> {
            match s {
                Storage::Cpu(c) => Ok(contiguous(c.as_slice::<T>()?, l)),
                _ => fail(NnError::DeviceMismatch { op: OP }),
            }
        }
        let (bias_storage, bias_layout) = self.bias.storage_and_layout();
        let bias = slice::<T>(&bias_storage, bias_layout)?;
        let mask_storage = self.mask.as_ref().map(Tensor::storage_and_layout);
        let mask = match &mask_storage {
            Some((s, l)) => Some(slice::<T>(s, l)?),
            None => None,
        };
        f(&bias, mask.as_deref())
    }
}

struct AttentionOp {
    consts: Consts,
    dims: Dims,
}

impl CustomOp1 for AttentionOp {
    fn name(&self) -> &'static str {
        "allgrad-attention"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let dims = self.dims;
        let level = crate::simd::for_kernel()?;
        let out = match s {
            CpuStorage::F32(x) => CpuStorage::F32(self.consts.with(|b, m| Ok(forward(&contiguous(x, l), b, m, dims, level)))?),
            CpuStorage::F64(x) => CpuStorage::F64(self.consts.with(|b, m| Ok(forward(&contiguous(x, l), b, m, dims, level)))?),
            // bf16 (autocast): computed in f32, the context rounded to bf16 (see `float_kernel`).
            CpuStorage::BF16(x) => {
                let x = widen(&contiguous(x, l));
                CpuStorage::BF16(narrow(self.consts.with(|b, m| Ok(forward::<f32>(&x, b, m, dims, level)))?))
            }
            other => {
                return fail(NnError::UnsupportedDType { op: OP, dtype: candle_core::backend::BackendStorage::dtype(other) })
            }
        };
        Ok((out, Shape::from((dims.b, dims.len, dims.hidden()))))
    }

    fn bwd(&self, qkv: &Tensor, _ctx: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let _timer = crate::trace::OpTimer::start("attention", crate::trace::Pass::Backward, qkv.device());
        let Dims { b, len, .. } = self.dims;
        let expected = vec![b, len, self.dims.hidden()];
        if grad.dims() != expected.as_slice() {
            return fail(NnError::GradShape { op: OP, got: grad.shape().clone(), expected });
        }
        let op = AttentionBackward { consts: self.consts.clone(), dims: self.dims };
        Ok(Some(qkv.detach().apply_op2_no_bwd(&grad.detach().to_dtype(qkv.dtype())?, &op)?))
    }
}

/// The backward's kernel as an untracked op on `(qkv, ∂context)`, giving `∂qkv`.
struct AttentionBackward {
    consts: Consts,
    dims: Dims,
}

impl CustomOp2 for AttentionBackward {
    fn name(&self) -> &'static str {
        "allgrad-attention-backward"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let dims = self.dims;
        let level = crate::simd::for_kernel()?;
        let out = match (s1, s2) {
            (CpuStorage::F32(x), CpuStorage::F32(g)) => {
                CpuStorage::F32(self.consts.with(|b, m| Ok(backward(&contiguous(x, l1), &contiguous(g, l2), b, m, dims, level)))?)
            }
            (CpuStorage::F64(x), CpuStorage::F64(g)) => {
                CpuStorage::F64(self.consts.with(|b, m| Ok(backward(&contiguous(x, l1), &contiguous(g, l2), b, m, dims, level)))?)
            }
            (CpuStorage::BF16(x), CpuStorage::BF16(g)) => {
                let (x, g) = (widen(&contiguous(x, l1)), widen(&contiguous(g, l2)));
                CpuStorage::BF16(narrow(self.consts.with(|b, m| Ok(backward::<f32>(&x, &g, b, m, dims, level)))?))
            }
            (other, _) => {
                return fail(NnError::UnsupportedDType { op: OP, dtype: candle_core::backend::BackendStorage::dtype(other) })
            }
        };
        Ok((out, l1.shape().clone()))
    }
}

/// `p` (`len x len`) ← the probabilities `softmax(Q·Kᵀ·scale + bias)` of one sequence's
/// head, before dropout; `x` is the sequence's packed `qkv` (`len x 3h`).
fn probabilities<T: Float>(x: &[T], bias: &[T], head: usize, dims: Dims, p: &mut [T], scratch: &mut [T], level: SimdPlan) {
    let (len, h, d) = (dims.len, dims.hidden(), dims.d);
    let scale = T::from_f64(1.0 / (d as f64).sqrt());
    // Q (len x d) at columns head·d of the query part; Kᵀ (d x len): element (c, k) is
    // x[k·3h + h + head·d + c].
    let q = MatRef::new(&x[head * d..], 3 * h, 1);
    let kt = MatRef::new(&x[h + head * d..], 1, 3 * h);
    matmul(p, len, false, q, kt, (len, len, d), Parallelism::None);
    for (t, row) in p.chunks_mut(len).enumerate() {
        // Causal: the keys after `t` get probability exactly 0, the softmax runs over the rest.
        let seen = if dims.causal { t + 1 } else { len };
        let (row, later) = row.split_at_mut(seen);
        row.iter_mut().zip(bias).for_each(|(s, &b)| *s = *s * scale + b);
        softmax_row(row, scratch, level);
        later.fill(T::from_f64(0.0));
    }
}

/// `row ← softmax(row)` (a row of only `-inf` gives zeros), with the vectorised `exp`.
fn softmax_row<T: Float>(row: &mut [T], scratch: &mut [T], level: SimdPlan) {
    let mut m = T::NEG_INFINITY;
    for &v in row.iter() {
        if v > m || v.is_nan() {
            m = v;
        }
    }
    if m == T::NEG_INFINITY {
        row.fill(T::from_f64(0.0));
        return;
    }
    let e = &mut scratch[..row.len()];
    e.iter_mut().zip(row.iter()).for_each(|(e, &v)| *e = v - m);
    T::exp_in_place(level, e);
    let sum = e.iter().fold(T::from_f64(0.0), |a, &v| a + v);
    let inv = T::from_f64(1.0) / sum;
    row.iter_mut().zip(e.iter()).for_each(|(r, &v)| *r = v * inv);
}

fn forward<T: Float>(qkv: &[T], bias: &[T], mask: Option<&[T]>, dims: Dims, level: SimdPlan) -> Vec<T> {
    let Dims { len, heads, d, .. } = dims;
    let h = dims.hidden();
    let mut out = zeros(dims.b * len * h);
    if out.is_empty() {
        return out;
    }
    out.par_chunks_mut(len * h).enumerate().for_each(|(i, out)| {
        let x = &qkv[i * len * 3 * h..(i + 1) * len * 3 * h];
        let bias = &bias[i * len..(i + 1) * len];
        let (mut p, mut scratch) = (vec![T::from_f64(0.0); len * len], vec![T::from_f64(0.0); len]);
        for head in 0..heads {
            probabilities(x, bias, head, dims, &mut p, &mut scratch, level);
            if let Some(mask) = mask {
                let m = &mask[(i * heads + head) * len * len..][..len * len];
                p.iter_mut().zip(m).for_each(|(p, &m)| *p *= m);
            }
            // context (len x d, row stride h) = P (len x len) · V (len x d).
            let v = MatRef::new(&x[2 * h + head * d..], 3 * h, 1);
            matmul(&mut out[head * d..], h, false, MatRef::new(&p, len, 1), v, (len, d, len), Parallelism::None);
        }
    });
    out
}

/// `∂qkv` from `qkv`, the constants and `g = ∂context`, per sequence and head:
/// `∂V = P̃ᵀ·G`, `∂P̃ = G·Vᵀ`, `∂P = ∂P̃⊙M`, `∂S = P⊙(∂P − rowsum(∂P⊙P))·scale`,
/// `∂Q = ∂S·K`, `∂K = ∂Sᵀ·Q`, where `P̃ = P⊙M` is the dropped-out probabilities.
fn backward<T: Float>(qkv: &[T], g: &[T], bias: &[T], mask: Option<&[T]>, dims: Dims, level: SimdPlan) -> Vec<T> {
    let Dims { len, heads, d, .. } = dims;
    let h = dims.hidden();
    let mut dqkv = zeros(qkv.len());
    if dqkv.is_empty() {
        return dqkv;
    }
    let scale = T::from_f64(1.0 / (d as f64).sqrt());
    let zero = T::from_f64(0.0);
    dqkv.par_chunks_mut(len * 3 * h).enumerate().for_each(|(i, dx)| {
        let x = &qkv[i * len * 3 * h..(i + 1) * len * 3 * h];
        let g = &g[i * len * h..(i + 1) * len * h];
        let bias = &bias[i * len..(i + 1) * len];
        let (mut p, mut dp, mut dropped) = (vec![zero; len * len], vec![zero; len * len], vec![zero; len * len]);
        let mut scratch = vec![zero; len];
        for head in 0..heads {
            let m = mask.map(|mask| &mask[(i * heads + head) * len * len..][..len * len]);
            probabilities(x, bias, head, dims, &mut p, &mut scratch, level);
            let gh = MatRef::new(&g[head * d..], h, 1);
            let q = MatRef::new(&x[head * d..], 3 * h, 1);
            let k = MatRef::new(&x[h + head * d..], 3 * h, 1);
            // ∂P̃ (len x len) = G (len x d) · Vᵀ (d x len).
            let vt = MatRef::new(&x[2 * h + head * d..], 1, 3 * h);
            matmul(&mut dp, len, false, gh, vt, (len, len, d), Parallelism::None);
            // ∂V (len x d, in the value part) = P̃ᵀ (len x len) · G.
            let pt = match m {
                Some(m) => {
                    dropped.iter_mut().zip(&p).zip(m).for_each(|((o, &p), &m)| *o = p * m);
                    &dropped
                }
                None => &p,
            };
            matmul(&mut dx[2 * h + head * d..], 3 * h, false, MatRef::new(pt, 1, len), gh, (len, d, len), Parallelism::None);
            // ∂S into dp, row by row.
            for (r, (dpr, pr)) in dp.chunks_mut(len).zip(p.chunks(len)).enumerate() {
                if let Some(m) = m {
                    dpr.iter_mut().zip(&m[r * len..(r + 1) * len]).for_each(|(v, &m)| *v *= m);
                }
                let dot = dpr.iter().zip(pr).fold(zero, |a, (&u, &v)| a + u * v);
                dpr.iter_mut().zip(pr).for_each(|(v, &p)| *v = p * (*v - dot) * scale);
            }
            // ∂Q = ∂S (len x len) · K (len x d); ∂K = ∂Sᵀ · Q.
            matmul(&mut dx[head * d..], 3 * h, false, MatRef::new(&dp, len, 1), k, (len, d, len), Parallelism::None);
            matmul(&mut dx[h + head * d..], 3 * h, false, MatRef::new(&dp, 1, len), q, (len, d, len), Parallelism::None);
        }
    });
    dqkv
}
