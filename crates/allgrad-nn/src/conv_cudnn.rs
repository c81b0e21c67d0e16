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

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::cudnn::{
    sys, ConvBackwardData, ConvBackwardFilter, ConvDescriptor, ConvForward, Cudnn, CudnnDataType, FilterDescriptor,
    TensorDescriptor,
};
use candle_core::cuda::cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use candle_core::cuda::{CudaDType, DeviceId};
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Shape, WithDType};
use half::bf16;

use crate::im2col::ConvGeom;

// cuDNN handles are neither Send nor Sync: one per thread and device, as Candle keeps its own.
thread_local! {
    static HANDLES: RefCell<HashMap<DeviceId, Arc<Cudnn>>> = RefCell::new(HashMap::new());
}

fn handle(dev: &CudaDevice) -> Result<Arc<Cudnn>> {
    HANDLES.with(|h| {
        if let Some(c) = h.borrow().get(&dev.id()) {
            return Ok(c.clone());
        }
        let c = Cudnn::new(dev.cuda_stream()).map_err(candle_core::Error::wrap)?;
        h.borrow_mut().insert(dev.id(), c.clone());
        Ok(c)
    })
}

/// The descriptors of one convolution: x (n, c, h, w), w (o, c / groups, kh, kw),
/// y (n, o, oh, ow), all contiguous NCHW, of data type `X`; the convolution computes in `C`.
struct Descs<X: CudnnDataType, C: CudnnDataType> {
    conv: ConvDescriptor<C>,
    x: TensorDescriptor<X>,
    w: FilterDescriptor<X>,
    y: TensorDescriptor<X>,
}

/// A data type cuDNN convolves, with the type it computes in and the math it may use.
trait ConvType: CudaDType + CudnnDataType + DeviceRepr + ValidAsZeroBits + WithDType {
    /// The convolution descriptor's type: the type itself, f32 for bf16.
    type Compute: CudnnDataType;
    /// `CUDNN_FMA_MATH` (no tensor cores), `CUDNN_DEFAULT_MATH` (TF32 allowed) or
    /// `CUDNN_TENSOR_OP_MATH` (bf16 tensor cores).
    fn math() -> sys::cudnnMathType_t;
}

impl ConvType for f64 {
    type Compute = f64;
    fn math() -> sys::cudnnMathType_t {
        sys::cudnnMathType_t::CUDNN_FMA_MATH
    }
}

impl ConvType for f32 {
    type Compute = f32;
    fn math() -> sys::cudnnMathType_t {
        if crate::tf32() {
            sys::cudnnMathType_t::CUDNN_DEFAULT_MATH
        } else {
            sys::cudnnMathType_t::CUDNN_FMA_MATH
        }
    }
}

impl ConvType for bf16 {
    type Compute = f32;
    fn math() -> sys::cudnnMathType_t {
        sys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH
    }
}

fn descs<T: ConvType>(cudnn: &Arc<Cudnn>, g: &ConvGeom) -> Result<Descs<T, T::Compute>> {
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
    conv.set_math_type(T::math()).map_err(wrap)?;
    let nchw = sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW;
    Ok(Descs {
        x: cudnn.create_4d_tensor::<T>(nchw, [i(g.n), i(g.c), i(g.h), i(g.w)]).map_err(wrap)?,
        w: cudnn.create_4d_filter::<T>(nchw, [i(g.o), i(g.c / g.groups), i(g.kh), i(g.kw)]).map_err(wrap)?,
        y: cudnn.create_4d_tensor::<T>(nchw, [i(g.n), i(g.o), i(g.oh), i(g.ow)]).map_err(wrap)?,
        conv,
    })
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
    let cudnn = handle(dev)?;
    let d = descs::<T>(&cudnn, g)?;
    let (xs, ws) = (x.as_cuda_slice::<T>()?, w.as_cuda_slice::<T>()?);
    let (xv, wv) = (xs.slice(contiguous(lx, "the input")?), ws.slice(contiguous(lw, "the weight")?));
    let mut y = dev.alloc_zeros::<T>(g.n * g.o * g.oh * g.ow)?;
    let op = ConvForward { conv: &d.conv, x: &d.x, w: &d.w, y: &d.y };
    let wrap = candle_core::Error::wrap;
    let algo = op.pick_algorithm().map_err(wrap)?;
    let mut ws_buf = dev.alloc_zeros::<u8>(op.get_workspace_size(algo).map_err(wrap)?.max(1))?;
    // SAFETY: the views hold exactly the elements the descriptors describe (contiguous NCHW,
    // offsets from the layouts), of the descriptors' data type T.
    unsafe { op.launch(algo, Some(&mut ws_buf), (T::from_f64(1.0), T::from_f64(0.0)), &xv, &wv, &mut y) }.map_err(wrap)?;
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
        let cudnn = handle(dev)?;
        let d = descs::<T>(&cudnn, g)?;
        let wrap = candle_core::Error::wrap;
        let x_len = if self.want_input { g.n * g.c * g.h * g.w } else { 0 };
        let w_len = if self.want_weight { g.o * (g.c / g.groups) * g.kh * g.kw } else { 0 };
        let mut out = dev.alloc_zeros::<T>((x_len + w_len).max(1))?;
        let xs = self.x.as_cuda_slice::<T>()?;
        let ws = self.w.as_cuda_slice::<T>()?;
        let gys = self.gy.as_cuda_slice::<T>()?;
        let xv = xs.slice(contiguous(self.lx, "the input")?);
        let wv = ws.slice(contiguous(self.lw, "the weight")?);
        let gyv = gys.slice(contiguous(self.lgy, "the output gradient")?);
        if self.want_input {
            let op = ConvBackwardData { conv: &d.conv, dx: &d.x, w: &d.w, dy: &d.y };
            let algo = op.pick_algorithm().map_err(wrap)?;
            let mut ws_buf = dev.alloc_zeros::<u8>(op.get_workspace_size(algo).map_err(wrap)?.max(1))?;
            let mut dx = out.slice_mut(0..x_len);
            // SAFETY: as in `run_forward`; `dx` is the first x_len elements of `out`.
            unsafe { op.launch(algo, Some(&mut ws_buf), (T::from_f64(1.0), T::from_f64(0.0)), &mut dx, &wv, &gyv) }
                .map_err(wrap)?;
        }
        if self.want_weight {
            let op = ConvBackwardFilter { conv: &d.conv, x: &d.x, dw: &d.w, dy: &d.y };
            let algo = op.pick_algorithm().map_err(wrap)?;
            let mut ws_buf = dev.alloc_zeros::<u8>(op.get_workspace_size(algo).map_err(wrap)?.max(1))?;
            let mut dw = out.slice_mut(x_len..x_len + w_len);
            // SAFETY: as in `run_forward`; `dw` is the w_len elements after ∂x in `out`.
            unsafe { op.launch(algo, Some(&mut ws_buf), (T::from_f64(1.0), T::from_f64(0.0)), &xv, &mut dw, &gyv) }
                .map_err(wrap)?;
        }
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), x_len + w_len))
    }
}
