//! ReLU and the residual `relu(a + b)`, fused, multi-threaded, with a one-pass backward.
//!
//! Candle's CPU `relu` is a single-threaded map, and its backward builds the mask from
//! `zeros_like`, `ge`, a dtype cast, a multiply and an add: five passes over the activation,
//! each allocating. A ResNet has one ReLU per convolution, so on a CPU these passes are a
//! visible share of a training step. Here the forward is one parallel pass, and the backward
//! one parallel pass `∂x = g · [y > 0]` reading the output `y` (for `relu(a + b)` the same
//! gradient goes to both inputs). The derivative at 0 is 0, as in PyTorch.

use std::borrow::Cow;

use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::cpu::{contiguous, float_kernel, Float};
use crate::error::{fail, NnError};

/// Elements per parallel task: large enough that a task outweighs its scheduling.
const GRAIN: usize = 1 << 15;

fn fast_path(t: &Tensor) -> bool {
    t.device().is_cpu() && matches!(t.dtype(), DType::F32 | DType::F64)
}

/// `out[i] = max(a[i] + b[i], 0)` (`b` absent: `max(a[i], 0)`), in parallel.
fn relu_kernel<T: Float>(a: &[T], b: Option<&[T]>) -> Vec<T> {
    let zero = T::from_f64(0.0);
    let mut out = vec![zero; a.len()];
    out.par_chunks_mut(GRAIN).enumerate().for_each(|(i, o)| {
        let xs = &a[i * GRAIN..i * GRAIN + o.len()];
        match b {
            None => o.iter_mut().zip(xs).for_each(|(o, &x)| *o = if x > zero { x } else { zero }),
            Some(b) => {
                let ys = &b[i * GRAIN..i * GRAIN + o.len()];
                o.iter_mut().zip(xs.iter().zip(ys)).for_each(|(o, (&x, &y))| {
                    let s = x + y;
                    *o = if s > zero { s } else { zero };
                })
            }
        }
    });
    out
}

/// `∂x[i] = g[i]` where `y[i] > 0`, else 0, in parallel.
fn mask_kernel<T: Float>(y: &[T], g: &[T]) -> Vec<T> {
    let zero = T::from_f64(0.0);
    let mut out = vec![zero; y.len()];
    out.par_chunks_mut(GRAIN).enumerate().for_each(|(i, o)| {
        let (ys, gs) = (&y[i * GRAIN..i * GRAIN + o.len()], &g[i * GRAIN..i * GRAIN + o.len()]);
        o.iter_mut().zip(ys.iter().zip(gs)).for_each(|(o, (&y, &g))| *o = if y > zero { g } else { zero });
    });
    out
}

struct Relu;

impl CustomOp1 for Relu {
    fn name(&self) -> &'static str {
        "allgrad-relu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = float_kernel!("relu", s => x; relu_kernel(&contiguous(x, l), None));
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, y: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(masked(y, g)?))
    }
}

struct AddRelu;

impl CustomOp2 for AddRelu {
    fn name(&self) -> &'static str {
        "allgrad-add-relu"
    }

    fn cpu_fwd(&self, sa: &CpuStorage, la: &Layout, sb: &CpuStorage, lb: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = float_kernel!("add_relu", sa => a, sb => b; relu_kernel(&contiguous(a, la), Some(&contiguous(b, lb))));
        Ok((out, la.shape().clone()))
    }

    fn bwd(&self, _a: &Tensor, _b: &Tensor, y: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let d = masked(y, g)?;
        Ok((Some(d.clone()), Some(d)))
    }
}

/// The backward's kernel as an untracked op on (y, g).
struct Mask;

impl CustomOp2 for Mask {
    fn name(&self) -> &'static str {
        "allgrad-relu-backward"
    }

    fn cpu_fwd(&self, sy: &CpuStorage, ly: &Layout, sg: &CpuStorage, lg: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = float_kernel!("relu backward", sy => y, sg => g; {
            let (y, g): (Cow<[_]>, Cow<[_]>) = (contiguous(y, ly), contiguous(g, lg));
            mask_kernel(&y, &g)
        });
        Ok((out, ly.shape().clone()))
    }
}

fn masked(y: &Tensor, g: &Tensor) -> Result<Tensor> {
    y.detach().apply_op2_no_bwd(&g.detach().to_dtype(y.dtype())?, &Mask)
}

/// `max(x, 0)`, fused and parallel on the CPU (f32/f64), with a one-pass backward (derivative
/// 0 at 0); Candle's `relu` elsewhere.
pub fn relu(x: &Tensor) -> Result<Tensor> {
    if !fast_path(x) {
        return x.relu();
    }
    x.apply_op1(Relu)
}

/// `max(a + b, 0)` in one pass (a residual connection and its activation), with a one-pass
/// backward giving both inputs the same gradient; `(a + b).relu()` off the fast path.
///
/// # Errors
/// When `a` and `b` differ in shape or dtype.
pub fn add_relu(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.dims() != b.dims() {
        return fail(NnError::ShapeMismatch { op: "add_relu", shapes: vec![a.shape().clone(), b.shape().clone()] });
    }
    if a.dtype() != b.dtype() {
        return fail(NnError::DTypeMismatch { op: "add_relu", what: "a and b", dtypes: vec![a.dtype(), b.dtype()] });
    }
    if !fast_path(a) || !b.device().same_device(a.device()) {
        return (a + b)?.relu();
    }
    a.apply_op2(b, AddRelu)
}
