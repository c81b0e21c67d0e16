//! The CUDA side of batch norm's device path ([`crate::finalize`]): the finalize kernels
//! (`finalize.cu`: statistics, coefficients, backward coefficients; one thread per channel, f64)
//! and the launches of the per-channel backward sums and `∂x` (`fused.cu`) that read their
//! constants from the f64 tables on the device. Nothing here copies a value between the host and
//! the device.

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use candle_core::cuda::WrapErr;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Shape, Tensor};
use half::bf16;

use super::{by_dtype, channel_reduce, elementwise, func, geometry, output, view, with_table, Reduce};
use crate::error::{fail, NnError};

/// The name the finalize PTX module is loaded under on each device.
const MODULE: &str = "allgrad_nn_finalize";

fn kernel(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    Ok(dev.get_or_load_custom_func(name, MODULE, super::ptx::FINALIZE)?.into_cuda_function())
}

/// One thread per channel.
fn channels(c: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (c.div_ceil(256).max(1) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

/// `[Σx; Σx²; n]` (2C + 1) → `[mean; var; unbiased var; n]` (3C + 1).
pub(crate) fn statistics(s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "batch_statistics";
    let dev = &s.device;
    let c = (l.shape().elem_count() - 1) / 2;
    let m = view::<f64>(s, l, OP)?;
    let out = output::<f64>(dev, 3 * c + 1)?;
    let f = kernel(dev, "bn_statistics")?;
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&f);
    b.arg(&c).arg(&m).arg(&out);
    // SAFETY: `m` holds 2c + 1 f64 values, `out` 3c + 1; one thread per channel writes its three
    // values, thread 0 the count.
    unsafe { b.launch(channels(c)) }.w()?;
    Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), Shape::from(3 * c + 1)))
}

/// Statistics (3C + 1) and `[γ; β]` (`[2, C]`, f32 or f64) → coefficients (4C + 1).
pub(crate) fn coefficients(
    s: &CudaStorage,
    l: &Layout,
    sgb: &CudaStorage,
    lgb: &Layout,
    eps: f64,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "batch_norm coefficients";
    let dev = &s.device;
    let c = (l.shape().elem_count() - 1) / 3;
    let t = view::<f64>(s, l, OP)?;
    let out = output::<f64>(dev, 4 * c + 1)?;
    let stream = dev.cuda_stream();
    match sgb.dtype() {
        DType::F32 => {
            let f = kernel(dev, "bn_coefficients_f32")?;
            let gb = view::<f32>(sgb, lgb, OP)?;
            let mut b = stream.launch_builder(&f);
            b.arg(&c).arg(&t).arg(&gb).arg(&eps).arg(&out);
            // SAFETY: `t` holds 3c + 1 f64 values, `gb` 2c f32, `out` 4c + 1 f64.
            unsafe { b.launch(channels(c)) }.w()?;
        }
        DType::F64 => {
            let f = kernel(dev, "bn_coefficients_f64")?;
            let gb = view::<f64>(sgb, lgb, OP)?;
            let mut b = stream.launch_builder(&f);
            b.arg(&c).arg(&t).arg(&gb).arg(&eps).arg(&out);
            // SAFETY: as above, `gb` 2c f64.
            unsafe { b.launch(channels(c)) }.w()?;
        }
        dtype => return fail(NnError::UnsupportedDType { op: OP, dtype }),
    }
    Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), Shape::from(4 * c + 1)))
}

/// This rank's backward sums `[Σg'; Σg'·(x − mean)]` (2C, f64), the mean read from `coef`
/// (the two-stage reduction of [`super::channel_reduce`]).
pub(crate) fn backward_sums(
    coef: &Tensor,
    relu: bool,
    g: (&CudaStorage, &Layout),
    (x, lx): (&CudaStorage, &Layout),
    y: (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "batch_norm backward";
    let (_, c, _) = geometry(lx, OP)?;
    let out = with_table(coef, |mean| channel_reduce(x, lx, Reduce::BackwardSums { g, y, mean, relu }, false, OP))?;
    Ok((CudaStorage::wrap_cuda_slice(out, x.device.clone()), Shape::from(2 * c)))
}

/// `(global sums, local sums, coefficients)` → the backward table (6C).
pub(crate) fn backward_coefficients(
    (sg, lg): (&CudaStorage, &Layout),
    (sl, ll): (&CudaStorage, &Layout),
    (sc, lc): (&CudaStorage, &Layout),
    batch: bool,
    f32: bool,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "batch_norm backward coefficients";
    let dev = &sc.device;
    let c = ll.shape().elem_count() / 2;
    let (global, local, coef) = (view::<f64>(sg, lg, OP)?, view::<f64>(sl, ll, OP)?, view::<f64>(sc, lc, OP)?);
    let out = output::<f64>(dev, 6 * c)?;
    let (batch, f32) = (i32::from(batch), i32::from(f32));
    let f = kernel(dev, "bn_backward_coefficients")?;
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&f);
    b.arg(&c).arg(&global).arg(&local).arg(&coef).arg(&batch).arg(&f32).arg(&out);
    // SAFETY: `global` and `local` hold 2c f64 values, `coef` 4c + 1, `out` 6c.
    unsafe { b.launch(channels(c)) }.w()?;
    Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), Shape::from(6 * c)))
}

/// `∂x = k·g' + c1·(x − μ) + c0` from `(g, x, y)` and the backward table.
pub(crate) fn backward_dx(
    table: &Tensor,
    relu: bool,
    (g, lg): (&CudaStorage, &Layout),
    (x, lx): (&CudaStorage, &Layout),
    (y, ly): (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "batch_norm backward";
    let dev = &x.device;
    let (_, c, inner) = geometry(lx, OP)?;
    let len = lx.shape().elem_count();
    let f = func(dev, "bn_backward_dx", x.dtype(), OP)?;
    let relu = i32::from(relu);
    let out = with_table(table, |tv| {
        Ok(by_dtype!(x.dtype(), OP, <T, C> {
            let out = output::<T>(dev, len)?;
            let (gv, xv, yv) = (view::<T>(g, lg, OP)?, view::<T>(x, lx, OP)?, view::<T>(y, ly, OP)?);
            if len > 0 {
                let stream = dev.cuda_stream();
                let mut builder = stream.launch_builder(&f);
                builder.arg(&len).arg(&c).arg(&inner).arg(&gv).arg(&xv).arg(&yv).arg(&tv).arg(&relu).arg(&out);
                // SAFETY: `g`, `x`, `y` and `out` hold `len` elements of T, the table 6c f64.
                unsafe { builder.launch(elementwise(len)) }.w()?;
            }
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        }))
    })?;
    Ok((out, lx.shape().clone()))
}
