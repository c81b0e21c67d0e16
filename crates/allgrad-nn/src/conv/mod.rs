//! 2-D convolution as im2col + GEMM, with a backward that is itself im2col + GEMM.
//!
//! Candle's CPU backward for `conv2d` runs `conv_transpose2d` for the input gradient and a
//! convolution with an image-sized "kernel" for the weight gradient; both are several times
//! slower than the forward. Here the forward, the input gradient and the weight gradient are
//! each one GEMM per image and group over the image's column matrix, and the two gradients
//! share one pass over the batch. 3x3 layers with stride 1 and padding 1 (16 or more channels
//! each way) compute the forward and the input gradient by Winograd's F(2x2, 3x3) instead
//! (`winograd.rs`).
//!
//! The folder: this file is the API and the ops, choosing between the CPU kernels (`cpu.rs`:
//! im2col + GEMM over the column kernels of `im2col.rs`, and Winograd's in `winograd.rs`) and
//! cuDNN (`cudnn.rs`, feature `cudnn`, with its plans cached by `plan.rs`).

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Module, Result, Shape, Tensor};

use self::cpu::{conv_bwd, conv_fwd};
use self::im2col::ConvGeom;
use crate::backend::cpu_float;
use crate::cpu::{bf16_values, bf16_with_f32, contiguous, float_kernel, narrow, run_split, widen, Float, SplitKernel};
use crate::error::{fail, NnError};

mod cpu;
#[cfg(feature = "cudnn")]
mod cudnn;
mod im2col;
mod plan;
mod winograd;

/// Stride, padding, dilation and groups of a 2-D convolution (the same on both spatial axes).
///
/// The defaults (stride 1, padding 0, dilation 1, groups 1) match PyTorch and
/// `candle_nn::Conv2dConfig`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvParams {
    /// Step between two output positions, in input pixels (at least 1).
    pub stride: usize,
    /// Zeros added on each side of both spatial axes.
    pub padding: usize,
    /// Spacing between kernel taps (at least 1; 1 is a dense kernel).
    pub dilation: usize,
    /// Number of channel groups (at least 1); `groups == channels` is a depthwise convolution.
    pub groups: usize,
}

impl Default for ConvParams {
    fn default() -> Self {
        Self { stride: 1, padding: 0, dilation: 1, groups: 1 }
    }
}

impl From<candle_nn::Conv2dConfig> for ConvParams {
    fn from(c: candle_nn::Conv2dConfig) -> Self {
        Self { stride: c.stride, padding: c.padding, dilation: c.dilation, groups: c.groups }
    }
}

/// Checks shapes and parameters and resolves the geometry of `conv2d(x, w)`.
fn geometry(x: &Tensor, w: &Tensor, p: &ConvParams) -> Result<ConvGeom> {
    let (n, c, h, wd) = match *x.dims() {
        [n, c, h, wd] => (n, c, h, wd),
        _ => {
            return fail(NnError::InputRank {
                op: "conv2d",
                expected: "(batch, channels, height, width)",
                shape: x.shape().clone(),
            })
        }
    };
    let (o, wc, kh, kw) = match *w.dims() {
        [o, wc, kh, kw] => (o, wc, kh, kw),
        _ => return fail(NnError::WeightRank { op: "conv2d", shape: w.shape().clone() }),
    };
    let ConvParams { stride, padding, dilation, groups } = *p;
    if stride == 0 || dilation == 0 || groups == 0 {
        return fail(NnError::ConvParams { stride, dilation, groups });
    }
    if c != wc * groups {
        return fail(NnError::ConvChannels { channels: c, per_group: wc, groups });
    }
    if o % groups != 0 {
        return fail(NnError::ConvGroups { out: o, groups });
    }
    if kh == 0 || kw == 0 || wc == 0 {
        return fail(NnError::EmptyWeight { shape: w.shape().clone() });
    }
    let (ekh, ekw) = (dilation * (kh - 1) + 1, dilation * (kw - 1) + 1);
    let (ph, pw) = (h + 2 * padding, wd + 2 * padding);
    if ekh > ph || ekw > pw {
        return fail(NnError::ConvKernelTooLarge { kh, kw, dilation, span_h: ekh, span_w: ekw, h, w: wd, padding });
    }
    if x.dtype() != w.dtype() && !bf16_with_f32(x, w) {
        return fail(NnError::DTypeMismatch { op: "conv2d", what: "input and weight", dtypes: vec![x.dtype(), w.dtype()] });
    }
    if !x.device().same_device(w.device()) {
        return fail(NnError::DeviceMismatch { op: "conv2d" });
    }
    Ok(ConvGeom {
        n,
        c,
        h,
        w: wd,
        o,
        kh,
        kw,
        oh: (ph - ekh) / stride + 1,
        ow: (pw - ekw) / stride + 1,
        stride,
        pad: padding,
        dil: dilation,
        groups,
    })
}

