//! The errors of allgrad-nn: one variant per misuse, carrying the shapes and numbers. They
//! convert into `candle_core::Error` (the ops return `candle_core::Result`, as Candle's do),
//! and the original is recovered with `candle_core::Error::downcast`-style matching on
//! `Error::Wrapped`.

use candle_core::{DType, Shape};

/// A misuse of an allgrad-nn op or layer.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum NnError {
    /// The input does not have the rank the op needs.
    #[error("{op}: input must be {expected}, got shape {shape:?}")]
    InputRank {
        /// The op.
        op: &'static str,
        /// The expected layout, e.g. `(batch, channels, height, width)`.
        expected: &'static str,
        /// The input's shape.
        shape: Shape,
    },
    /// A conv2d weight is not `(out_channels, in_channels / groups, kernel_h, kernel_w)`.
    #[error("{op}: weight must be (out_channels, in_channels / groups, kernel_h, kernel_w), got shape {shape:?}")]
    WeightRank {
        /// The op or layer.
        op: &'static str,
        /// The weight's shape.
        shape: Shape,
    },
    /// Stride, dilation or groups of a convolution is zero.
    #[error("conv2d: stride ({stride}), dilation ({dilation}) and groups ({groups}) must all be at least 1")]
    ConvParams {
        /// The stride.
        stride: usize,
        /// The dilation.
        dilation: usize,
        /// The groups.
        groups: usize,
    },
    /// The input's channels are not the weight's input channels times the groups.
    #[error("conv2d: input has {channels} channels but the weight expects {per_group} x groups {groups}")]
    ConvChannels {
        /// Input channels.
        channels: usize,
        /// The weight's input channels (per group).
        per_group: usize,
        /// Groups.
        groups: usize,
    },
    /// The groups do not divide the output channels.
    #[error("conv2d: weight has {out} output channels, which groups {groups} does not divide")]
    ConvGroups {
        /// Output channels.
        out: usize,
        /// Groups.
        groups: usize,
    },
    /// The conv2d weight has an empty dimension.
    #[error("conv2d: weight shape {shape:?} has an empty dimension")]
    EmptyWeight {
        /// The weight's shape.
        shape: Shape,
    },
    /// The (dilated) kernel is larger than the padded input.
    #[error(
        "conv2d: the kernel {kh}x{kw} with dilation {dilation} spans {span_h}x{span_w}, larger than the input {h}x{w} padded by {padding} ({}x{})",
        h + 2 * padding, w + 2 * padding
    )]
    ConvKernelTooLarge {
        /// Kernel height.
        kh: usize,
        /// Kernel width.
        kw: usize,
        /// Dilation.
        dilation: usize,
        /// Height the dilated kernel spans.
        span_h: usize,
        /// Width the dilated kernel spans.
        span_w: usize,
        /// Input height.
        h: usize,
        /// Input width.
        w: usize,
        /// Padding.
        padding: usize,
    },
    /// Tensors that must share a shape do not.
    #[error("{op}: the inputs must have one shape, got {shapes:?}")]
    ShapeMismatch {
        /// The op.
        op: &'static str,
        /// Their shapes, in order.
        shapes: Vec<Shape>,
    },
    /// Tensors that must share a dtype do not.
    #[error("{op}: {what} must share a dtype, got {dtypes:?}")]
    DTypeMismatch {
        /// The op.
        op: &'static str,
        /// The tensors, e.g. `input and weight`.
        what: &'static str,
        /// Their dtypes, in that order.
        dtypes: Vec<DType>,
    },
    /// Tensors that must be on one device are not.
    #[error("{op}: the inputs are on different devices")]
    DeviceMismatch {
        /// The op.
        op: &'static str,
    },
    /// An output gradient does not have the forward output's shape.
    #[error("{op} backward: output gradient has shape {got:?}, expected {expected:?}")]
    GradShape {
        /// The op.
        op: &'static str,
        /// The gradient's shape.
        got: Shape,
        /// The forward output's shape.
        expected: Vec<usize>,
    },
    /// A bias or per-channel parameter does not match the channels.
    #[error("{op}: {what} has shape {shape:?} but {expected}")]
    ParamShape {
        /// The op or layer.
        op: &'static str,
        /// The parameter(s).
        what: &'static str,
        /// Their shape(s).
        shape: Vec<Shape>,
        /// What was expected, with the number.
        expected: String,
    },
    /// A CPU kernel got a dtype it has no implementation for (a bug: the ops dispatch only
    /// f32/f64/bf16 to the kernels).
    #[error("{op}: unsupported dtype {dtype:?}")]
    UnsupportedDType {
        /// The kernel.
        op: &'static str,
        /// The dtype.
        dtype: DType,
    },
    /// A pooling input has an empty spatial dimension.
    #[error("{op}: input {shape:?} has an empty spatial dimension")]
    EmptyInput {
        /// The op.
        op: &'static str,
        /// The input's shape.
        shape: Shape,
    },
    /// A pooling kernel or stride is zero.
    #[error("{op}: kernel {kernel:?} and stride {stride:?} must be at least 1")]
    PoolKernelStride {
        /// The op.
        op: &'static str,
        /// The kernel.
        kernel: (usize, usize),
        /// The stride.
        stride: (usize, usize),
    },
    /// Pooling padding exceeds half the kernel.
    #[error("{op}: padding {padding:?} must be at most half the kernel {kernel:?}")]
    PoolPadding {
        /// The op.
        op: &'static str,
        /// The padding.
        padding: (usize, usize),
        /// The kernel.
        kernel: (usize, usize),
    },
    /// The pooling kernel is larger than the padded input.
    #[error("{op}: kernel {kernel:?} is larger than the input {h}x{w} padded by {padding:?}")]
    PoolKernelTooLarge {
        /// The op.
        op: &'static str,
        /// The kernel.
        kernel: (usize, usize),
        /// Input height.
        h: usize,
        /// Input width.
        w: usize,
        /// The padding.
        padding: (usize, usize),
    },
    /// An adaptive pooling output size is zero or larger than the input.
    #[error("adaptive_avg_pool2d: output size {oh}x{ow} must be between 1x1 and the input size {h}x{w}")]
    AdaptiveOutput {
        /// Output height.
        oh: usize,
        /// Output width.
        ow: usize,
        /// Input height.
        h: usize,
        /// Input width.
        w: usize,
    },
    /// Adaptive pooling to more than 1x1 off the CPU fast path.
    #[error("adaptive_avg_pool2d: output size {oh}x{ow} is only implemented on the CPU for f32/f64 (got {dtype:?} on {device}); use (1, 1)")]
    AdaptiveOffCpu {
        /// Output height.
        oh: usize,
        /// Output width.
        ow: usize,
        /// The input's dtype.
        dtype: DType,
        /// The input's device.
        device: String,
    },
    /// The fused batch norm on a device without its kernels (see
    /// [`crate::has_fused_kernels`]) or for a dtype other than f32/f64/bf16.
    #[error("batch_norm: the fused op runs for f32/f64/bf16 on the CPU, and on CUDA in builds with feature `cuda` unless ALLGRAD_CUDA_FUSED=0 (got {dtype:?} on {device}); compose channel_moments and channel_affine elsewhere")]
    BatchNormOffCpu {
        /// The input's dtype.
        dtype: DType,
        /// The input's device.
        device: String,
    },
    /// Batch-norm statistics that are not one finite value per channel, or a bad eps or count.
    #[error("batch_norm: {what}")]
    BatchNormStats {
        /// What is wrong, with the numbers.
        what: String,
    },
    /// Layer norm's `eps` is negative or NaN.
    #[error("layer_norm: eps must be non-negative, got {eps}")]
    NegativeEps {
        /// The value.
        eps: f64,
    },
    /// Cross-entropy targets are not `(n,)` for `n` rows of logits.
    #[error("cross_entropy: targets must be ({rows},) to match logits {logits:?}, got shape {targets:?}")]
    TargetsShape {
        /// Rows of the logits.
        rows: usize,
        /// The logits' shape.
        logits: Shape,
        /// The targets' shape.
        targets: Shape,
    },
    /// Cross-entropy targets are not an integer dtype.
    #[error("cross_entropy: targets must be class indices (u8, u32 or i64), got {dtype:?}")]
    TargetsDType {
        /// The targets' dtype.
        dtype: DType,
    },
    /// Logits with rows but no classes.
    #[error("cross_entropy: logits {shape:?} have no classes")]
    NoClasses {
        /// The logits' shape.
        shape: Shape,
    },
    /// A target outside `0..classes`.
    #[error("cross_entropy: target {target} of row {row} is outside 0..{classes}")]
    TargetOutOfRange {
        /// The row.
        row: usize,
        /// The target.
        target: i64,
        /// Number of classes.
        classes: usize,
    },
    /// An environment variable read once into allgrad-nn's settings holds a value it cannot take.
    #[error("{var}={value:?}: {why}")]
    Setting {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What is wrong with it, and what it may be.
        why: String,
    },
    /// A CPU kernel got a non-contiguous input (a bug: the ops make inputs contiguous).
    #[error("{op}: input is not contiguous")]
    NotContiguous {
        /// The kernel.
        op: &'static str,
    },
}

impl From<NnError> for candle_core::Error {
    fn from(e: NnError) -> Self {
        candle_core::Error::wrap(e)
    }
}

/// `Err(e.into())` for the `candle_core::Result`-returning ops.
pub(crate) fn fail<T>(e: NnError) -> candle_core::Result<T> {
    Err(e.into())
}
