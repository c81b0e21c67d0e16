//! The optimizer's in-place updates of CUDA parameters (`optim.cu`), for allgrad-train's fused
//! optimizer: each pass over a parameter is one kernel (AdamW: the two moments and the step;
//! SGD: the momentum buffer and the step), where the composed Candle ops take a kernel and a
//! fresh tensor per arithmetic operation (about fifteen for an AdamW step). The kernels
//! evaluate the CPU kernels' expressions in the same order (no contracted multiply-adds), so
//! that a GPU update can equal the CPU's to the last bit; the GPU test
//! (`crates/allgrad-train/tests/optim_cuda.rs`) checks it to f64 1e-10 and f32 1e-5. f32 and
//! f64; contiguous operands of one length.
//!
//! Each takes a `guard`: `None`, or a one-element u8 tensor on the device (the trainer's
//! "loss and gradient norm are finite" flag); a zero flag makes the kernel leave its operand
//! unchanged, so a non-finite step is skipped on the device without a read before the update.

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{CudaView, PushKernelArg};
use candle_core::cuda::{CudaDType, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result, Storage, Tensor, WithDType};

use super::{elementwise, enabled, view};
use crate::error::{fail, NnError};

/// The name the PTX module is loaded under on each device.
const MODULE: &str = "allgrad_nn_optim";

/// Whether the optimizer kernels are on: the fused kernels' switch (`ALLGRAD_CUDA_FUSED=0`
/// turns both off).
pub fn optimizer_kernels_on() -> bool {
    enabled()
}

/// SGD's coefficients, as in allgrad-train's `OptimConfig::Sgd`.
#[derive(Clone, Copy, Debug)]
pub struct SgdCoefficients {
    /// μ (0: none).
    pub momentum: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// L2 weight decay added to the gradient (0: none).
    pub weight_decay: f64,
    /// The learning rate of this step.
    pub lr: f64,
}

/// AdamW's step coefficients: the bias corrections `1 − β^t`, ε, the decoupled weight decay
/// and the learning rate.
#[derive(Clone, Copy, Debug)]
pub struct AdamCoefficients {
    /// `1 − β₁^t`.
    pub bc1: f64,
    /// `1 − β₂^t`.
    pub bc2: f64,
    /// ε.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// The learning rate of this step.
    pub lr: f64,
}

fn same_len(op: &'static str, first: &Layout, others: &[&Layout]) -> Result<usize> {
    let n = first.shape().elem_count();
    if others.iter().any(|l| l.shape().elem_count() != n) {
        let mut shapes = vec![first.shape().clone()];
        shapes.extend(others.iter().map(|l| l.shape().clone()));
        return fail(NnError::ShapeMismatch { op, shapes });
    }
    Ok(n)
}

/// The mutable view of a contiguous layout of `s`.
fn view_mut<'a, T: CudaDType>(
    s: &'a mut CudaStorage,
    l: &Layout,
    op: &'static str,
) -> Result<candle_core::cuda::cudarc::driver::CudaViewMut<'a, T>> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(s.as_cuda_slice_mut::<T>()?.slice_mut(a..b)),
        None => candle_core::bail!("allgrad-nn internal error: {op} on CUDA was given a non-contiguous operand"),
    }
}

/// Runs `$body` with `$t` bound to f32 or f64, the dtype of `$dt`.
macro_rules! float_dtype {
    ($dt:expr, $op:expr, <$t:ident> $body:expr) => {
        match $dt {
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::F64 => {
                type $t = f64;
                $body
            }
            dtype => return fail(NnError::UnsupportedDType { op: $op, dtype }),
        }
    };
}

fn func(s: &CudaStorage, name: &str, op: &'static str) -> Result<candle_core::cuda::cudarc::driver::CudaFunction> {
    let suffix = match s.dtype() {
        DType::F32 => "f32",
        DType::F64 => "f64",
        dtype => return fail(NnError::UnsupportedDType { op, dtype }),
    };
    Ok(s.device.get_or_load_custom_func(&format!("{name}_{suffix}"), MODULE, super::ptx::OPTIM)?.into_cuda_function())
}