/// Whether `x` takes this module's kernels: f32, f64 or bf16 (computed in f32) on the CPU, or
/// f32, f64 or bf16 (computed in f32) on a CUDA device through cuDNN (feature `cudnn`).
fn fast_path(x: &Tensor) -> bool {
    let cuda = cfg!(feature = "cudnn") && x.device().is_cuda() && matches!(x.dtype(), DType::F32 | DType::F64 | DType::BF16);
    cpu_float(x) || cuda
}

/// 2-D convolution of `x` (batch, channels, height, width) with `w`
/// (out_channels, channels / groups, kernel_h, kernel_w); no bias (add it with
/// `broadcast_add` of a `(1, out_channels, 1, 1)` tensor, or use [`Conv2d`]).
///
/// On the CPU with f32 or f64 this is im2col + GEMM, parallel over the batch, and its backward
/// returns both the input and the weight gradient (each only when the tensor is tracked), again
/// as GEMMs. On CUDA with f32, f64 or bf16 in a build with the `cudnn` feature, the forward and
/// both gradients are cuDNN calls (plain f32 math, no TF32 unless [`crate::set_tf32`] allows
/// it; bf16 computed in f32 on the tensor cores). Other devices and dtypes fall back to
/// Candle's `conv2d` (and its backward).
///
/// Gradient convention: this op is local to the rank; its backward returns ∂L/∂x and ∂L/∂w of
/// whatever scalar the caller differentiates, with no cross-rank scaling.
///
/// Under [`crate::autocast::Autocast::bf16`] the input is cast to bf16 and the result is bf16.
/// On the CPU the f32 weight enters the kernel rounded to bf16, the convolution is computed in
/// f32 and its output rounded; the backward computes in f32 from the same bf16 values and
/// returns `∂x` in bf16 and `∂w` in f32 (unrounded: better than a bf16 weight gradient, and the
/// same on W ranks as on one). On CUDA the weight is cast to bf16 too and cuDNN returns both
/// gradients in bf16 (the cast's backward widens `∂w` to f32). A bf16 input with an f32 weight
/// on the CPU is computed this way without the guard as well.
///
/// # Errors
/// When the ranks, channel counts, groups or sizes do not fit together; the message names the
/// shapes. On the CPU, when `ALLGRAD_WINOGRAD` holds a value other than `0` or `1`
/// ([`crate::check_settings`]).
pub fn conv2d(x: &Tensor, w: &Tensor, params: ConvParams) -> Result<Tensor> {
    let _timer = crate::trace::OpTimer::start("conv", crate::trace::Pass::Forward, x.device());
    let x = &crate::autocast::operand(x)?;
    let w = &if bf16_with_f32(x, w) { w.clone() } else { crate::autocast::operand(w)? };
    let g = geometry(x, w, &params)?;
    if x.device().is_cpu() {
        crate::settings::winograd().clone()?;
    }
    if !fast_path(x) {
        return x.conv2d(w, params.padding, params.stride, params.dilation, params.groups);
    }
    if x.device().is_cuda() {
        // cuDNN reads contiguous NCHW (the CPU kernel reads any layout of x).
        return x.contiguous()?.apply_op2(&w.contiguous()?, Conv2dOp { g });
    }
    x.apply_op2(w, Conv2dOp { g })
}

