//! The CUDA twins of the fused element-wise CPU kernels (feature `cuda`): ReLU and
//! `relu(a + b)` with their backward ([`crate::relu`], [`crate::add_relu`]), exact GELU with
//! its backward ([`crate::gelu_erf`]), layer norm with its backward ([`crate::layer_norm`], f32
//! and f64), the per-channel
//! moments ([`crate::channel_moments`]) and batch norm's forward with its tails and its
//! backward ([`crate::batch_norm`]). Each op keeps on CUDA what it keeps on the CPU (the ReLU
//! its output, batch norm its inputs and output), where Candle's CUDA ops would keep every
//! intermediate of an unfused chain.
//!
//! The kernels (`fused.cu`) are compiled to PTX at build time (build.rs, nvcc through
//! `cudaforge` as Candle builds its own) and loaded once per device through Candle's
//! `CudaDevice::get_or_load_custom_func`; they run on the device's stream. f32, f64 and bf16
//! (computed in f32, stored rounded to bf16, as on the CPU). Per-channel sums are f64, one
//! block per channel in a fixed order.
//!
//! `ALLGRAD_CUDA_FUSED=0` (read once) turns them off: CUDA tensors then take the composed
//! Candle ops as before, so a GPU session can compare the two.

use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{CudaFunction, CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda::{CudaDType, WrapErr};
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Shape, Tensor};
use half::bf16;

use crate::error::{fail, NnError};

pub(crate) mod finalize;
pub mod optim;

mod ptx {
    include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
}

/// The name the PTX module is loaded under on each device.
const MODULE: &str = "allgrad_nn_fused";

/// Threads per block of the element-wise kernels (the reductions use their own, in fused.cu).
const THREADS: u32 = 256;

/// Whether the kernels are on (`ALLGRAD_CUDA_FUSED` is not `0`); read once.
fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("ALLGRAD_CUDA_FUSED").map_or(true, |v| v.trim() != "0"))
}

/// Whether `t` takes the CUDA kernels: a CUDA tensor of f32, f64 or bf16, with the kernels on.
pub(crate) fn takes(t: &Tensor) -> bool {
    t.device().is_cuda() && matches!(t.dtype(), DType::F32 | DType::F64 | DType::BF16) && enabled()
}

/// `name` for the element type of `dt` (`relu_fwd_f32`, ...), loaded on `dev` (launched on
/// `dev.cuda_stream()`, the stream of its tensors).
fn func(dev: &CudaDevice, name: &str, dt: DType, op: &'static str) -> Result<CudaFunction> {
    let suffix = match dt {
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::BF16 => "bf16",
        dtype => return fail(NnError::UnsupportedDType { op, dtype }),
    };
    Ok(dev.get_or_load_custom_func(&format!("{name}_{suffix}"), MODULE, ptx::FUSED)?.into_cuda_function())
}

/// A grid-stride launch over `n` elements.
fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(THREADS as usize).clamp(1, 1 << 16) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }
}

/// One block per channel (the per-channel sums; fused.cu's `SUM_THREADS` threads each).
fn per_channel(c: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (c as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

/// The elements of a contiguous layout of `s` (every caller makes its inputs contiguous).
fn view<'a, T: CudaDType>(s: &'a CudaStorage, l: &Layout, op: &'static str) -> Result<CudaView<'a, T>> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(s.as_cuda_slice::<T>()?.slice(a..b)),
        None => candle_core::bail!("allgrad-nn internal error: {op} on CUDA was given a non-contiguous input"),
    }
}

/// A fresh output of `n` elements; every kernel writes all of them.
fn output<T: DeviceRepr>(dev: &CudaDevice, n: usize) -> Result<CudaSlice<T>> {
    // SAFETY: the kernel launched next writes every element before anything reads one.
    unsafe { dev.alloc::<T>(n.max(1)) }
}

/// Runs `$body` with `$t` bound to the element type of `$dt` and `$c` to its compute type (f32
/// for f32 and bf16, f64 for f64).
macro_rules! by_dtype {
    ($dt:expr, $op:expr, <$t:ident, $c:ident> $body:expr) => {
        match $dt {
            DType::F32 => {
                type $t = f32;
                #[allow(dead_code)]
                type $c = f32;
                $body
            }
            DType::F64 => {
                type $t = f64;
                #[allow(dead_code)]
                type $c = f64;
                $body
            }
            DType::BF16 => {
                type $t = bf16;
                #[allow(dead_code)]
                type $c = f32;
                $body
            }
            dtype => return fail(NnError::UnsupportedDType { op: $op, dtype }),
        }
    };
}
pub(crate) use by_dtype;

