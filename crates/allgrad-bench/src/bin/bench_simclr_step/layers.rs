//! The per-layer-type breakdown on allgrad's side: every layer of the benchmark's ResNet-18
//! (CIFAR stem) and projector, at its shape in the step, timed alone. `layer_shapes` mirrors
//! `resnet18_layers` in `scripts/bench/bench_simclr_step.py`, which times PyTorch's layers.
//!
//! Candle cannot start a backward pass from a given output gradient, so the backward of a
//! layer `y = f(x)` is timed as that of `sum(y * g)` (random `g`, built untimed) minus the
//! same backward with `f` the identity (the mul, the sum and Candle's gradient accumulation
//! at `y`'s size): a difference of two timings, so noisier than the forward.

use std::time::Instant;

use allgrad::dist::ProcessGroup;
use allgrad::models::batch_norm::{BatchNorm, Mode};
use allgrad::models::losses::nt_xent;
use allgrad::train::params::ParamStore;
use allgrad_nn::{adaptive_avg_pool2d, conv2d, ConvParams};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::Module;

/// One layer: its type and shape (views omitted).
#[derive(Clone, Copy, Debug)]
pub enum Layer {
    /// cin, cout, kernel, stride, input height (= width), and whether the backward computes the
    /// input's gradient (`conv_dx`, the weight a constant) or the weight's (`conv_dw`, the
    /// input a constant): each convolution appears once as each.
    Conv(usize, usize, usize, usize, usize, bool),
    /// Channels, height; a height of 0 means a `[views, channels]` input.
    Bn(usize, usize),
    Relu(usize, usize),
    Add(usize, usize),
    Pool(usize, usize),
    /// in, out features.
    Linear(usize, usize),
    /// Embedding width of the NT-Xent loss (temperature 0.5).
    Loss(usize),
}

/// The layer types in table order.
pub const KINDS: [&str; 8] = ["conv_dx", "conv_dw", "bn", "relu", "add", "pool", "linear", "loss"];

impl Layer {
    pub fn kind(&self) -> &'static str {
        match self {
            Layer::Conv(.., true) => "conv_dx",
            Layer::Conv(.., false) => "conv_dw",
            Layer::Bn(..) => "bn",
            Layer::Relu(..) => "relu",
            Layer::Add(..) => "add",
            Layer::Pool(..) => "pool",
            Layer::Linear(..) => "linear",
            Layer::Loss(..) => "loss",
        }
    }
}

/// Every layer of the step's model, in forward order within each type.
pub fn layer_shapes(width: usize) -> Vec<Layer> {
    let mut out = Vec::new();
    let conv_bn = |out: &mut Vec<Layer>, cin, cout, k, stride, h: usize| {
        out.push(Layer::Conv(cin, cout, k, stride, h, true));
        out.push(Layer::Conv(cin, cout, k, stride, h, false));
        out.push(Layer::Bn(cout, h / stride));
    };
    conv_bn(&mut out, 3, width, 3, 1, 32);
    out.push(Layer::Relu(width, 32));
    let (mut cin, mut h) = (width, 32);
    for stage in 0..4 {
        let planes = width << stage;
        for i in 0..2 {
            let stride = if stage > 0 && i == 0 { 2 } else { 1 };
            conv_bn(&mut out, cin, planes, 3, stride, h);
            out.push(Layer::Relu(planes, h / stride));
            conv_bn(&mut out, planes, planes, 3, 1, h / stride);
            if stride != 1 || cin != planes {
                conv_bn(&mut out, cin, planes, 1, stride, h);
            }
            out.push(Layer::Add(planes, h / stride));
            out.push(Layer::Relu(planes, h / stride));
            (cin, h) = (planes, h / stride);
        }
    }
    out.push(Layer::Pool(cin, h));
    out.push(Layer::Linear(cin, 2048));
    out.push(Layer::Linear(2048, 128));
    out.push(Layer::Relu(2048, 0)); // the projector's ReLU
    out.push(Layer::Loss(128));
    out
}

fn randn(dims: &[usize]) -> candle_core::Result<Var> {
    Var::from_tensor(&Tensor::randn(0f32, 1.0, dims, &Device::Cpu)?)
}

