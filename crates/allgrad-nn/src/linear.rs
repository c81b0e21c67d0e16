//! The dense layer `y = x Wᵀ + b` over the last dimension, as one op with a one-op backward.
//!
//! Composed from Candle ops (`matmul` with `Wᵀ`, then `broadcast_add` of the bias), the forward
//! is a GEMM plus a second pass over the output, and the backward walks three graph nodes: the
//! bias gradient through a broadcast reduction, the weight gradient as a transposed (strided)
//! matrix, and each gradient added by Candle into a fresh zero tensor. A transformer has six
//! such layers per block, so on a CPU these passes are a visible share of a training step.
//!
//! Here the forward writes the bias into the output and the GEMM accumulates onto it; the
//! backward computes `∂x = g·W`, `∂W = gᵀ·x` and `∂b = Σ_rows g` in one untracked kernel, each
//! into a buffer of its own that the GEMM writes without a zero fill first. Both GEMMs run on
//! the whole rayon pool. `∂x` is left out when the input is not tracked (no variable behind
//! it: a vision tower's patch embedding on pixels), as PyTorch's autograd leaves out gradients
//! no one asked for; that is a whole GEMM of the layer's backward.
//!
//! [`linear_module`] runs a `candle_nn::Linear` through [`linear`] under autocast
//! ([`crate::autocast`]), and through its own `forward` otherwise.

use std::borrow::Cow;

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Module, Result, Shape, Tensor};
use gemm::Parallelism;
use rayon::prelude::*;

use crate::backend::cpu_float;
use crate::cpu::{
    bf16_values, bf16_with_f32, contiguous, float_kernel, matmul, matmul_new, narrow, run_split, widen, zeros, Float, MatRef,
    SplitKernel,
};
use crate::error::{fail, NnError};

/// `(rows, in, out)` of `x` `[.., in]` and `w` `[out, in]`, checked.
fn dims(x: &[usize], w: &[usize], op: &'static str) -> Result<(usize, usize, usize)> {
    let (Some((&inp, rest)), [out, w_in]) = (x.split_last(), w) else {
        return fail(NnError::ParamShape {
            op,
            what: "input and weight",
            shape: vec![Shape::from(x.to_vec()), Shape::from(w.to_vec())],
            expected: "the input needs a last dimension and the weight must be [out, in]".into(),
        });
    };
    if inp != *w_in {
        return fail(NnError::ParamShape {
            op,
            what: "weight",
            shape: vec![Shape::from(w.to_vec())],
            expected: format!("the input's last dimension is {inp}"),
        });
    }
    Ok((rest.iter().product(), inp, *out))
}

fn pool() -> Parallelism {
    Parallelism::Rayon(rayon::current_num_threads().max(1))
}

/// `out[r, o] = b[o] + Σ_i x[r, i]·w[o, i]`.
fn forward_kernel<T: Float>(x: &[T], w: &[T], b: Option<&[T]>, (rows, inp, out): (usize, usize, usize)) -> Vec<T> {
    let mut y = match b {
        Some(b) => b.repeat(rows),
        None => zeros(rows * out),
    };
    // wᵀ as an (in x out) view: element (i, o) is w[o * in + i].
    matmul(&mut y, out, b.is_some(), MatRef::new(x, inp, 1), MatRef::new(w, 1, inp), (rows, out, inp), pool());
    y
}

/// `∂x = g (rows x out) · w (out x in)`.
fn input_grad<T: Float>(g: &[T], w: &[T], (rows, inp, out): (usize, usize, usize)) -> Vec<T> {
    matmul_new(MatRef::new(g, out, 1), MatRef::new(w, inp, 1), (rows, inp, out), pool())
}

/// `∂W = gᵀ (out x rows) · x (rows x in)`.
fn weight_grad<T: Float>(g: &[T], x: &[T], (rows, inp, out): (usize, usize, usize)) -> Vec<T> {
    matmul_new(MatRef::new(g, 1, out), MatRef::new(x, inp, 1), (out, inp, rows), pool())
}

/// `∂b` = the column sums of `g`, in f64. The rows go in fixed chunks of about
/// [`BIAS_CHUNK`] elements, in parallel, each chunk summed row by row (contiguous reads) into
/// partial sums of its own, and the partials are added in chunk order: the order depends on
/// the shape only, never on the pool. (Summing blocks of 64 columns down all rows instead read
/// `g` with a stride of a whole row, beyond a page for a wide layer, and took 2-3x PyTorch's
/// `sum` on the CLIP towers' attention projections and MLPs.)
fn bias_grad<T: Float>(g: &[T], (rows, _, out): (usize, usize, usize)) -> Vec<T> {
    if out == 0 || rows == 0 {
        return zeros(out);
    }
    let rows_per_chunk = (BIAS_CHUNK / out).max(1);
    let partials: Vec<Vec<f64>> = g[..rows * out]
        .par_chunks(rows_per_chunk * out)
        .map(|chunk| {
            let mut acc = vec![0f64; out];
            for row in chunk.chunks_exact(out) {
                acc.iter_mut().zip(row).for_each(|(a, v)| *a += v.to_f64());
            }
            acc
        })
        .collect();
    let mut sum = vec![0f64; out];
    for p in &partials {
        sum.iter_mut().zip(p).for_each(|(s, v)| *s += v);
    }
    sum.into_iter().map(T::from_f64).collect()
}

