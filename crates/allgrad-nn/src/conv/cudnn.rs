//! The CUDA path of [`conv2d`](crate::conv2d) (feature `cudnn`): the forward, the input
//! gradient and the weight gradient are each one cuDNN call (`cudnnConvolutionForward`,
//! `...BackwardData`, `...BackwardFilter`), on the stream of the tensors' device.
//!
//! Candle's own CUDA backward of `conv2d` computes the input gradient with a direct
//! transposed-convolution kernel (one thread per input element looping over the kernel),
//! several times slower than the forward; this path replaces it.
//!
//! Precision: f32 runs with `CUDNN_FMA_MATH`, i.e. plain f32 arithmetic, never TF32, unless
//! [`crate::set_tf32`] allows TF32 (`CUDNN_DEFAULT_MATH`, which permits it on Ampere and
//! later). Plain-f32 results are comparable with the CPU kernels at f32 tolerance; f64 is
//! supported too. bf16 (autocast) stores bf16 and computes in f32 (cuDNN's
//! `PSEUDO_BFLOAT16_CONFIG`: a bf16 input, weight and output, an f32 convolution descriptor)
//! with tensor cores allowed (`CUDNN_TENSOR_OP_MATH`); its weight gradient is bf16, widened to
//! the f32 master weight's gradient by the autocast cast's backward (PyTorch's autocast does
//! the same). cuDNN picks each algorithm by its heuristics, so the weight gradient's summation
//! order (and its last bits) may differ from the CPU's and between algorithms.
//!
//! Plans are cached per thread and device ([`super::plan`]): the descriptors, the
//! algorithm and its workspace size of each (geometry, dtype, math mode, direction) are made
//! once, so a training step asks cuDNN's heuristic nothing after its first (each query is
//! counted in [`crate::HostTraffic::heuristic_queries`]). One workspace per thread and device
//! grows to the largest a plan needs and is reused. Outputs are not zero-filled: every call
//! writes them whole with beta = 0. When the chosen algorithm fails (not supported for the
//! shape, or its workspace cannot be allocated), the others are tried in cuDNN's order, and the
//! first that runs becomes the plan's.

use std::any::Any;
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::cudnn::{
    sys, ConvBackwardData, ConvBackwardFilter, ConvDescriptor, ConvForward, Cudnn, CudnnDataType, FilterDescriptor,
    TensorDescriptor,
};
use candle_core::cuda::cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};
use candle_core::cuda::{CudaDType, DeviceId};
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Shape, WithDType};
use half::bf16;

use super::im2col::ConvGeom;
use super::plan::{Direction, Math, PlanCache, PlanKey};

/// A thread's cuDNN state on one device: the handle, the plans, the workspace.
struct DeviceState {
    cudnn: Arc<Cudnn>,
    plans: PlanCache<Box<dyn Any>>,
    workspace: Option<CudaSlice<u8>>,
}

// cuDNN handles are neither Send nor Sync: one per thread and device, as Candle keeps its own.
thread_local! {
    static STATE: RefCell<HashMap<DeviceId, DeviceState>> = RefCell::new(HashMap::new());
}

/// Runs `f` with this thread's cuDNN state of `dev`.
fn with_state<R>(dev: &CudaDevice, f: impl FnOnce(&mut DeviceState) -> Result<R>) -> Result<R> {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        if !s.contains_key(&dev.id()) {
            let cudnn = Cudnn::new(dev.cuda_stream()).map_err(candle_core::Error::wrap)?;
            s.insert(dev.id(), DeviceState { cudnn, plans: PlanCache::default(), workspace: None });
        }
        f(s.get_mut(&dev.id()).expect("inserted above"))
    })
}

/// A workspace of at least `bytes` (at least 1), the thread's buffer grown when too small;
/// `None` when it cannot be allocated (the caller tries another algorithm).
fn workspace<'a>(slot: &'a mut Option<CudaSlice<u8>>, dev: &CudaDevice, bytes: usize) -> Option<&'a mut CudaSlice<u8>> {
    let bytes = bytes.max(1);
    if slot.as_ref().is_none_or(|w| w.len() < bytes) {
        // The old buffer goes first, so the two never need memory together.
        *slot = None;
        // SAFETY: a workspace is scratch for cuDNN, which writes before it reads.
        *slot = Some(unsafe { dev.alloc::<u8>(bytes) }.ok()?);
    }
    slot.as_mut()
}

