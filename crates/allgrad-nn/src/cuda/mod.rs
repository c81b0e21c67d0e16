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
//! (computed in f32, stored rounded to bf16, as on the CPU). Per-channel sums are f64, in two
//! stages over a partition fixed by the shape (several blocks per channel, then the parts in
//! order: the same bits every run).
//!
//! `ALLGRAD_CUDA_FUSED=0` (read once) turns them off: CUDA tensors then take the composed
//! Candle ops as before, so a GPU session can compare the two.

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

/// Whether the kernels are on (`ALLGRAD_CUDA_FUSED`, [`crate::settings`]; the trainer refuses a
/// bad value before anything runs, see [`crate::check_settings`]).
fn enabled() -> bool {
    matches!(crate::settings::cuda_fused(), Ok(true))
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
    let frows = func(dev, "layer_norm_bwd_rows", x.dtype(), OP)?;
    let (fpart, ffinish) =
        (func(dev, "layer_norm_bwd_cols_partial", x.dtype(), OP)?, func(dev, "layer_norm_bwd_cols_finish", x.dtype(), OP)?);
    // Row parts of the columns' two-stage sums: about 64 rows per part, at most 64 parts (a
    // function of the shape only).
    let parts = rows.div_ceil(64).clamp(1, 64);
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
            let partial = output::<T>(dev, 2 * parts * d)?;
            {
                let mut builder = stream.launch_builder(&fpart);
                builder.arg(&rows).arg(&d).arg(&parts).arg(&xv).arg(&gyv).arg(&stats).arg(&partial);
                let cfg = LaunchConfig {
                    grid_dim: (d.div_ceil(32) as u32, parts as u32, 1),
                    block_dim: (32, 8, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: `x` and `gy` hold rows·d elements, `stats` 2·rows, `partial` 2·parts·d;
                // block (tile, part) of 32 x 8 threads (fused.cu's LN_COLS x LN_ROWS) writes its
                // columns' two partials of its part only.
                unsafe { builder.launch(cfg) }.w()?;
            }
            let (_, mut rest) = out.split_at_mut(rows * d);
            let (mut dgamma, mut dbeta) = rest.split_at_mut(d);
            let mut builder = stream.launch_builder(&ffinish);
            builder.arg(&d).arg(&parts).arg(&partial).arg(&mut dgamma).arg(&mut dbeta);
            // SAFETY: `partial` holds 2·parts·d elements, `dgamma` and `dbeta` d each.
            unsafe { builder.launch(elementwise(d)) }.w()?;
        }
        CudaStorage::wrap_cuda_slice(out, dev.clone())
    });
    Ok((out, Shape::from(rows * d + 2 * d)))
}

/// `(n, c, inner)` of an `[N, C, ...]` layout.
fn geometry(l: &Layout, op: &'static str) -> Result<(usize, usize, usize)> {
    crate::shape::geometry(l.dims(), op)
}

/// Threads per block of the per-channel reductions (fused.cu's `SUM_THREADS`).
const SUM_THREADS: usize = 256;

/// Parts per channel of the two-stage reductions: about 16 values per thread of a part, at most
/// 64 parts; a function of the shape only, so the summation order never changes between runs.
pub(crate) fn reduction_parts(m: usize) -> usize {
    m.div_ceil(SUM_THREADS * 16).clamp(1, 64)
}

/// What a two-stage per-channel reduction sums: the moments of `x`, or batch norm's backward
/// sums of `(g, x, y)` around `mean` (the coefficients table's first row).
pub(crate) enum Reduce<'a> {
    Moments,
    BackwardSums { g: (&'a CudaStorage, &'a Layout), y: (&'a CudaStorage, &'a Layout), mean: CudaView<'a, f64>, relu: bool },
}

