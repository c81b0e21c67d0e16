//! Rows scaled to unit L2 norm, as [`crate::losses::l2_normalize`] computes them, in one pass
//! each way on the CPU: the head normalises its (sampled) centres, `[c, D]`, every step, and
//! the composed form keeps their squares and passes several `[c, D]` tensors through its
//! backward; this one keeps the input and writes the gradient `(g − y·(g·y)) / ‖x‖` directly.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Storage, Tensor, WithDType};
use rayon::prelude::*;

use crate::losses::l2_normalize;

/// Norms below this are taken as this (a zero row stays zero), as in `l2_normalize`; there
/// the norm is constant, so a zero row's gradient is `g / FLOOR` (the composed form's is NaN:
/// the square root's slope at 0 times 0).
const FLOOR: f64 = 1e-12;

/// `x` `[n, d]` with each row divided by its L2 norm (at least 1e-12), differentiable. CPU
/// f32/f64 take the fused op; other devices and dtypes the composed `l2_normalize`.
pub fn unit_rows(x: &Tensor) -> Result<Tensor> {
    if !x.device().is_cpu() || !matches!(x.dtype(), DType::F32 | DType::F64) || x.rank() != 2 || x.dim(1)? == 0 {
        return l2_normalize(x);
    }
    x.contiguous()?.apply_op1(UnitRows { d: x.dim(1)? })
}

struct UnitRows {
    d: usize,
}

/// A row's norm (f64 accumulation), floored.
fn norm<T: WithDType>(row: &[T]) -> f64 {
    row.iter().map(|v| v.to_f64() * v.to_f64()).sum::<f64>().sqrt().max(FLOOR)
}

impl UnitRows {
    fn forward<T: WithDType>(&self, x: &[T]) -> Vec<T> {
        let mut y = vec![T::from_f64(0.0); x.len()];
        y.par_chunks_mut(self.d).zip(x.par_chunks(self.d)).for_each(|(y, x)| {
            let n = norm(x);
            for (y, x) in y.iter_mut().zip(x) {
                *y = T::from_f64(x.to_f64() / n);
            }
        });
        y
    }

    /// `dx = (g − y·(g·y)) / ‖x‖` where the norm is above the floor, `g / floor` below.
    fn backward<T: WithDType>(&self, x: &[T], g: &[T]) -> Vec<T> {
        let mut dx = vec![T::from_f64(0.0); x.len()];
        dx.par_chunks_mut(self.d).zip(x.par_chunks(self.d)).zip(g.par_chunks(self.d)).for_each(|((dx, x), g)| {
            let n = norm(x);
            let gy = if n > FLOOR { x.iter().zip(g).map(|(x, g)| x.to_f64() / n * g.to_f64()).sum::<f64>() } else { 0.0 };
            for ((dx, x), g) in dx.iter_mut().zip(x).zip(g) {
                *dx = T::from_f64((g.to_f64() - x.to_f64() / n * gy) / n);
            }
        });
        dx
    }
}

impl CustomOp1 for UnitRows {
    fn name(&self) -> &'static str {
        "allgrad-face-unit-rows"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let Some((lo, hi)) = layout.contiguous_offsets() else { candle_core::bail!("{}: a non-contiguous input", self.name()) };
        let out = match storage {
            CpuStorage::F32(v) => CpuStorage::F32(self.forward(&v[lo..hi])),
            CpuStorage::F64(v) => CpuStorage::F64(self.forward(&v[lo..hi])),
            other => candle_core::bail!("{}: unsupported dtype {:?}", self.name(), other.dtype()),
        };
        Ok((out, layout.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let g = grad_res.contiguous()?;
        let (xs, xl) = arg.storage_and_layout();
        let (gs, gl) = g.storage_and_layout();
        let (Some((xa, xb)), Some((ga, gb))) = (xl.contiguous_offsets(), gl.contiguous_offsets()) else {
            candle_core::bail!("{}: a non-contiguous input or gradient", self.name())
        };
        let dx = match (&*xs, &*gs) {
            (Storage::Cpu(CpuStorage::F32(x)), Storage::Cpu(CpuStorage::F32(g))) => {
                allgrad_nn::kernel_output(self.backward(&x[xa..xb], &g[ga..gb]), arg.shape().clone())?
            }
            (Storage::Cpu(CpuStorage::F64(x)), Storage::Cpu(CpuStorage::F64(g))) => {
                allgrad_nn::kernel_output(self.backward(&x[xa..xb], &g[ga..gb]), arg.shape().clone())?
            }
            _ => candle_core::bail!("{}: the input and its gradient must be f32 or f64 on the CPU", self.name()),
        };
        Ok(Some(dx))
    }
}