/// The descriptors of one convolution: x (n, c, h, w), w (o, c / groups, kh, kw),
/// y (n, o, oh, ow), all contiguous NCHW, of data type `X`; the convolution computes in `C`.
struct Descs<X: CudnnDataType, C: CudnnDataType> {
    conv: ConvDescriptor<C>,
    x: TensorDescriptor<X>,
    w: FilterDescriptor<X>,
    y: TensorDescriptor<X>,
}

/// A data type cuDNN convolves, with the type it computes in.
trait ConvType: CudaDType + CudnnDataType + DeviceRepr + ValidAsZeroBits + WithDType {
    /// The convolution descriptor's type: the type itself, f32 for bf16.
    type Compute: CudnnDataType;
}

impl ConvType for f64 {
    type Compute = f64;
}

impl ConvType for f32 {
    type Compute = f32;
}

impl ConvType for bf16 {
    type Compute = f32;
}

/// cuDNN's math type for a plan's [`Math`]: `CUDNN_FMA_MATH` (no tensor cores),
/// `CUDNN_DEFAULT_MATH` (TF32 allowed) or `CUDNN_TENSOR_OP_MATH` (bf16 tensor cores).
fn math_type(m: Math) -> sys::cudnnMathType_t {
    match m {
        Math::Fma => sys::cudnnMathType_t::CUDNN_FMA_MATH,
        Math::Tf32 => sys::cudnnMathType_t::CUDNN_DEFAULT_MATH,
        Math::TensorOp => sys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
    }
}

fn descs<T: ConvType>(cudnn: &Arc<Cudnn>, g: &ConvGeom, math: Math) -> Result<Descs<T, T::Compute>> {
    let i = |v: usize| v as i32;
    let wrap = candle_core::Error::wrap;
    let mut conv = cudnn
        .create_conv2d::<T::Compute>(
            [i(g.pad), i(g.pad)],
            [i(g.stride), i(g.stride)],
            [i(g.dil), i(g.dil)],
            sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
        )
        .map_err(wrap)?;
    conv.set_group_count(i(g.groups)).map_err(wrap)?;
    conv.set_math_type(math_type(math)).map_err(wrap)?;
    let nchw = sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW;
    Ok(Descs {
        x: cudnn.create_4d_tensor::<T>(nchw, [i(g.n), i(g.c), i(g.h), i(g.w)]).map_err(wrap)?,
        w: cudnn.create_4d_filter::<T>(nchw, [i(g.o), i(g.c / g.groups), i(g.kh), i(g.kw)]).map_err(wrap)?,
        y: cudnn.create_4d_tensor::<T>(nchw, [i(g.n), i(g.o), i(g.oh), i(g.ow)]).map_err(wrap)?,
        conv,
    })
}

/// One direction's algorithms, in cuDNN's order (the fallbacks).
const FWD: [sys::cudnnConvolutionFwdAlgo_t; 8] = {
    use sys::cudnnConvolutionFwdAlgo_t::*;
    [
        CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM,
        CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
        CUDNN_CONVOLUTION_FWD_ALGO_GEMM,
        CUDNN_CONVOLUTION_FWD_ALGO_DIRECT,
        CUDNN_CONVOLUTION_FWD_ALGO_FFT,
        CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING,
        CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD,
        CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED,
    ]
};
const DATA: [sys::cudnnConvolutionBwdDataAlgo_t; 6] = {
    use sys::cudnnConvolutionBwdDataAlgo_t::*;
    [
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_0,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_1,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED,
    ]
};
const FILTER: [sys::cudnnConvolutionBwdFilterAlgo_t; 7] = {
    use sys::cudnnConvolutionBwdFilterAlgo_t::*;
    [
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING,
    ]
};

/// A cached plan: the descriptors and the algorithm of one direction (`A`) that runs.
struct Plan<T: ConvType, A> {
    d: Descs<T, T::Compute>,
    algo: A,
}

/// The plan of `key` in `plans` (built on a miss by `pick`, which asks the heuristic).
fn plan<'a, T: ConvType, A: 'static>(
    plans: &'a mut PlanCache<Box<dyn Any>>,
    cudnn: &Arc<Cudnn>,
    g: &ConvGeom,
    key: PlanKey,
    pick: impl FnOnce(&Descs<T, T::Compute>) -> Result<A>,
) -> Result<&'a mut Plan<T, A>> {
    let p = plans.get_or_build(key, || -> Result<Box<dyn Any>> {
        let d = descs::<T>(cudnn, g, key.math())?;
        let algo = pick(&d)?;
        Ok(Box::new(Plan { d, algo }))
    })?;
    p.downcast_mut::<Plan<T, A>>().ok_or_else(|| candle_core::Error::Msg("allgrad conv2d (cuDNN): a plan of another type".into()))
}