/// `max(a + b, 0)` (`b` absent: `max(a, 0)`): the forward of [`crate::relu`] and
/// [`crate::add_relu`].
pub(crate) fn relu(a: &CudaStorage, la: &Layout, b: Option<(&CudaStorage, &Layout)>) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "relu";
    let dev = &a.device;
    let n = la.shape().elem_count();
    let f = func(dev, "relu_fwd", a.dtype(), OP)?;
    let out = by_dtype!(a.dtype(), OP, <T, C> {
        let out = output::<T>(dev, n)?;
        let av = view::<T>(a, la, OP)?;
        let bv = match b {
            Some((b, lb)) => view::<T>(b, lb, OP)?,
            None => view::<T>(a, la, OP)?,
        };
        let has_b = i32::from(b.is_some());
        if n > 0 {
            let stream = dev.cuda_stream();
            let mut builder = stream.launch_builder(&f);
            builder.arg(&n).arg(&av).arg(&bv).arg(&has_b).arg(&out);
            // SAFETY: the kernel reads `n` elements of `a` (and `b`, the same size, checked by
            // the caller) and writes `n` of `out`; the argument types match its signature.
            unsafe { builder.launch(elementwise(n)) }.w()?;
        }
        CudaStorage::wrap_cuda_slice(out, dev.clone())
    });
    Ok((out, la.shape().clone()))
}

/// `g` where `y > 0`, else 0: the ReLU's backward (`y` the forward's output).
pub(crate) fn relu_backward(y: &CudaStorage, ly: &Layout, g: &CudaStorage, lg: &Layout) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "relu backward";
    let dev = &y.device;
    let n = ly.shape().elem_count();
    if lg.shape().elem_count() != n {
        return fail(NnError::ShapeMismatch { op: OP, shapes: vec![ly.shape().clone(), lg.shape().clone()] });
    }
    let f = func(dev, "relu_bwd", y.dtype(), OP)?;
    let out = by_dtype!(y.dtype(), OP, <T, C> {
        let out = output::<T>(dev, n)?;
        let (yv, gv) = (view::<T>(y, ly, OP)?, view::<T>(g, lg, OP)?);
        if n > 0 {
            let stream = dev.cuda_stream();
            let mut builder = stream.launch_builder(&f);
            builder.arg(&n).arg(&yv).arg(&gv).arg(&out);
            // SAFETY: `y`, `g` and `out` hold `n` elements each, of the kernel's types.
            unsafe { builder.launch(elementwise(n)) }.w()?;
        }
        CudaStorage::wrap_cuda_slice(out, dev.clone())
    });
    Ok((out, ly.shape().clone()))
}

/// Exact GELU, `x/2 · (1 + erf(x/√2))`: the forward of [`crate::gelu_erf`].
pub(crate) fn gelu(x: &CudaStorage, lx: &Layout) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "gelu_erf";
    let dev = &x.device;
    let n = lx.shape().elem_count();
    let f = func(dev, "gelu_fwd", x.dtype(), OP)?;
    let out = by_dtype!(x.dtype(), OP, <T, C> {
        let out = output::<T>(dev, n)?;
        let xv = view::<T>(x, lx, OP)?;
        if n > 0 {
            let stream = dev.cuda_stream();
            let mut builder = stream.launch_builder(&f);
            builder.arg(&n).arg(&xv).arg(&out);
            // SAFETY: `x` and `out` hold `n` elements each, of the kernel's types.
            unsafe { builder.launch(elementwise(n)) }.w()?;
        }
        CudaStorage::wrap_cuda_slice(out, dev.clone())
    });
    Ok((out, lx.shape().clone()))
}

/// GELU's input gradient from its input `x` and `g` = ∂L/∂y.
pub(crate) fn gelu_backward(x: &CudaStorage, lx: &Layout, g: &CudaStorage, lg: &Layout) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "gelu_erf backward";
    let dev = &x.device;
    let n = lx.shape().elem_count();
    if lg.shape().elem_count() != n {
        return fail(NnError::ShapeMismatch { op: OP, shapes: vec![lx.shape().clone(), lg.shape().clone()] });
    }
    let f = func(dev, "gelu_bwd", x.dtype(), OP)?;
    let out = by_dtype!(x.dtype(), OP, <T, C> {
        let out = output::<T>(dev, n)?;
        let (xv, gv) = (view::<T>(x, lx, OP)?, view::<T>(g, lg, OP)?);
        if n > 0 {
            let stream = dev.cuda_stream();
            let mut builder = stream.launch_builder(&f);
            builder.arg(&n).arg(&xv).arg(&gv).arg(&out);
            // SAFETY: `x`, `g` and `out` hold `n` elements each, of the kernel's types.
            unsafe { builder.launch(elementwise(n)) }.w()?;
        }
        CudaStorage::wrap_cuda_slice(out, dev.clone())
    });
    Ok((out, lx.shape().clone()))
}