/// The guard's flag as a device view (checked: one u8 on the device), held while `f` launches.
fn with_guard<R>(guard: Option<&Tensor>, op: &'static str, f: impl FnOnce(Option<CudaView<'_, u8>>) -> Result<R>) -> Result<R> {
    let Some(t) = guard else { return f(None) };
    if t.dtype() != DType::U8 || t.elem_count() != 1 {
        candle_core::bail!("{op}: the guard must be one u8 flag, got {:?} {:?}", t.dtype(), t.dims());
    }
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(s) = &*storage else { return fail(NnError::DeviceMismatch { op }) };
    f(Some(view::<u8>(s, layout, op)?))
}

fn check_dtypes(op: &'static str, first: &CudaStorage, others: &[&CudaStorage]) -> Result<()> {
    if others.iter().any(|s| s.dtype() != first.dtype()) {
        let mut dtypes = vec![first.dtype()];
        dtypes.extend(others.iter().map(|s| s.dtype()));
        return fail(NnError::DTypeMismatch { op, what: "parameter, gradient and state", dtypes });
    }
    Ok(())
}

/// AdamW's moment in place: `m ← β·m + (1−β)·g`, or `(1−β)·g²` when `squared`.
pub fn adam_moment(
    m: &mut CudaStorage,
    lm: &Layout,
    g: &CudaStorage,
    lg: &Layout,
    beta: f64,
    squared: bool,
    guard: Option<&Tensor>,
) -> Result<()> {
    const OP: &str = "AdamW moment";
    check_dtypes(OP, m, &[g])?;
    let n = same_len(OP, lm, &[lg])?;
    let f = func(m, "adam_moment", OP)?;
    let stream = m.device.cuda_stream();
    with_guard(guard, OP, |ok| {
        float_dtype!(m.dtype(), OP, <T> {
            let gv: CudaView<T> = view::<T>(g, lg, OP)?;
            let (b, one_b, sq) = (T::from_f64(beta), T::from_f64(1.0 - beta), i32::from(squared));
            let mut mv = view_mut::<T>(m, lm, OP)?;
            if n > 0 {
                let mut builder = stream.launch_builder(&f);
                builder.arg(&n).arg(&mut mv).arg(&gv).arg(&b).arg(&one_b).arg(&sq);
                let guarded = i32::from(ok.is_some());
                match &ok {
                    Some(ok) => builder.arg(ok),
                    // Not read (guarded = 0): any device pointer.
                    None => builder.arg(&gv),
                };
                builder.arg(&guarded);
                // SAFETY: `m` and `g` hold `n` elements of T each, `ok` one byte when guarded; the
                // argument types match the kernel's signature.
                unsafe { builder.launch(elementwise(n)) }.w()?;
            }
        });
        Ok(())
    })
}

/// AdamW's step in place: `w ← w − lr·(m̂ / (√v̂ + ε) + wd·w)`, `m̂ = m / bc1`, `v̂ = v / bc2`.
pub fn adam_step(
    w: &mut CudaStorage,
    lw: &Layout,
    (m, lm): (&CudaStorage, &Layout),
    (v, lv): (&CudaStorage, &Layout),
    c: AdamCoefficients,
    guard: Option<&Tensor>,
) -> Result<()> {
    const OP: &str = "AdamW step";
    check_dtypes(OP, w, &[m, v])?;
    let n = same_len(OP, lw, &[lm, lv])?;
    let f = func(w, "adam_step", OP)?;
    let stream = w.device.cuda_stream();
    with_guard(guard, OP, |ok| {
        float_dtype!(w.dtype(), OP, <T> {
            let (mv, vv): (CudaView<T>, CudaView<T>) = (view::<T>(m, lm, OP)?, view::<T>(v, lv, OP)?);
            let k = |x: f64| T::from_f64(x);
            let (bc1, bc2, eps, wd, lr) = (k(c.bc1), k(c.bc2), k(c.eps), k(c.weight_decay), k(c.lr));
            let mut wv = view_mut::<T>(w, lw, OP)?;
            if n > 0 {
                let mut builder = stream.launch_builder(&f);
                builder.arg(&n).arg(&mut wv).arg(&mv).arg(&vv).arg(&bc1).arg(&bc2).arg(&eps).arg(&wd).arg(&lr);
                let guarded = i32::from(ok.is_some());
                match &ok {
                    Some(ok) => builder.arg(ok),
                    None => builder.arg(&mv),
                };
                builder.arg(&guarded);
                // SAFETY: `w`, `m` and `v` hold `n` elements of T each, `ok` one byte when guarded;
                // the argument types match.
                unsafe { builder.launch(elementwise(n)) }.w()?;
            }
        });
        Ok(())
    })
}

