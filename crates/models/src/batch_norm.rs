//! Batch normalisation, per rank or synchronised across ranks.
//!
//! [`BatchNorm`] with `sync: true` is SyncBatchNorm: the per-channel sums (and then the sums of
//! squared deviations) go through the differentiable `all_reduce`, so the statistics are those
//! of the GLOBAL batch, the backward follows the sum rule, and a W-rank run normalises exactly
//! like one rank on the whole batch. The running statistics are updated from those global
//! values, so they are identical on every rank. With `sync: false` each rank normalises with
//! its own batch (plain BatchNorm: W-rank runs then differ from 1-rank runs).

use std::sync::Mutex;

use allgrad_dist::{all_reduce, ProcessGroup, ReduceOp};
use candle_core::{DType, Result, Tensor};
use candle_nn::VarBuilder;

/// Batch normalisation over dim 1 of `[N, C]` or `[N, C, H, W]` inputs.
pub struct BatchNorm {
    weight: Tensor,
    bias: Tensor,
    running: Mutex<(Tensor, Tensor)>,
    eps: f64,
    momentum: f64,
    sync: bool,
}

/// Training or evaluation, and the group SyncBatchNorm reduces over.
#[derive(Clone, Copy)]
pub struct Mode<'a> {
    /// Batch statistics (and running-statistics updates) when true; running statistics otherwise.
    pub train: bool,
    /// The process group of the data-parallel run.
    pub pg: &'a ProcessGroup,
}

impl BatchNorm {
    /// `channels` channels; `weight` starts at 1 and `bias` at 0.
    pub fn new(channels: usize, sync: bool, vb: VarBuilder) -> Result<Self> {
        let weight = vb.get_with_hints(channels, "weight", candle_nn::Init::Const(1.0))?;
        let bias = vb.get_with_hints(channels, "bias", candle_nn::Init::Const(0.0))?;
        let zeros = Tensor::zeros(channels, DType::F32, vb.device())?.to_dtype(vb.dtype())?;
        let ones = Tensor::ones(channels, DType::F32, vb.device())?.to_dtype(vb.dtype())?;
        Ok(BatchNorm { weight, bias, running: Mutex::new((zeros, ones)), eps: 1e-5, momentum: 0.1, sync })
    }

    /// Normalises `x`.
    pub fn forward(&self, x: &Tensor, mode: Mode) -> Result<Tensor> {
        let c = self.weight.dim(0)?;
        let shape: Vec<usize> = (0..x.rank()).map(|d| if d == 1 { c } else { 1 }).collect();
        if x.rank() < 2 || x.dim(1)? != c {
            candle_core::bail!("batch norm over {c} channels got an input of shape {:?}", x.dims());
        }
        let (mean, var) = if mode.train {
            let reduce = |t: &Tensor| -> Result<Tensor> {
                // [N, C, ...] -> [N, C, rest]: summing the contiguous last dim first is far
                // faster on CPU than reducing over strided dims.
                let n = t.dim(0)?;
                let rest = t.elem_count() / (n * c).max(1);
                let s = t.reshape((n, c, rest))?.sum(2)?.sum_keepdim(0)?.reshape(shape.as_slice())?;
                if self.sync {
                    all_reduce(&s, ReduceOp::Sum, mode.pg)
                } else {
                    Ok(s)
                }
            };
            let mut count = [(x.elem_count() / c) as i64];
            if self.sync {
                mode.pg.all_reduce_slice(&mut count, ReduceOp::Sum)?;
            }
            let n = count[0] as f64;
            let mean = (reduce(x)? / n)?;
            let var = (reduce(&x.broadcast_sub(&mean)?.sqr()?)? / n)?;
            let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
            let unbiased = (var.detach().flatten_all()? * (n / (n - 1.0).max(1.0)))?;
            let m = self.momentum;
            *running = (
                ((&running.0 * (1.0 - m))? + (mean.detach().flatten_all()? * m)?)?,
                ((&running.1 * (1.0 - m))? + (unbiased * m)?)?,
            );
            (mean, var)
        } else {
            let running = self.running.lock().unwrap_or_else(|p| p.into_inner());
            (running.0.reshape(shape.as_slice())?, running.1.reshape(shape.as_slice())?)
        };
        let xhat = x.broadcast_sub(&mean)?.broadcast_div(&(var + self.eps)?.sqrt()?)?;
        xhat.broadcast_mul(&self.weight.reshape(shape.as_slice())?)?.broadcast_add(&self.bias.reshape(shape.as_slice())?)
    }

    /// The running mean and variance.
    pub fn running_stats(&self) -> (Tensor, Tensor) {
        self.running.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}