/// Elements of `g` per chunk of [`bias_grad`] (whole rows; one row when a row is longer).
const BIAS_CHUNK: usize = 1 << 16;

/// `[∂x (rows·in), ∂W (out·in), ∂b (out)]` from `x`, `w` and the output gradient `g`; without
/// `∂x` unless `input`.
fn backward_kernel<T: Float>(x: &[T], w: &[T], g: &[T], d: (usize, usize, usize), input: bool) -> Vec<Vec<T>> {
    let dx = input.then(|| input_grad(g, w, d));
    dx.into_iter().chain([weight_grad(g, x, d), bias_grad(g, d)]).collect()
}

/// The kernels [`linear`] runs on the CPU, one product at a time, on f32 rows of `(rows, in,
/// out)`, for the dense-layer benchmark (`bench_dense`) to time each against PyTorch's:
/// `"fwd"` the output `x·Wᵀ + b` (`b` empty: none), `"dx"` `g·W`, `"dw"` `gᵀ·x`, `"db"` the
/// column sums of `g`. Not an API: `None` for another name.
#[doc(hidden)]
pub fn dense_product(product: &str, [x, w, b, g]: [&[f32]; 4], (rows, inp, out): (usize, usize, usize)) -> Option<Vec<f32>> {
    let d = (rows, inp, out);
    assert!(
        x.len() == rows * inp && w.len() == out * inp && g.len() == rows * out && (b.is_empty() || b.len() == out),
        "dense_product: the slices do not fit (rows, in, out) = {d:?}"
    );
    Some(match product {
        "fwd" => forward_kernel(x, w, (!b.is_empty()).then_some(b), d),
        "dx" => input_grad(g, w, d),
        "dw" => weight_grad(g, x, d),
        "db" => bias_grad(g, d),
        _ => return None,
    })
}

struct Linear {
    bias: bool,
}

impl Linear {
    fn run(&self, s: [(&CpuStorage, &Layout); 3]) -> Result<(CpuStorage, Shape)> {
        let [(sx, lx), (sw, lw), (sb, lb)] = s;
        let d = dims(lx.dims(), lw.dims(), "linear")?;
        let bias = self.bias;
        let out = match (sx, sw, sb) {
            // A bf16 input with f32 parameters (autocast): the parameters as their bf16 values.
            (CpuStorage::BF16(x), CpuStorage::F32(w), CpuStorage::F32(b)) => {
                let (x, w) = (widen(&contiguous(x, lx)), bf16_values(&contiguous(w, lw)));
                let b = bias.then(|| bf16_values(&contiguous(b, lb)));
                CpuStorage::BF16(narrow(forward_kernel(&x, &w, b.as_deref(), d)))
            }
            _ => float_kernel!("linear", sx => x, sw => w, sb => b; {
                let b: Option<Cow<[_]>> = bias.then(|| contiguous(b, lb));
                forward_kernel(&contiguous(x, lx), &contiguous(w, lw), b.as_deref(), d)
            }),
        };
        let mut shape = lx.dims().to_vec();
        *shape.last_mut().expect("checked by dims") = d.2;
        Ok((out, Shape::from(shape)))
    }

    /// `(∂x, ∂W, ∂b)`; `∂x` only when `input`.
    fn grads(x: &Tensor, w: &Tensor, g: &Tensor, input: bool) -> Result<(Option<Tensor>, Tensor, Tensor)> {
        let (rows, inp, out) = dims(x.dims(), w.dims(), "linear backward")?;
        let mut expected = x.dims().to_vec();
        *expected.last_mut().expect("checked by dims") = out;
        if g.dims() != expected.as_slice() {
            return fail(NnError::GradShape { op: "linear", got: g.shape().clone(), expected });
        }
        if bf16_with_f32(x, w) {
            // The f32 kernel on the forward's bf16 values: ∂x rounded to bf16, ∂W and ∂b f32.
            let (xf, gf) = (x.detach().to_dtype(DType::F32)?, g.detach().to_dtype(DType::BF16)?.to_dtype(DType::F32)?);
            let wf = w.detach().to_dtype(DType::BF16)?.to_dtype(DType::F32)?;
            let (dx, dw, db) = Linear::grads(&xf, &wf, &gf, input)?;
            return Ok((dx.map(|dx| dx.to_dtype(DType::BF16)).transpose()?, dw, db));
        }
        let g = g.detach().to_dtype(x.dtype())?;
        let input_shape = input.then(|| x.shape().clone());
        let shapes: Vec<Shape> = input_shape.into_iter().chain([w.shape().clone(), Shape::from(out)]).collect();
        let mut grads = run_split(&LinearBackward { dims: (rows, inp, out), input }, [x, w, &g], &shapes)?.into_iter();
        let dx = if input { grads.next() } else { None };
        let (Some(dw), Some(db)) = (grads.next(), grads.next()) else { unreachable!("one gradient per shape") };
        Ok((dx, dw, db))
    }
}