/// SGD's momentum buffer in place: `buf ← μ·buf + g + wd·w`.
pub fn sgd_momentum(
    buf: &mut CudaStorage,
    lb: &Layout,
    (g, lg): (&CudaStorage, &Layout),
    (w, lw): (&CudaStorage, &Layout),
    c: SgdCoefficients,
    guard: Option<&Tensor>,
) -> Result<()> {
    const OP: &str = "SGD momentum";
    check_dtypes(OP, buf, &[g, w])?;
    let n = same_len(OP, lb, &[lg, lw])?;
    let f = func(buf, "sgd_momentum", OP)?;
    let stream = buf.device.cuda_stream();
    with_guard(guard, OP, |ok| {
        float_dtype!(buf.dtype(), OP, <T> {
            let (gv, wv): (CudaView<T>, CudaView<T>) = (view::<T>(g, lg, OP)?, view::<T>(w, lw, OP)?);
            let (mo, wd, decay) = (T::from_f64(c.momentum), T::from_f64(c.weight_decay), i32::from(c.weight_decay > 0.0));
            let mut bv = view_mut::<T>(buf, lb, OP)?;
            if n > 0 {
                let mut builder = stream.launch_builder(&f);
                builder.arg(&n).arg(&mut bv).arg(&gv).arg(&wv).arg(&mo).arg(&wd).arg(&decay);
                let guarded = i32::from(ok.is_some());
                match &ok {
                    Some(ok) => builder.arg(ok),
                    None => builder.arg(&gv),
                };
                builder.arg(&guarded);
                // SAFETY: `buf`, `g` and `w` hold `n` elements of T each, `ok` one byte when
                // guarded; the argument types match.
                unsafe { builder.launch(elementwise(n)) }.w()?;
            }
        });
        Ok(())
    })
}

/// SGD's step in place from `g` and the already updated momentum buffer (`buf`, ignored
/// without momentum): `d = g + wd·w`; with momentum `d = buf` or, Nesterov, `d + μ·buf`;
/// `w ← w − lr·d`.
pub fn sgd_step(
    w: &mut CudaStorage,
    lw: &Layout,
    (g, lg): (&CudaStorage, &Layout),
    (buf, lb): (&CudaStorage, &Layout),
    c: SgdCoefficients,
    guard: Option<&Tensor>,
) -> Result<()> {
    const OP: &str = "SGD step";
    check_dtypes(OP, w, &[g, buf])?;
    let n = same_len(OP, lw, &[lg, lb])?;
    let f = func(w, "sgd_step", OP)?;
    let stream = w.device.cuda_stream();
    with_guard(guard, OP, |ok| {
        float_dtype!(w.dtype(), OP, <T> {
            let (gv, bv): (CudaView<T>, CudaView<T>) = (view::<T>(g, lg, OP)?, view::<T>(buf, lb, OP)?);
            let k = |x: f64| T::from_f64(x);
            let (mo, wd, lr) = (k(c.momentum), k(c.weight_decay), k(c.lr));
            let flags = (i32::from(c.weight_decay > 0.0), i32::from(c.momentum > 0.0), i32::from(c.nesterov));
            let mut wv = view_mut::<T>(w, lw, OP)?;
            if n > 0 {
                let mut builder = stream.launch_builder(&f);
                builder.arg(&n).arg(&mut wv).arg(&gv).arg(&bv).arg(&mo).arg(&wd).arg(&lr).arg(&flags.0).arg(&flags.1).arg(&flags.2);
                let guarded = i32::from(ok.is_some());
                match &ok {
                    Some(ok) => builder.arg(ok),
                    None => builder.arg(&gv),
                };
                builder.arg(&guarded);
                // SAFETY: `w`, `g` and `buf` hold `n` elements of T each, `ok` one byte when
                // guarded; the argument types match.
                unsafe { builder.launch(elementwise(n)) }.w()?;
            }
        });
        Ok(())
    })
}