/// Threads per block of the layer-norm row kernels (fused.cu's `LN_THREADS`).
const LN_THREADS: u32 = 256;

/// One block per row (at most 65,535 blocks, each then takes several rows).
fn per_row(rows: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (rows.clamp(1, 65_535) as u32, 1, 1), block_dim: (LN_THREADS, 1, 1), shared_mem_bytes: 0 }
}

/// `(rows, d)` of a layer norm's input, whose dtype must be f32 or f64 (the kernels').
fn ln_geometry(lx: &Layout, dt: DType, op: &'static str) -> Result<(usize, usize)> {
    if !matches!(dt, DType::F32 | DType::F64) {
        return fail(NnError::UnsupportedDType { op, dtype: dt });
    }
    let d = lx.dims().last().copied().unwrap_or(1);
    Ok((if d == 0 { 0 } else { lx.shape().elem_count() / d }, d))
}

/// Layer norm over the last dimension: the forward of [`crate::layer_norm`] (f32, f64).
pub(crate) fn layer_norm(
    x: &CudaStorage,
    lx: &Layout,
    (g, lg): (&CudaStorage, &Layout),
    (b, lb): (&CudaStorage, &Layout),
    eps: f64,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "layer_norm";
    let dev = &x.device;
    let (rows, d) = ln_geometry(lx, x.dtype(), OP)?;
    let f = func(dev, "layer_norm_fwd", x.dtype(), OP)?;
    let out = by_dtype!(x.dtype(), OP, <T, C> {
        let out = output::<T>(dev, rows * d)?;
        let (xv, gv, bv) = (view::<T>(x, lx, OP)?, view::<T>(g, lg, OP)?, view::<T>(b, lb, OP)?);
        let eps = <T as candle_core::WithDType>::from_f64(eps);
        if rows * d > 0 {
            let stream = dev.cuda_stream();
            let mut builder = stream.launch_builder(&f);
            builder.arg(&rows).arg(&d).arg(&xv).arg(&gv).arg(&bv).arg(&eps).arg(&out);
            // SAFETY: `x` and `out` hold rows·d elements, `gamma` and `beta` d each, of T; one
            // block of LN_THREADS threads per row, as the kernel's reductions assume.
            unsafe { builder.launch(per_row(rows)) }.w()?;
        }
        CudaStorage::wrap_cuda_slice(out, dev.clone())
    });
    Ok((out, lx.shape().clone()))
}

/// Layer norm's backward as one flat storage `[∂x (rows·d); ∂gamma (d); ∂beta (d)]`, from the
/// input `x`, `gamma` and `gy` = ∂L/∂y (all contiguous).
pub(crate) fn layer_norm_backward(
    x: &CudaStorage,
    lx: &Layout,
    (g, lg): (&CudaStorage, &Layout),
    (gy, lgy): (&CudaStorage, &Layout),
    eps: f64,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "layer_norm backward";
    let dev = &x.device;
    let (rows, d) = ln_geometry(lx, x.dtype(), OP)?;
    if lgy.shape().elem_count() != rows * d {
        return fail(NnError::ShapeMismatch { op: OP, shapes: vec![lx.shape().clone(), lgy.shape().clone()] });
    }
    let (frows, fcols) = (func(dev, "layer_norm_bwd_rows", x.dtype(), OP)?, func(dev, "layer_norm_bwd_cols", x.dtype(), OP)?);
    let out = by_dtype!(x.dtype(), OP, <T, C> {
        let n = rows * d + 2 * d;
        // Zeros: with no rows the gradients of gamma and beta are 0.
        let mut out = dev.alloc_zeros::<T>(n.max(1))?;
        let stats = output::<T>(dev, 2 * rows)?;
        let (xv, gv, gyv) = (view::<T>(x, lx, OP)?, view::<T>(g, lg, OP)?, view::<T>(gy, lgy, OP)?);
        let wd = |v: f64| <T as candle_core::WithDType>::from_f64(v);
        let (eps, inv_d) = (wd(eps), wd(1.0 / d.max(1) as f64));
        if rows * d > 0 {
            let stream = dev.cuda_stream();
            {
                let mut dx = out.slice_mut(0..rows * d);
                let mut builder = stream.launch_builder(&frows);
                builder.arg(&rows).arg(&d).arg(&xv).arg(&gv).arg(&gyv).arg(&eps).arg(&inv_d).arg(&mut dx).arg(&stats);
                // SAFETY: `x`, `gy` and `dx` hold rows·d elements, `gamma` d, `stats` 2·rows, of
                // T; one block of LN_THREADS threads per row.
                unsafe { builder.launch(per_row(rows)) }.w()?;
            }
            let (_, mut rest) = out.split_at_mut(rows * d);
            let (mut dgamma, mut dbeta) = rest.split_at_mut(d);
            let mut builder = stream.launch_builder(&fcols);
            builder.arg(&rows).arg(&d).arg(&xv).arg(&gyv).arg(&stats).arg(&mut dgamma).arg(&mut dbeta);
            // SAFETY: as above; `dgamma` and `dbeta` hold d elements each, one thread per column.
            unsafe { builder.launch(elementwise(d)) }.w()?;
        }
        CudaStorage::wrap_cuda_slice(out, dev.clone())
    });
    Ok((out, Shape::from(rows * d + 2 * d)))
}