/// The gradients of [`conv2d`] returned by [`conv2d_backward`].
#[derive(Clone, Debug)]
pub struct ConvGrads {
    /// ∂L/∂x, shaped like the input, when requested.
    pub input: Option<Tensor>,
    /// ∂L/∂w, shaped like the weight, when requested.
    pub weight: Option<Tensor>,
}

/// The backward of [`conv2d`] as a plain function: given the forward's `x`, `w`, `params` and
/// `grad` = ∂L/∂y, returns ∂L/∂x (if `want_input`) and ∂L/∂w (if `want_weight`), computed in one
/// pass over the batch. Autograd calls this; it is public for benchmarks and hand-written
/// backward passes. The results are not tracked.
///
/// # Errors
/// As [`conv2d`], and when `grad` is not shaped like the forward's output.
pub fn conv2d_backward(
    x: &Tensor,
    w: &Tensor,
    grad: &Tensor,
    params: ConvParams,
    want_input: bool,
    want_weight: bool,
) -> Result<ConvGrads> {
    let g = geometry(x, w, &params)?;
    let expect = [g.n, g.o, g.oh, g.ow];
    if grad.dims() != expect {
        return fail(NnError::GradShape { op: "conv2d", got: grad.shape().clone(), expected: expect.to_vec() });
    }
    if x.device().is_cpu() {
        crate::settings::winograd().clone()?;
    }
    if !fast_path(x) {
        return candle_backward(x, w, grad, &params, want_input, want_weight);
    }
    if bf16_with_f32(x, w) {
        // The f32 kernel on the forward's bf16 values: ∂x rounded to bf16, ∂w kept f32.
        let bf16_values = |t: &Tensor| t.detach().to_dtype(DType::F32);
        let (xf, wf, gf) = (bf16_values(x)?, w.detach().to_dtype(DType::BF16)?.to_dtype(DType::F32)?, bf16_values(grad)?);
        let g = conv2d_backward(&xf, &wf, &gf, params, want_input, want_weight)?;
        return Ok(ConvGrads { input: g.input.map(|t| t.to_dtype(DType::BF16)).transpose()?, weight: g.weight });
    }
    let x = if x.device().is_cuda() { x.detach().contiguous()? } else { x.detach() };
    let (w, grad) = (w.detach().contiguous()?, grad.detach().contiguous()?);
    let mut grads = ConvGrads { input: None, weight: None };
    if !want_input && !want_weight {
        return Ok(grads);
    }
    if x.device().is_cpu() {
        let kernel = Conv2dBackward { g, want_input, want_weight };
        // Each gradient in a buffer of its own (see `run_split`).
        let empty = || Shape::from(0usize);
        let shapes =
            [if want_input { x.shape().clone() } else { empty() }, if want_weight { w.shape().clone() } else { empty() }];
        let mut out = run_split(&kernel, [&x, &w, &grad], &shapes)?.into_iter();
        grads.input = out.next().filter(|_| want_input);
        grads.weight = out.next().filter(|_| want_weight);
        return Ok(grads);
    }
    // On CUDA one call per gradient, each into a buffer of its own (the gradient store keeps it
    // without a copy, as `run_split`'s on the CPU).
    if want_input {
        let k = Conv2dBackward { g, want_input: true, want_weight: false };
        grads.input = Some(x.apply_op3_no_bwd(&w, &grad, &k)?.reshape(x.shape())?);
    }
    if want_weight {
        let k = Conv2dBackward { g, want_input: false, want_weight: true };
        grads.weight = Some(x.apply_op3_no_bwd(&w, &grad, &k)?.reshape(w.shape())?);
    }
    Ok(grads)
}

