//! SGD and AdamW on CPU f32/f64 parameters, updated in place in one parallel pass per tensor.
//!
//! Composed from Candle ops, an AdamW step is about fifteen passes over the parameter, each
//! allocating, several of them single-threaded: on all-MiniLM-L6-v2 (22.7M parameters) it took
//! twice PyTorch's. Here the state slots and then the parameter are rewritten in place (Candle's
//! in-place custom ops), element by element with the composed path's formulas in the
//! parameter's dtype, rows in parallel; rows masked out (Partial FC's unsampled classes) are
//! not touched at all, so a step that samples a tenth of a million-class head costs a tenth of
//! the work and no copy. On CUDA (feature `cuda`) each pass is one kernel of
//! `allgrad_nn::optim_cuda` with the same expressions (no row mask there: Partial FC's masked
//! updates of a CUDA head take the composed path; `ALLGRAD_CUDA_FUSED=0` turns the kernels off).
//! LARS, other dtypes, other devices and non-contiguous tensors keep the composed path in
//! `optim/mod.rs`. A `guard` (the trainer's device-side "loss and gradient norm are finite" flag, a
//! u8 scalar) makes every pass leave its operand unchanged when the flag is 0, on the CPU and
//! in the CUDA kernels, so that a non-finite step is skipped without a read before the update. State slots are owned by the optimizer (a checkpoint reads them between steps),
//! so rewriting them in place is safe.

use candle_core::backend::BackendStorage;
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, DType, InplaceOp2, InplaceOp3, Layout, Result, Tensor, WithDType};
use rayon::prelude::*;

use crate::config::OptimConfig;

/// Elements per parallel task when no row mask splits the tensor.
const GRAIN: usize = 1 << 14;

/// Whether the fused path takes this parameter: SGD or AdamW, a contiguous f32/f64 tensor on
/// the CPU (or on CUDA with the kernels on) and a gradient of its shape, dtype and device
/// (checked before any state slot is made).
pub(crate) fn applies(cfg: &OptimConfig, w: &Tensor, g: &Tensor) -> bool {
    !matches!(cfg, OptimConfig::Lars { .. }) && matches!(w.dtype(), DType::F32 | DType::F64) && fits(w, w) && fits(g, w)
}

/// `x` is a contiguous tensor of `w`'s dtype, shape and device, on a device with kernels.
fn fits(x: &Tensor, w: &Tensor) -> bool {
    has_kernels(x) && x.device().same_device(w.device()) && x.dtype() == w.dtype() && x.dims() == w.dims() && x.is_contiguous()
}

/// The CPU, or CUDA with `allgrad_nn::optim_cuda`'s kernels on.
fn has_kernels(x: &Tensor) -> bool {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return allgrad_nn::optim_cuda::optimizer_kernels_on();
    }
    x.device().is_cpu()
}

/// Updates `w` (the parameter's own tensor) and `slots` (one per `optim::slot_names(cfg)`,
/// zeros when new) in place, and returns true; or returns false, touching nothing, when the
/// fused path does not apply ([`applies`], and slots that fit). `rows` marks the rows (dim 0) to update (absent: all);
/// `t` is the step number from 1; `guard`: see the module docs.
#[allow(clippy::too_many_arguments)]
pub(crate) fn update(
    cfg: &OptimConfig,
    w: &Tensor,
    g: &Tensor,
    slots: &[Tensor],
    rows: Option<&[bool]>,
    lr: f64,
    t: i32,
    guard: Option<&Tensor>,
) -> Result<bool> {
    if !applies(cfg, w, g) || !slots.iter().all(|s| fits(s, w)) || (rows.is_some() && !w.device().is_cpu()) {
        return Ok(false);
    }
    let n = w.elem_count();
    let per_row = if w.rank() == 0 { 1 } else { n / w.dim(0)?.max(1) };
    if let Some(r) = rows {
        if r.len() * per_row != n {
            candle_core::bail!("a row mask of {} rows for a parameter of shape {:?}", r.len(), w.dims());
        }
    }
    if let Some(g) = guard {
        if g.dtype() != DType::U8 || g.elem_count() != 1 || !g.device().same_device(w.device()) {
            candle_core::bail!(
                "optimizer: the guard must be one u8 flag on the parameter's device, got {:?} {:?}",
                g.dtype(),
                g.dims()
            );
        }
    }
    let plan = Plan { chunk: if rows.is_some() { per_row.max(1) } else { GRAIN }, rows, guard };
    match *cfg {
        OptimConfig::Sgd { momentum, nesterov, weight_decay, .. } => {
            let op = Sgd { plan, momentum, nesterov, weight_decay, lr };
            match slots {
                [buf] => {
                    buf.inplace_op3(g, w, &SgdMomentum(&op))?;
                    w.inplace_op3(g, buf, &op)?;
                }
                _ => w.inplace_op3(g, g, &op)?,
            }
        }
        OptimConfig::Adamw { beta1, beta2, eps, weight_decay, .. } => {
            let [m, v] = slots else { candle_core::bail!("AdamW keeps two state slots, got {}", slots.len()) };
            m.inplace_op2(g, &Moment { plan, beta: beta1, squared: false })?;
            v.inplace_op2(g, &Moment { plan, beta: beta2, squared: true })?;
            let (bc1, bc2) = (1.0 - beta1.powi(t), 1.0 - beta2.powi(t));
            w.inplace_op3(m, v, &Adam { plan, bc1, bc2, eps, weight_decay, lr })?;
        }
        OptimConfig::Lars { .. } => unreachable!("checked above"),
    }
    Ok(true)
}