impl CustomOp2 for Linear {
    fn name(&self) -> &'static str {
        "allgrad-linear"
    }

    fn cpu_fwd(&self, sx: &CpuStorage, lx: &Layout, sw: &CpuStorage, lw: &Layout) -> Result<(CpuStorage, Shape)> {
        // No bias: the weight's storage stands in for it and is never read.
        self.run([(sx, lx), (sw, lw), (sw, lw)])
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _y: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let _timer = crate::trace::OpTimer::start("linear", crate::trace::Pass::Backward, x.device());
        // Only a tracked input can have a gradient that anyone reads.
        let (dx, dw, _) = Linear::grads(x, w, g, x.track_op())?;
        Ok((dx, Some(dw)))
    }
}

impl CustomOp3 for Linear {
    fn name(&self) -> &'static str {
        "allgrad-linear"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
        sb: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.run([(sx, lx), (sw, lw), (sb, lb)])
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let _timer = crate::trace::OpTimer::start("linear", crate::trace::Pass::Backward, x.device());
        let (dx, dw, db) = Linear::grads(x, w, g, x.track_op())?;
        Ok((dx, Some(dw), Some(db)))
    }
}

/// The backward's kernel on `(x, w, g)` of `dims` `(rows, in, out)`: `[∂x, ∂W, ∂b]`, without
/// `∂x` unless `input`.
struct LinearBackward {
    dims: (usize, usize, usize),
    input: bool,
}

impl SplitKernel<3> for LinearBackward {
    const OP: &'static str = "linear backward";

    fn run<T: Float>(&self, [(x, lx), (w, lw), (g, lg)]: [(&[T], &Layout); 3]) -> Result<Vec<Vec<T>>> {
        Ok(backward_kernel(&contiguous(x, lx), &contiguous(w, lw), &contiguous(g, lg), self.dims, self.input))
    }
}

/// `y = x·Wᵀ + b` over the last dimension of `x` (`[.., in]`, any leading dimensions), with
/// `weight` `[out, in]` and `bias` `[out]` as in PyTorch's `Linear`; see the module docs. On
/// the CPU (f32/f64, and bf16 computed in f32) one GEMM with the bias folded in and a one-op
/// backward; elsewhere Candle's `matmul` and `broadcast_add`. Under
/// [`crate::autocast::Autocast::bf16`] the input is cast to bf16 and the result is bf16; on the
/// CPU the f32 weight and bias enter the kernel rounded to bf16 and their gradients come back
/// f32 (computed in f32 from the bf16 values, unrounded), elsewhere they are cast to bf16. A
/// bf16 input with f32 parameters is computed this way without the guard as well.
///
/// # Errors
/// When the shapes do not fit together, or the dtypes or devices differ.
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let _timer = crate::trace::OpTimer::start("linear", crate::trace::Pass::Forward, x.device());
    let x = &crate::autocast::operand(x)?;
    // On the CPU a bf16 input takes the f32 parameters as they are (see above).
    let keep = bf16_with_f32(x, weight);
    let cast = |t: &Tensor| if keep { Ok(t.clone()) } else { crate::autocast::operand(t) };
    let weight = &cast(weight)?;
    let bias = bias.map(cast).transpose()?;
    let bias = bias.as_ref();
    let (rows, inp, out) = dims(x.dims(), weight.dims(), "linear")?;
    if let Some(b) = bias {
        if b.dims() != [out] {
            return fail(NnError::ParamShape {
                op: "linear",
                what: "bias",
                shape: vec![b.shape().clone()],
                expected: format!("the weight has {out} outputs"),
            });
        }
    }
    let dtypes: Vec<DType> = [Some(x), Some(weight), bias].into_iter().flatten().map(|t| t.dtype()).collect();
    let param_dtype = if keep { DType::F32 } else { x.dtype() };
    if dtypes[1..].iter().any(|d| *d != param_dtype) {
        return fail(NnError::DTypeMismatch { op: "linear", what: "input, weight and bias", dtypes });
    }
    let same_device = weight.device().same_device(x.device()) && bias.is_none_or(|b| b.device().same_device(x.device()));
    if !same_device {
        return fail(NnError::DeviceMismatch { op: "linear" });
    }
    if cpu_float(x) {
        return match bias {
            Some(b) => x.apply_op3(weight, b, Linear { bias: true }),
            None => x.apply_op2(weight, Linear { bias: false }),
        };
    }
    let mut shape = x.dims().to_vec();
    *shape.last_mut().expect("checked by dims") = out;
    let y = x.reshape((rows, inp))?.matmul(&weight.t()?)?;
    let y = match bias {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    };
    y.reshape(shape)
}

/// `layer`'s forward: under autocast ([`crate::autocast`]) [`linear`] with bf16 operands,
/// otherwise the layer's own `forward` (Candle's matmul and bias add, unchanged).
pub fn linear_module(layer: &candle_nn::Linear, x: &Tensor) -> Result<Tensor> {
    if crate::autocast::compute_dtype().is_some() {
        linear(x, layer.weight(), layer.bias())
    } else {
        layer.forward(x)
    }
}