/// `(n, c, inner)` of an `[N, C, ...]` layout.
fn geometry(l: &Layout, op: &'static str) -> Result<(usize, usize, usize)> {
    crate::channel::geometry(l.dims(), op)
}

/// Per channel `[Σx; Σx²]` as an f64 `[2, C]` storage: [`crate::channel_moments`].
pub(crate) fn channel_moments(x: &CudaStorage, lx: &Layout) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "channel_moments";
    let dev = &x.device;
    let (n, c, inner) = geometry(lx, OP)?;
    let f = func(dev, "channel_moments", x.dtype(), OP)?;
    let out = dev.alloc_zeros::<f64>((2 * c).max(1))?;
    by_dtype!(x.dtype(), OP, <T, C> {
        let xv = view::<T>(x, lx, OP)?;
        if c > 0 {
            let stream = dev.cuda_stream();
            let mut builder = stream.launch_builder(&f);
            builder.arg(&n).arg(&c).arg(&inner).arg(&xv).arg(&out);
            // SAFETY: `x` holds n·c·inner elements; `out` 2c f64 values, one block per channel.
            unsafe { builder.launch(per_channel(c)) }.w()?;
        }
    });
    Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), Shape::from((2, c))))
}

/// A held f64 table's elements on the device (a contiguous tensor held by an op, read in its
/// storage: no copy), given to `f` with the slice.
pub(crate) fn with_table<R>(t: &Tensor, f: impl FnOnce(CudaView<'_, f64>) -> Result<R>) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cuda(s) = &*storage else {
        return fail(NnError::DeviceMismatch { op: "batch_norm (a table off the CUDA device)" });
    };
    f(view::<f64>(s, layout, "batch_norm table")?)
}

/// Batch norm's forward: `tail(a[c]·x + b[c])`, where `tail` is `mode` 0 (none), 1 (ReLU), 2
/// (`max(· + third, 0)`, a skip input) or 3 (`max(· + a2[c]·third + b2[c], 0)`, a normalised
/// shortcut); `a`, `b` are rows 2 and 3 of the coefficients table `coef` (`coef2`: the
/// shortcut's), converted to the compute type in the kernel.
pub(crate) fn bn_forward(
    x: &CudaStorage,
    lx: &Layout,
    third: Option<(&CudaStorage, &Layout)>,
    coef: &Tensor,
    coef2: Option<&Tensor>,
    mode: i32,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "batch_norm";
    let dev = &x.device;
    let (_, c, inner) = geometry(lx, OP)?;
    let len = lx.shape().elem_count();
    let f = func(dev, "bn_forward", x.dtype(), OP)?;
    let out = with_table(coef, |cv| {
        with_table(coef2.unwrap_or(coef), |cv2| {
            Ok(by_dtype!(x.dtype(), OP, <T, C> {
                let out = output::<T>(dev, len)?;
                let xv = view::<T>(x, lx, OP)?;
                let tv = match third {
                    Some((t, lt)) => view::<T>(t, lt, OP)?,
                    None => view::<T>(x, lx, OP)?,
                };
                if len > 0 {
                    let stream = dev.cuda_stream();
                    let mut builder = stream.launch_builder(&f);
                    builder.arg(&len).arg(&c).arg(&inner).arg(&xv).arg(&tv).arg(&cv).arg(&cv2).arg(&mode).arg(&out);
                    // SAFETY: `x`, `third` and `out` hold `len` elements of T, the tables 4c + 1
                    // f64 values each (checked when they were made).
                    unsafe { builder.launch(elementwise(len)) }.w()?;
                }
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            }))
        })
    })?;
    Ok((out, lx.shape().clone()))
}