/// Runs `launch(algo, workspace)` with the plan's algorithm, then, while it fails, with the
/// other algorithms of `all` in order (each with its workspace size from `size`); the first that
/// runs becomes the plan's. Returns the first error when none runs.
fn run_with_fallback<A: Copy + PartialEq>(
    algo: &mut A,
    all: &[A],
    ws: &mut Option<CudaSlice<u8>>,
    dev: &CudaDevice,
    size: impl Fn(A) -> Result<usize>,
    mut launch: impl FnMut(A, &mut CudaSlice<u8>, usize) -> Result<()>,
) -> Result<()> {
    let mut first_err = None;
    for a in std::iter::once(*algo).chain(all.iter().copied().filter(|a| a != algo)) {
        let bytes = match size(a) {
            Ok(b) => b,
            Err(e) => {
                first_err.get_or_insert(e);
                continue;
            }
        };
        let Some(buf) = workspace(ws, dev, bytes) else {
            first_err.get_or_insert(candle_core::Error::Msg(format!("cuDNN workspace of {bytes} bytes could not be allocated")));
            continue;
        };
        match launch(a, buf, bytes.max(1)) {
            Ok(()) => {
                *algo = a;
                return Ok(());
            }
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    Err(first_err.unwrap_or_else(|| candle_core::Error::Msg("allgrad conv2d (cuDNN): no algorithm".into())))
}

fn contiguous(l: &Layout, what: &str) -> Result<std::ops::Range<usize>> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(a..b),
        None => candle_core::bail!("allgrad conv2d (cuDNN): {what} must be contiguous"),
    }
}

/// `y = conv2d(x, w)`.
pub(crate) fn forward(g: &ConvGeom, x: &CudaStorage, lx: &Layout, w: &CudaStorage, lw: &Layout) -> Result<(CudaStorage, Shape)> {
    let shape = Shape::from((g.n, g.o, g.oh, g.ow));
    let out = match x.dtype() {
        DType::F32 => run_forward::<f32>(g, x, lx, w, lw)?,
        DType::F64 => run_forward::<f64>(g, x, lx, w, lw)?,
        DType::BF16 => run_forward::<bf16>(g, x, lx, w, lw)?,
        dt => candle_core::bail!("allgrad conv2d (cuDNN): {dt:?} is not supported (f32, f64, bf16)"),
    };
    Ok((out, shape))
}

fn run_forward<T: ConvType>(g: &ConvGeom, x: &CudaStorage, lx: &Layout, w: &CudaStorage, lw: &Layout) -> Result<CudaStorage> {
    let dev = &x.device;
    let (xs, wts) = (x.as_cuda_slice::<T>()?, w.as_cuda_slice::<T>()?);
    let (xv, wv) = (xs.slice(contiguous(lx, "the input")?), wts.slice(contiguous(lw, "the weight")?));
    // SAFETY: cuDNN writes every element of y (beta = 0) before anything reads it.
    let mut y = unsafe { dev.alloc::<T>((g.n * g.o * g.oh * g.ow).max(1))? };
    let key = PlanKey::new(g, T::DTYPE, crate::tf32(), Direction::Forward);
    let wrap = candle_core::Error::wrap;
    with_state(dev, |state| {
        let p = plan::<T, _>(&mut state.plans, &state.cudnn, g, key, |d| {
            ConvForward { conv: &d.conv, x: &d.x, w: &d.w, y: &d.y }.pick_algorithm().map_err(wrap)
        })?;
        let Plan { d, algo } = p;
        let op = ConvForward { conv: &d.conv, x: &d.x, w: &d.w, y: &d.y };
        let size = |a| op.get_workspace_size(a).map_err(wrap);
        run_with_fallback(algo, &FWD, &mut state.workspace, dev, size, |a, ws, bytes| {
            let mut ws = ws.slice_mut(0..bytes);
            // SAFETY: the views hold exactly the elements the descriptors describe (contiguous
            // NCHW, offsets from the layouts), of the descriptors' data type T; the workspace
            // holds the algorithm's size.
            unsafe { op.launch(a, Some(&mut ws), (T::from_f64(1.0), T::from_f64(0.0)), &xv, &wv, &mut y) }.map_err(wrap)
        })
    })?;
    Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
}