/// Per channel `[Σa; Σb]` (`count`: then `n` appended, `[Σx; Σx²; n]`) of an `[n, c, inner]`
/// tensor, in two stages over a fixed partition (fused.cu's `channel_partial`,
/// `channel_finish`), as a fresh f64 buffer.
pub(crate) fn channel_reduce(
    x: &CudaStorage,
    lx: &Layout,
    what: Reduce<'_>,
    count: bool,
    op: &'static str,
) -> Result<CudaSlice<f64>> {
    let dev = &x.device;
    let (n, c, inner) = geometry(lx, op)?;
    let m = n * inner;
    let parts = reduction_parts(m);
    let out = output::<f64>(dev, (2 * c + usize::from(count)).max(1))?;
    let small = n * c * inner < u32::MAX as usize;
    // channel_partial_<dtype>_<u32|u64>: 32-bit indices below 2^32 elements.
    let suffix = match x.dtype() {
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::BF16 => "bf16",
        dtype => return fail(NnError::UnsupportedDType { op, dtype }),
    };
    let name = format!("channel_partial_{suffix}_{}", if small { "u32" } else { "u64" });
    let f = dev.get_or_load_custom_func(&name, MODULE, ptx::FUSED)?.into_cuda_function();
    let finish = dev.get_or_load_custom_func("channel_finish", MODULE, ptx::FUSED)?.into_cuda_function();
    let stream = dev.cuda_stream();
    if c > 0 {
        let partial = output::<f64>(dev, 2 * c * parts)?;
        by_dtype!(x.dtype(), op, <T, C> {
            let xv = view::<T>(x, lx, op)?;
            let (gv, yv) = match &what {
                Reduce::BackwardSums { g, y, .. } => (view::<T>(g.0, g.1, op)?, view::<T>(y.0, y.1, op)?),
                Reduce::Moments => (view::<T>(x, lx, op)?, view::<T>(x, lx, op)?),
            };
            let (sums, relu) = match &what {
                Reduce::BackwardSums { relu, .. } => (1i32, i32::from(*relu)),
                Reduce::Moments => (0, 0),
            };
            let cfg = LaunchConfig { grid_dim: (c as u32, parts as u32, 1), block_dim: (SUM_THREADS as u32, 1, 1), shared_mem_bytes: 0 };
            let mut b = stream.launch_builder(&f);
            let (c32, inner32, m32, p32) = (c as u32, inner as u32, m as u32, parts as u32);
            let (c64, inner64, m64, p64) = (c as u64, inner as u64, m as u64, parts as u64);
            if small {
                b.arg(&c32).arg(&inner32).arg(&m32).arg(&p32);
            } else {
                b.arg(&c64).arg(&inner64).arg(&m64).arg(&p64);
            }
            b.arg(&xv).arg(&gv).arg(&yv);
            match &what {
                Reduce::BackwardSums { mean, .. } => b.arg(mean),
                // Not read (sums = 0): any device pointer.
                Reduce::Moments => b.arg(&partial),
            };
            b.arg(&sums).arg(&relu).arg(&partial);
            // SAFETY: `x` (and `g`, `y`) hold n·c·inner elements of T, `mean` c values, `partial`
            // 2·c·parts; block (ch, part) writes its two partials only; the index type matches
            // the kernel's (u32 below 2^32 elements).
            unsafe { b.launch(cfg) }.w()?;
        });
        let cnt: f64 = if count { m as f64 } else { -1.0 };
        let mut b = stream.launch_builder(&finish);
        b.arg(&c).arg(&parts).arg(&partial).arg(&cnt).arg(&out);
        // SAFETY: `partial` holds 2·c·parts f64 values, `out` 2c (+1 with the count).
        unsafe {
            b.launch(LaunchConfig { grid_dim: (c.div_ceil(256) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 })
        }
        .w()?;
    } else if count {
        let cnt = m as f64;
        let mut b = stream.launch_builder(&finish);
        b.arg(&c).arg(&parts).arg(&out).arg(&cnt).arg(&out);
        // SAFETY: with no channels the kernel only writes out[0], the count.
        unsafe { b.launch(LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 }) }.w()?;
    }
    Ok(out)
}

/// Per channel `[Σx; Σx²]` as an f64 `[2, C]` storage: [`crate::channel_moments`].
pub(crate) fn channel_moments(x: &CudaStorage, lx: &Layout) -> Result<(CudaStorage, Shape)> {
    let (_, c, _) = geometry(lx, "channel_moments")?;
    let out = channel_reduce(x, lx, Reduce::Moments, false, "channel_moments")?;
    Ok((CudaStorage::wrap_cuda_slice(out, x.device.clone()), Shape::from((2, c))))
}

/// Per channel `[Σx; Σx²; n]` as a flat f64 storage of 2C + 1: [`crate::batch_moments`].
pub(crate) fn batch_moments(x: &CudaStorage, lx: &Layout) -> Result<(CudaStorage, Shape)> {
    let (_, c, _) = geometry(lx, "batch_moments")?;
    let out = channel_reduce(x, lx, Reduce::Moments, true, "batch_moments")?;
    Ok((CudaStorage::wrap_cuda_slice(out, x.device.clone()), Shape::from(2 * c + 1)))
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
    let launch = |cv: &CudaView<'_, f64>, cv2: &CudaView<'_, f64>| -> Result<CudaStorage> {
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
                builder.arg(&len).arg(&c).arg(&inner).arg(&xv).arg(&tv).arg(cv).arg(cv2).arg(&mode).arg(&out);
                // SAFETY: `x`, `third` and `out` hold `len` elements of T, the tables 4c + 1
                // f64 values each (checked when they were made).
                unsafe { builder.launch(elementwise(len)) }.w()?;
            }
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        }))
    };
    // Each table's storage is locked once (the shortcut's is another tensor).
    let out = with_table(coef, |cv| match coef2 {
        Some(c2) => with_table(c2, |cv2| launch(&cv, &cv2)),
        None => launch(&cv, &cv),
    })?;
    Ok((out, lx.shape().clone()))
}

/// Makes the memory pool that `dev`'s allocations come from keep its memory between steps: its
/// release threshold (0 by default, so the pool may hand memory back to the driver at every
/// synchronisation and map it again in the next step) is set to the largest value. Returns
/// whether the pool was set: false on the CPU, or where the context allocates without pools.
pub fn keep_pool_memory(dev: &candle_core::Device) -> bool {
    use candle_core::cuda::cudarc::driver::{result, sys};
    let candle_core::Device::Cuda(d) = dev else { return false };
    let ctx = d.cuda_stream().context().clone();
    if !ctx.has_async_alloc() {
        return false;
    }
    // SAFETY: the CUdevice comes from the live context of Candle's device.
    let Ok(pool) = (unsafe { result::device::get_mem_pool(ctx.cu_device()) }) else { return false };
    let mut threshold: u64 = u64::MAX;
    let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
    // SAFETY: a valid pool; RELEASE_THRESHOLD takes a cuuint64_t.
    unsafe { result::mem_pool::set_attribute(pool, attr, (&mut threshold as *mut u64).cast()) }.is_ok()
}