fn image(n: usize, c: usize, h: usize) -> Vec<usize> {
    if h == 0 {
        vec![n, c]
    } else {
        vec![n, c, h, h]
    }
}

/// The forward of one layer at `n` views, with its inputs and parameters built (untimed).
fn instance(layer: Layer, n: usize, pg: &ProcessGroup) -> candle_core::Result<Box<dyn Fn() -> candle_core::Result<Tensor> + '_>> {
    Ok(match layer {
        Layer::Conv(cin, cout, k, stride, h, input_grad) => {
            // The tracked one (a Var) gets a gradient; the other is a constant.
            let (x, w) = (randn(&[n, cin, h, h])?, randn(&[cout, cin, k, k])?);
            let (x, w) = if input_grad {
                (x.as_tensor().clone(), w.as_detached_tensor())
            } else {
                (x.as_detached_tensor(), w.as_tensor().clone())
            };
            let p = ConvParams { stride, padding: k / 2, ..Default::default() };
            Box::new(move || conv2d(&x, &w, p))
        }
        Layer::Bn(c, h) => {
            let store = ParamStore::new(0);
            let bn = BatchNorm::new(c, false, store.var_builder(DType::F32, &Device::Cpu))?;
            let x = randn(&image(n, c, h))?;
            Box::new(move || bn.forward(&x, Mode { train: true, pg }))
        }
        Layer::Relu(c, h) => {
            let x = randn(&image(n, c, h))?;
            Box::new(move || allgrad_nn::relu(&x))
        }
        // The model fuses each residual add into the ReLU after it (`allgrad_nn::add_relu`); the
        // add is timed alone here, as PyTorch's, so the table over-counts ours by about one
        // pass per residual.
        Layer::Add(c, h) => {
            let (a, b) = (randn(&image(n, c, h))?, randn(&image(n, c, h))?);
            Box::new(move || a.as_tensor() + b.as_tensor())
        }
        Layer::Pool(c, h) => {
            let x = randn(&image(n, c, h))?;
            Box::new(move || adaptive_avg_pool2d(&x, 1)?.flatten_from(1))
        }
        Layer::Linear(i, o) => {
            let store = ParamStore::new(0);
            let lin = candle_nn::linear(i, o, store.var_builder(DType::F32, &Device::Cpu))?;
            let x = randn(&[n, i])?;
            Box::new(move || lin.forward(&x))
        }
        Layer::Loss(d) => {
            let z = randn(&[n, d])?;
            Box::new(move || nt_xent(&z.narrow(0, 0, n / 2)?, &z.narrow(0, n / 2, n / 2)?, 0.5, pg))
        }
    })
}

/// Seconds of `f`.
fn timed<T>(f: impl FnOnce() -> candle_core::Result<T>) -> candle_core::Result<(T, f64)> {
    let t = Instant::now();
    let out = f()?;
    Ok((out, t.elapsed().as_secs_f64()))
}

/// (kind, count, forward s, backward s) per layer type of `kinds`, each layer timed alone at
/// `2 * batch` views.
pub fn layer_times(batch: usize, width: usize, kinds: &[&str]) -> candle_core::Result<Vec<(String, usize, f64, f64)>> {
    let pg = ProcessGroup::single();
    let layers = layer_shapes(width);
    let mut table = Vec::new();
    for &kind in kinds {
        let (mut count, mut fwd, mut bwd) = (0, 0.0, 0.0);
        for &layer in layers.iter().filter(|l| l.kind() == kind) {
            let forward = instance(layer, 2 * batch, &pg)?;
            let (y, t_fwd) = timed(&*forward)?;
            let g = Tensor::randn(0f32, 1.0, y.dims(), &Device::Cpu)?;
            let objective = (&y * &g)?.sum_all()?;
            let (_, t_with) = timed(|| objective.backward())?;
            let identity = Var::zeros(y.dims(), DType::F32, &Device::Cpu)?;
            let objective = (identity.as_tensor() * &g)?.sum_all()?;
            let (_, t_without) = timed(|| objective.backward())?;
            count += 1;
            fwd += t_fwd;
            bwd += t_with - t_without;
        }
        table.push((kind.to_string(), count, fwd, bwd));
    }
    Ok(table)
}