/// The flat `[∂x (if `want_input`), ∂w (if `want_weight`)]` of `conv2d(x, w)` given
/// `gy` = ∂L/∂y, as the CPU backward kernel returns it.
pub(crate) fn backward(
    g: &ConvGeom,
    (want_input, want_weight): (bool, bool),
    (x, lx): (&CudaStorage, &Layout),
    (w, lw): (&CudaStorage, &Layout),
    (gy, lgy): (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    let parts = Parts { g, want_input, want_weight, x, lx, w, lw, gy, lgy };
    let (out, len) = match x.dtype() {
        DType::F32 => parts.run::<f32>()?,
        DType::F64 => parts.run::<f64>()?,
        DType::BF16 => parts.run::<bf16>()?,
        dt => candle_core::bail!("allgrad conv2d backward (cuDNN): {dt:?} is not supported (f32, f64, bf16)"),
    };
    Ok((out, Shape::from(len)))
}

struct Parts<'a> {
    g: &'a ConvGeom,
    want_input: bool,
    want_weight: bool,
    x: &'a CudaStorage,
    lx: &'a Layout,
    w: &'a CudaStorage,
    lw: &'a Layout,
    gy: &'a CudaStorage,
    lgy: &'a Layout,
}

impl Parts<'_> {
    fn run<T: ConvType>(&self) -> Result<(CudaStorage, usize)> {
        let g = self.g;
        let dev = &self.x.device;
        let wrap = candle_core::Error::wrap;
        let x_len = if self.want_input { g.n * g.c * g.h * g.w } else { 0 };
        let w_len = if self.want_weight { g.o * (g.c / g.groups) * g.kh * g.kw } else { 0 };
        // SAFETY: cuDNN writes every element of each part it computes (beta = 0), and the
        // parts cover the buffer.
        let mut out = unsafe { dev.alloc::<T>((x_len + w_len).max(1))? };
        let xs = self.x.as_cuda_slice::<T>()?;
        let ws = self.w.as_cuda_slice::<T>()?;
        let gys = self.gy.as_cuda_slice::<T>()?;
        let xv = xs.slice(contiguous(self.lx, "the input")?);
        let wv = ws.slice(contiguous(self.lw, "the weight")?);
        let gyv = gys.slice(contiguous(self.lgy, "the output gradient")?);
        let one_zero = (T::from_f64(1.0), T::from_f64(0.0));
        with_state(dev, |state| {
            if self.want_input {
                let key = PlanKey::new(g, T::DTYPE, crate::tf32(), Direction::BackwardData);
                let p = plan::<T, _>(&mut state.plans, &state.cudnn, g, key, |d| {
                    ConvBackwardData { conv: &d.conv, dx: &d.x, w: &d.w, dy: &d.y }.pick_algorithm().map_err(wrap)
                })?;
                let Plan { d, algo } = p;
                let op = ConvBackwardData { conv: &d.conv, dx: &d.x, w: &d.w, dy: &d.y };
                let size = |a| op.get_workspace_size(a).map_err(wrap);
                run_with_fallback(algo, &DATA, &mut state.workspace, dev, size, |a, ws, bytes| {
                    let mut ws = ws.slice_mut(0..bytes);
                    let mut dx = out.slice_mut(0..x_len);
                    // SAFETY: as in `run_forward`; `dx` is the first x_len elements of `out`.
                    unsafe { op.launch(a, Some(&mut ws), one_zero, &mut dx, &wv, &gyv) }.map_err(wrap)
                })?;
            }
            if self.want_weight {
                let key = PlanKey::new(g, T::DTYPE, crate::tf32(), Direction::BackwardFilter);
                let p = plan::<T, _>(&mut state.plans, &state.cudnn, g, key, |d| {
                    ConvBackwardFilter { conv: &d.conv, x: &d.x, dw: &d.w, dy: &d.y }.pick_algorithm().map_err(wrap)
                })?;
                let Plan { d, algo } = p;
                let op = ConvBackwardFilter { conv: &d.conv, x: &d.x, dw: &d.w, dy: &d.y };
                let size = |a| op.get_workspace_size(a).map_err(wrap);
                run_with_fallback(algo, &FILTER, &mut state.workspace, dev, size, |a, ws, bytes| {
                    let mut ws = ws.slice_mut(0..bytes);
                    let mut dw = out.slice_mut(x_len..x_len + w_len);
                    // SAFETY: as in `run_forward`; `dw` is the w_len elements after ∂x in `out`.
                    unsafe { op.launch(a, Some(&mut ws), one_zero, &xv, &mut dw, &gyv) }.map_err(wrap)
                })?;
            }
            Ok(())
        })?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), x_len + w_len))
    }
}