/// Candle's own backward formulas, for devices and dtypes without a fast path.
fn candle_backward(
    x: &Tensor,
    w: &Tensor,
    grad: &Tensor,
    p: &ConvParams,
    want_input: bool,
    want_weight: bool,
) -> Result<ConvGrads> {
    // Run Candle's autograd on a copy of the forward and read off the requested gradients.
    let xv = candle_core::Var::from_tensor(&x.detach())?;
    let wv = candle_core::Var::from_tensor(&w.detach())?;
    let y = xv.as_tensor().conv2d(wv.as_tensor(), p.padding, p.stride, p.dilation, p.groups)?;
    let store = (y * grad.detach())?.sum_all()?.backward()?;
    Ok(ConvGrads {
        input: if want_input { store.get(xv.as_tensor()).cloned() } else { None },
        weight: if want_weight { store.get(wv.as_tensor()).cloned() } else { None },
    })
}

/// The forward custom op.
struct Conv2dOp {
    g: ConvGeom,
}

/// The backward kernel on `(x, w, grad)` (`w` and `grad` contiguous): `∂x` and `∂w`, each only
/// when wanted.
struct Conv2dBackward {
    g: ConvGeom,
    want_input: bool,
    want_weight: bool,
}

impl CustomOp2 for Conv2dOp {
    fn name(&self) -> &'static str {
        "allgrad-conv2d"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let g = &self.g;
        let shape = Shape::from((g.n, g.o, g.oh, g.ow));
        let plan = crate::simd::for_kernel()?;
        if let (CpuStorage::BF16(x), CpuStorage::F32(w)) = (s1, s2) {
            // A bf16 input with an f32 weight (autocast): the weight as its bf16 values.
            let (x, w) = (widen(x), bf16_values(&contiguous(w, l2)));
            return Ok((CpuStorage::BF16(narrow(conv_fwd(plan, &x, l1, &w, g))), shape));
        }
        let out = float_kernel!("conv2d", s1 => x, s2 => w; conv_fwd(plan, x, l1, &contiguous(w, l2), g));
        Ok((out, shape))
    }

    #[cfg(feature = "cudnn")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        count_cudnn(candle_core::backend::BackendStorage::dtype(s1));
        cudnn::forward(&self.g, s1, l1, s2, l2)
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let _timer = crate::trace::OpTimer::start("conv", crate::trace::Pass::Backward, x.device());
        let p = ConvParams { stride: self.g.stride, padding: self.g.pad, dilation: self.g.dil, groups: self.g.groups };
        let grads = conv2d_backward(x, w, grad, p, x.track_op(), w.track_op())?;
        Ok((grads.input, grads.weight))
    }
}

impl SplitKernel<3> for Conv2dBackward {
    const OP: &'static str = "conv2d backward";

    /// `[∂x, ∂w]`, each empty when not wanted.
    fn run<T: Float>(&self, [(x, lx), (w, lw), (gy, lgy)]: [(&[T], &Layout); 3]) -> Result<Vec<Vec<T>>> {
        let plan = crate::simd::for_kernel()?;
        let (dx, dw) =
            conv_bwd(plan, x, lx, &contiguous(w, lw), &contiguous(gy, lgy), &self.g, self.want_input, self.want_weight);
        Ok(vec![dx, dw])
    }
}

/// On CUDA, cuDNN's kernels write the flat concatenation `[∂x (if wanted), ∂w (if wanted)]`.
impl CustomOp3 for Conv2dBackward {
    fn name(&self) -> &'static str {
        "allgrad-conv2d-backward"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("allgrad-nn internal error: the CPU conv2d backward runs through `run_split`")
    }

    #[cfg(feature = "cudnn")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        count_cudnn(candle_core::backend::BackendStorage::dtype(s1));
        cudnn::backward(&self.g, (self.want_input, self.want_weight), (s1, l1), (s2, l2), (s3, l3))
    }
}