/// How a tensor is cut into parallel tasks, which tasks (rows) are skipped, and the guard.
#[derive(Clone, Copy)]
struct Plan<'a> {
    chunk: usize,
    rows: Option<&'a [bool]>,
    guard: Option<&'a Tensor>,
}

impl Plan<'_> {
    /// Whether the guard says skip (a CPU flag read in its storage; CPU ops only).
    fn skipped(&self) -> bool {
        let Some(g) = self.guard else { return false };
        let (storage, layout) = g.storage_and_layout();
        match &*storage {
            candle_core::Storage::Cpu(s) => s.as_slice::<u8>().map(|v| v[layout.start_offset()] == 0).unwrap_or(false),
            _ => false,
        }
    }

    /// Runs `f` over the kept chunks of `dst` with the matching chunks of `a` and `b` (nothing
    /// when the guard says skip).
    fn run<T: WithDType>(&self, dst: &mut [T], a: &[T], b: &[T], f: impl Fn(&mut [T], &[T], &[T]) + Sync) {
        if self.skipped() {
            return;
        }
        let c = self.chunk;
        dst.par_chunks_mut(c).zip(a.par_chunks(c)).zip(b.par_chunks(c)).enumerate().for_each(|(i, ((d, a), b))| {
            if self.rows.is_none_or(|r| r[i]) {
                f(d, a, b)
            }
        });
    }
}

/// The contiguous elements of a storage seen through a contiguous layout.
fn view<'a, T: WithDType>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [T]> {
    let (start, end) =
        l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("optimizer: a non-contiguous operand".into()))?;
    Ok(&s.as_slice::<T>()?[start..end])
}

fn view_mut<'a, T: WithDType>(s: &'a mut CpuStorage, l: &Layout) -> Result<&'a mut [T]> {
    let (start, end) =
        l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("optimizer: a non-contiguous operand".into()))?;
    let all: &mut [T] = match s {
        CpuStorage::F32(v) => bytemuck_cast::<f32, T>(v)?,
        CpuStorage::F64(v) => bytemuck_cast::<f64, T>(v)?,
        other => candle_core::bail!("optimizer: unsupported dtype {:?}", other.dtype()),
    };
    Ok(&mut all[start..end])
}

/// `&mut [S]` as `&mut [T]` when S and T are the same type (checked), else an error.
fn bytemuck_cast<S: WithDType, T: WithDType>(v: &mut [S]) -> Result<&mut [T]> {
    if S::DTYPE != T::DTYPE {
        candle_core::bail!("optimizer: dtype {:?} where {:?} was expected", S::DTYPE, T::DTYPE);
    }
    // SAFETY: S and T have the same DType, hence are the same primitive type (f32 or f64):
    // same size, alignment and validity.
    Ok(unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<T>(), v.len()) })
}

/// Dispatches an in-place kernel body over f32/f64 storages.
macro_rules! both_floats {
    ($s1:ident, $l1:ident, [$($s:ident, $l:ident),*], |$d:ident, $($v:ident),*| $body:expr) => {
        match $s1.dtype() {
            DType::F32 => {
                let $d = view_mut::<f32>($s1, $l1)?;
                $(let $v = view::<f32>($s, $l)?;)*
                $body
            }
            DType::F64 => {
                let $d = view_mut::<f64>($s1, $l1)?;
                $(let $v = view::<f64>($s, $l)?;)*
                $body
            }
            other => candle_core::bail!("optimizer: unsupported dtype {other:?}"),
        }
    };
}

/// `m ← β·m + (1−β)·g` (or `g²`).
struct Moment<'a> {
    plan: Plan<'a>,
    beta: f64,
    squared: bool,
}

impl Moment<'_> {
    fn apply<T: WithDType>(&self, m: &mut [T], g: &[T]) {
        let (b, one_b) = (T::from_f64(self.beta), T::from_f64(1.0 - self.beta));
        let squared = self.squared;
        self.plan.run(m, g, g, |m, g, _| {
            for (m, &g) in m.iter_mut().zip(g) {
                *m = *m * b + if squared { g * g * one_b } else { g * one_b };
            }
        });
    }
}

impl InplaceOp2 for Moment<'_> {
    fn name(&self) -> &'static str {
        "allgrad-adamw-moment"
    }

    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<()> {
        both_floats!(s1, l1, [s2, l2], |m, g| self.apply(m, g));
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &mut CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<()> {
        allgrad_nn::optim_cuda::adam_moment(s1, l1, s2, l2, self.beta, self.squared, self.plan.guard)
    }
}

