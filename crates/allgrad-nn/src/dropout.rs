//! Dropout's multiply by a precomputed mask, optionally fused with the residual add that
//! follows it in a transformer block.
//!
//! `x * mask` through Candle also differentiates the mask (a multiply, a zero tensor and an add
//! in the backward, all discarded), and the residual `+ r` is one more pass and graph node.
//! Here `y = x·mask (+ r)` is one parallel pass; the backward gives `∂x = g·mask` and `∂r = g`,
//! and nothing to the mask, which is a constant (drawn by the caller, e.g. from keyed streams).

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::backend::cpu_float;
use crate::cpu::{contiguous, float_kernel, zeros, Float, GRAIN};
use crate::error::{fail, NnError};

/// `out[i] = x[i]·m[i] (+ r[i])`, in parallel.
fn kernel<T: Float>(x: &[T], m: &[T], r: Option<&[T]>) -> Vec<T> {
    let mut out = zeros(x.len());
    out.par_chunks_mut(GRAIN).enumerate().for_each(|(i, o)| {
        let at = i * GRAIN..i * GRAIN + o.len();
        let (xs, ms) = (&x[at.clone()], &m[at.clone()]);
        match r {
            None => o.iter_mut().zip(xs.iter().zip(ms)).for_each(|(o, (&x, &m))| *o = x * m),
            Some(r) => {
                let rs = &r[at];
                o.iter_mut().zip(xs.iter().zip(ms).zip(rs)).for_each(|(o, ((&x, &m), &r))| *o = x * m + r)
            }
        }
    });
    out
}

struct MaskMul;

impl CustomOp2 for MaskMul {
    fn name(&self) -> &'static str {
        "allgrad-dropout-mask"
    }

    fn cpu_fwd(&self, sx: &CpuStorage, lx: &Layout, sm: &CpuStorage, lm: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = float_kernel!("dropout_mask", sx => x, sm => m; kernel(&contiguous(x, lx), &contiguous(m, lm), None));
        Ok((out, lx.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, mask: &Tensor, _y: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(grad_x(mask, g)?), None))
    }
}

struct MaskMulAdd;

impl CustomOp3 for MaskMulAdd {
    fn name(&self) -> &'static str {
        "allgrad-dropout-mask-residual"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sm: &CpuStorage,
        lm: &Layout,
        sr: &CpuStorage,
        lr: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = float_kernel!("dropout_mask", sx => x, sm => m, sr => r;
            kernel(&contiguous(x, lx), &contiguous(m, lm), Some(&contiguous(r, lr))));
        Ok((out, lx.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        mask: &Tensor,
        _r: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        Ok((Some(grad_x(mask, g)?), None, Some(g.detach())))
    }
}

/// `g·mask`, untracked (Candle's multiply is parallel on the CPU).
fn grad_x(mask: &Tensor, g: &Tensor) -> Result<Tensor> {
    g.detach().to_dtype(mask.dtype())? * mask.detach()
}

/// `x·mask`, plus `residual` when given, with `mask` a constant (no gradient); see the module
/// docs. One parallel pass on the CPU (f32/f64); Candle's `mul` and `add` elsewhere.
///
/// # Errors
/// When the tensors differ in shape, dtype or device.
pub fn dropout_mask(x: &Tensor, mask: &Tensor, residual: Option<&Tensor>) -> Result<Tensor> {
    let all: Vec<&Tensor> = [Some(x), Some(mask), residual].into_iter().flatten().collect();
    if all.iter().any(|t| t.dims() != x.dims()) {
        return fail(NnError::ShapeMismatch { op: "dropout_mask", shapes: all.iter().map(|t| t.shape().clone()).collect() });
    }
    if all.iter().any(|t| t.dtype() != x.dtype()) {
        return fail(NnError::DTypeMismatch {
            op: "dropout_mask",
            what: "x, mask and residual",
            dtypes: all.iter().map(|t| t.dtype()).collect(),
        });
    }
    if all.iter().any(|t| !t.device().same_device(x.device())) {
        return fail(NnError::DeviceMismatch { op: "dropout_mask" });
    }
    let mask = mask.detach();
    if !cpu_float(x) {
        let y = (x * mask)?;
        return match residual {
            Some(r) => y + r,
            None => Ok(y),
        };
    }
    match residual {
        Some(r) => x.apply_op3(&mask, r, MaskMulAdd),
        None => x.apply_op2(&mask, MaskMul),
    }
}