/// Counts a conv2d pass through cuDNN (`crate::kernel_paths`), and whether it was an f32 pass
/// with TF32 allowed.
#[cfg(feature = "cudnn")]
fn count_cudnn(dtype: candle_core::DType) {
    let tf32 = dtype == candle_core::DType::F32 && crate::tf32();
    crate::trace::count(|p| {
        p.conv_cudnn += 1;
        p.conv_cudnn_tf32 += u64::from(tf32);
    });
}

/// A 2-D convolution layer: a weight, an optional bias and its [`ConvParams`], applied with
/// [`conv2d`]. Build the tensors with the project's seeded initialisers and pass them in.
#[derive(Clone, Debug)]
pub struct Conv2d {
    weight: Tensor,
    bias: Option<Tensor>,
    params: ConvParams,
}

impl Conv2d {
    /// A layer from its weight `(out, in / groups, kh, kw)` and optional bias `(out,)`.
    ///
    /// # Errors
    /// When the weight is not rank 4 or the bias length differs from the weight's first dim.
    pub fn new(weight: Tensor, bias: Option<Tensor>, params: ConvParams) -> Result<Self> {
        let o = match *weight.dims() {
            [o, _, _, _] => o,
            _ => return fail(NnError::WeightRank { op: "Conv2d", shape: weight.shape().clone() }),
        };
        if let Some(b) = &bias {
            if b.dims() != [o] {
                return fail(NnError::ParamShape {
                    op: "Conv2d",
                    what: "bias",
                    shape: vec![b.shape().clone()],
                    expected: format!("the weight has {o} output channels"),
                });
            }
        }
        Ok(Self { weight, bias, params })
    }

    /// A `kernel x kernel` layer with its parameters created through `vb` (as
    /// `candle_nn::conv2d`): `weight` `(out_channels, in_channels / groups, kernel, kernel)`
    /// with Kaiming-normal initialisation, and with `bias` a `bias` `(out_channels,)`
    /// uniform in `±1/sqrt(in_channels)`.
    ///
    /// # Errors
    /// When `params.groups` is 0 or does not divide `in_channels`, or `vb` fails.
    pub fn from_vb(
        in_channels: usize,
        out_channels: usize,
        kernel: usize,
        params: ConvParams,
        bias: bool,
        vb: candle_nn::VarBuilder,
    ) -> Result<Self> {
        if params.groups == 0 || !in_channels.is_multiple_of(params.groups) {
            return fail(NnError::ConvChannels {
                channels: in_channels,
                per_group: in_channels / params.groups.max(1),
                groups: params.groups,
            });
        }
        let shape = (out_channels, in_channels / params.groups, kernel, kernel);
        let weight = vb.get_with_hints(shape, "weight", candle_nn::init::DEFAULT_KAIMING_NORMAL)?;
        let bias = if bias {
            let bound = 1.0 / (in_channels as f64).sqrt();
            Some(vb.get_with_hints(out_channels, "bias", candle_nn::Init::Uniform { lo: -bound, up: bound })?)
        } else {
            None
        };
        Self::new(weight, bias, params)
    }

    /// The weight, `(out, in / groups, kh, kw)`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The bias, `(out,)`, if any.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// Stride, padding, dilation and groups.
    pub fn params(&self) -> ConvParams {
        self.params
    }
}

impl Module for Conv2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = conv2d(x, &self.weight, self.params)?;
        match &self.bias {
            None => Ok(y),
            // In the output's dtype (bf16 under autocast).
            Some(b) => y.broadcast_add(&b.to_dtype(y.dtype())?.reshape((1, b.elem_count(), 1, 1))?),
        }
    }
}