/// `w ← w − lr·(m̂ / (√v̂ + ε) + wd·w)` with `m̂ = m / bc1`, `v̂ = v / bc2`.
struct Adam<'a> {
    plan: Plan<'a>,
    bc1: f64,
    bc2: f64,
    eps: f64,
    weight_decay: f64,
    lr: f64,
}

impl Adam<'_> {
    fn apply<T: WithDType>(&self, w: &mut [T], m: &[T], v: &[T]) {
        let c = T::from_f64;
        let (bc1, bc2, eps, wd, lr) = (c(self.bc1), c(self.bc2), c(self.eps), c(self.weight_decay), c(self.lr));
        self.plan.run(w, m, v, |w, m, v| {
            for ((w, &m), &v) in w.iter_mut().zip(m).zip(v) {
                let step = (m / bc1) / (T::from_f64((v / bc2).to_f64().sqrt()) + eps);
                *w -= (step + *w * wd) * lr;
            }
        });
    }
}

impl InplaceOp3 for Adam<'_> {
    fn name(&self) -> &'static str {
        "allgrad-adamw-step"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<()> {
        both_floats!(s1, l1, [s2, l2, s3, l3], |w, m, v| self.apply(w, m, v));
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> Result<()> {
        let c = allgrad_nn::optim_cuda::AdamCoefficients {
            bc1: self.bc1,
            bc2: self.bc2,
            eps: self.eps,
            weight_decay: self.weight_decay,
            lr: self.lr,
        };
        allgrad_nn::optim_cuda::adam_step(s1, l1, (s2, l2), (s3, l3), c, self.plan.guard)
    }
}

/// SGD: `d = g + wd·w`; with momentum `buf ← μ·buf + d` (by [`SgdMomentum`], first) and
/// `d = buf` or, nesterov, `d + μ·buf`; then `w ← w − lr·d`.
struct Sgd<'a> {
    plan: Plan<'a>,
    momentum: f64,
    nesterov: bool,
    weight_decay: f64,
    lr: f64,
}

impl Sgd<'_> {
    /// `w ← w − lr·d` from `g` and the already updated `buf` (ignored without momentum).
    fn apply<T: WithDType>(&self, w: &mut [T], g: &[T], buf: &[T]) {
        let c = T::from_f64;
        let (mo, wd, lr) = (c(self.momentum), c(self.weight_decay), c(self.lr));
        let (with_momentum, nesterov, decay) = (self.momentum > 0.0, self.nesterov, self.weight_decay > 0.0);
        self.plan.run(w, g, buf, |w, g, buf| {
            for ((w, &g), &b) in w.iter_mut().zip(g).zip(buf) {
                let d = if decay { g + *w * wd } else { g };
                let d = match (with_momentum, nesterov) {
                    (false, _) => d,
                    (true, false) => b,
                    (true, true) => d + b * mo,
                };
                *w -= d * lr;
            }
        });
    }
}

impl InplaceOp3 for Sgd<'_> {
    fn name(&self) -> &'static str {
        "allgrad-sgd-step"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<()> {
        both_floats!(s1, l1, [s2, l2, s3, l3], |w, g, b| self.apply(w, g, b));
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> Result<()> {
        allgrad_nn::optim_cuda::sgd_step(s1, l1, (s2, l2), (s3, l3), self.coefficients(), self.plan.guard)
    }
}

impl Sgd<'_> {
    #[cfg(feature = "cuda")]
    fn coefficients(&self) -> allgrad_nn::optim_cuda::SgdCoefficients {
        allgrad_nn::optim_cuda::SgdCoefficients {
            momentum: self.momentum,
            nesterov: self.nesterov,
            weight_decay: self.weight_decay,
            lr: self.lr,
        }
    }
}

/// The momentum buffer of [`Sgd`]: `buf ← μ·buf + g + wd·w`, on `(buf, g, w)`.
struct SgdMomentum<'a, 'b>(&'b Sgd<'a>);

impl InplaceOp3 for SgdMomentum<'_, '_> {
    fn name(&self) -> &'static str {
        "allgrad-sgd-momentum"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<()> {
        let sgd = self.0;
        fn apply<T: WithDType>(sgd: &Sgd<'_>, buf: &mut [T], g: &[T], w: &[T]) {
            let (mo, wd) = (T::from_f64(sgd.momentum), T::from_f64(sgd.weight_decay));
            let decay = sgd.weight_decay > 0.0;
            sgd.plan.run(buf, g, w, |buf, g, w| {
                for ((b, &g), &w) in buf.iter_mut().zip(g).zip(w) {
                    let d = if decay { g + w * wd } else { g };
                    *b = *b * mo + d;
                }
            });
        }
        both_floats!(s1, l1, [s2, l2, s3, l3], |b, g, w| apply(sgd, b, g, w));
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> Result<()> {
        allgrad_nn::optim_cuda::sgd_momentum(s1, l1, (s2, l2), (s3, l3), self.0.coefficients(), self.0.plan.guard)
    }
}
