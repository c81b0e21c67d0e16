//! Batch normalisation, per rank or synchronised across ranks.
//!
//! [`BatchNorm`] with `sync: true` is SyncBatchNorm: the per-channel sums (and then the sums of
//! squared deviations) go through the differentiable `all_reduce`, so the statistics are those
//! of the GLOBAL batch, the backward follows the sum rule, and a W-rank run normalises exactly
//! like one rank on the whole batch. The running statistics are updated from those global
//! values, so they are identical on every rank. With `sync: false` each rank normalises with
//! its own batch (plain BatchNorm: W-rank runs then differ from 1-rank runs).
//!
//! On the CPU (f32/f64), and on CUDA with feature `cuda` (allgrad-nn's CUDA kernels, unless
//! `ALLGRAD_CUDA_FUSED=0`), the layer, and the ReLU or residual `relu(· + skip)` that follows it
//! (`forward_then`), is allgrad-nn's one fused op: a moments pass (sums in f64) whose `[2, C]`
//! result SyncBatchNorm all-reduces, the normalisation pass, and a two-pass closed-form
//! backward whose `[2, C]` per-channel sums go through one more all_reduce (the sum rule).
//! Elsewhere the same function is composed from the per-channel passes, the differentiable
//! all_reduce and the activation. bf16 activations (autocast) take the fused op with the f32
//! parameters; the statistics, the running statistics and the parameters' gradients stay f32
//! (the moments f64).
//!
//! On CUDA (and on the CPU with [`allgrad_nn::transfer::set_device_path`]) the fused path keeps
//! everything on the device: the moments `[Σx; Σx²; n]` ([`allgrad_nn::batch_moments`]) are
//! all-reduced as a tensor (through NCCL, or the group's host path), the statistics and the
//! running statistics come from the finalize op ([`allgrad_nn::batch_statistics`]) and tensor
//! ops, and the backward's sums are all-reduced as a tensor too: the forward and backward never
//! wait for the GPU. On the CPU without it (the default) the same numbers are computed on the
//! host.

use std::sync::{Arc, Mutex};

use allgrad_dist::{all_reduce, ProcessGroup, ReduceOp};
pub use allgrad_nn::BnTail;
use allgrad_nn::{add_relu, channel_affine, channel_moments, relu, BnBranch, BnStats, ChannelSum, TensorSum};
use candle_core::{DType, Result, Tensor};
use candle_nn::VarBuilder;

use crate::error::fail;
use crate::ModelError;

/// The configuration of a [`BatchNorm`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchNormConfig {
    /// Added to the variance before the square root (positive).
    pub eps: f64,
    /// Weight of the new batch's statistics in the running statistics, in [0, 1].
    pub momentum: f64,
    /// Synchronise the batch statistics across ranks (SyncBatchNorm).
    pub sync: bool,
}

impl Default for BatchNormConfig {
    /// PyTorch's defaults (eps 1e-5, momentum 0.1), per rank.
    fn default() -> Self {
        BatchNormConfig { eps: 1e-5, momentum: 0.1, sync: false }
    }
}

/// Batch normalisation over dim 1 of `[N, C]` or `[N, C, H, W]` inputs.
pub struct BatchNorm {
    weight: Tensor,
    bias: Tensor,
    running: Mutex<(Tensor, Tensor)>,
    eps: f64,
    momentum: f64,
    sync: bool,
    name: String,
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
    /// `channels` channels with the default eps and momentum; `weight` starts at 1 and `bias`
    /// at 0.
    pub fn new(channels: usize, sync: bool, vb: VarBuilder) -> Result<Self> {
        Self::from_vb(channels, BatchNormConfig { sync, ..Default::default() }, vb)
    }

    /// `channels` channels configured by `cfg`, parameters `weight` (from 1) and `bias` (from
    /// 0) created through `vb`.
    pub fn from_vb(channels: usize, cfg: BatchNormConfig, vb: VarBuilder) -> Result<Self> {
        let BatchNormConfig { eps, momentum, sync } = cfg;
        if !(eps > 0.0 && eps.is_finite() && (0.0..=1.0).contains(&momentum)) {
            return fail(ModelError::BatchNormConfig { eps, momentum });
        }
        let weight = vb.get_with_hints(channels, "weight", candle_nn::Init::Const(1.0))?;
        let bias = vb.get_with_hints(channels, "bias", candle_nn::Init::Const(0.0))?;
        let zeros = Tensor::zeros(channels, DType::F32, vb.device())?.to_dtype(vb.dtype())?;
        let ones = Tensor::ones(channels, DType::F32, vb.device())?.to_dtype(vb.dtype())?;
        let name = vb.prefix();
        Ok(BatchNorm { weight, bias, running: Mutex::new((zeros, ones)), eps, momentum, sync, name })
    }

    /// As [`BatchNorm::new`], with the weight held at 1 and not a parameter (only `bias` is
    /// created through `vb`): insightface's embedding layer `features`, a BatchNorm1d whose
    /// weight it sets to 1 and freezes.
    pub fn with_unit_weight(channels: usize, sync: bool, vb: VarBuilder) -> Result<Self> {
        let bias = vb.get_with_hints(channels, "bias", candle_nn::Init::Const(0.0))?;
        let weight = Tensor::ones(channels, DType::F32, vb.device())?.to_dtype(bias.dtype())?;
        let zeros = Tensor::zeros(channels, DType::F32, vb.device())?.to_dtype(vb.dtype())?;
        let ones = Tensor::ones(channels, DType::F32, vb.device())?.to_dtype(vb.dtype())?;
        let BatchNormConfig { eps, momentum, .. } = BatchNormConfig::default();
        Ok(BatchNorm { weight, bias, running: Mutex::new((zeros, ones)), eps, momentum, sync, name: vb.prefix() })
    }

    /// Normalises `x`.
    pub fn forward(&self, x: &Tensor, mode: Mode) -> Result<Tensor> {
        self.forward_then(x, mode, BnTail::Identity)
    }

    /// Normalises `x`, then applies `tail` (a ReLU, or the residual `relu(· + skip)`). On the
    /// CPU in f32/f64 (and on CUDA with allgrad-nn's kernels) the layer and its tail are one fused op ([`allgrad_nn::batch_norm`]: two
    /// passes each way); elsewhere they are composed from the per-channel passes, the
    /// differentiable all_reduce and the activation. Both compute the same function and
    /// gradient.
    pub fn forward_then(&self, x: &Tensor, mode: Mode, tail: BnTail) -> Result<Tensor> {
        let c = self.weight.dim(0)?;
        if x.rank() < 2 || x.dim(1)? != c {
            return fail(ModelError::BatchNormInput { channels: c, shape: x.dims().to_vec() });
        }
        if self.fused_for(x) {
            return self.forward_fused(x, mode, tail);
        }
        let (mean, var) = if mode.train {
            // Per-channel [Σx, Σx²] in one fused pass (summed in f64), then over ranks.
            let mut moments = channel_moments(x)?;
            let mut count = [(x.elem_count() / c) as i64];
            if self.sync {
                moments = all_reduce(&moments, ReduceOp::Sum, mode.pg)?;
                mode.pg.all_reduce_slice(&mut count, ReduceOp::Sum)?;
            }
            let n = count[0] as f64;
            let mean = (moments.get(0)? / n)?;
            let var = ((moments.get(1)? / n)? - mean.sqr()?)?.relu()?;
            self.update_running(&mean, &var, n)?;
            (mean, var)
        } else {
            self.running.lock().unwrap_or_else(|p| p.into_inner()).clone()
        };
        // y = x · a + b per channel, with a = γ / sqrt(var + eps) and b = β − mean · a,
        // computed in f64 (the moments are f64) and rounded to x's dtype at the end.
        let dt = x.dtype();
        let inv_std = (var.to_dtype(DType::F64)? + self.eps)?.sqrt()?.recip()?;
        let a = (self.weight.to_dtype(DType::F64)? * inv_std)?;
        let b = (self.bias.to_dtype(DType::F64)? - (mean.to_dtype(DType::F64)? * &a)?)?;
        let y = channel_affine(x, &a.to_dtype(dt)?, &b.to_dtype(dt)?)?;
        match tail {
            BnTail::Identity => Ok(y),
            BnTail::Relu => relu(&y),
            BnTail::AddRelu(skip) => add_relu(&y, skip),
            BnTail::AddBnRelu(_) => candle_core::bail!(
                "batch norm {}: a normalised shortcut is added through BatchNorm::forward_add_shortcut",
                self.name
            ),
        }
    }

    /// `relu(self(x) + shortcut(x_shortcut))`: a residual connection whose shortcut is batch
    /// normalised by `shortcut` (a ResNet's downsampling shortcut). On the CPU (f32/f64), and
    /// on CUDA with allgrad-nn's kernels, one fused op ([`allgrad_nn::BnTail::AddBnRelu`]) that keeps only both inputs and the output
    /// for the backward, never the shortcut's normalised values; elsewhere the shortcut's
    /// batch norm, then [`BnTail::AddRelu`]. Both compute the same function and gradient, and
    /// update both layers' running statistics.
    pub fn forward_add_shortcut(&self, x: &Tensor, mode: Mode, shortcut: &BatchNorm, x_shortcut: &Tensor) -> Result<Tensor> {
        let c = self.weight.dim(0)?;
        if x.rank() < 2 || x.dim(1)? != c {
            return fail(ModelError::BatchNormInput { channels: c, shape: x.dims().to_vec() });
        }
        if !(self.fused_for(x) && shortcut.fused_for(x_shortcut) && x.dims() == x_shortcut.dims()) {
            let skip = shortcut.forward(x_shortcut, mode)?;
            return self.forward_then(x, mode, BnTail::AddRelu(&skip));
        }
        // The shortcut's statistics first, as in the composed order.
        let shortcut_stats = shortcut.stats(x_shortcut, mode)?;
        let stats = self.stats(x, mode)?;
        let branch =
            BnBranch { x: x_shortcut, weight: &shortcut.weight, bias: &shortcut.bias, stats: &shortcut_stats, eps: shortcut.eps };
        allgrad_nn::batch_norm(x, &self.weight, &self.bias, &stats, self.eps, BnTail::AddBnRelu(&branch))
    }

    /// Whether `x` takes the fused op: on a device with allgrad-nn's fused kernels (the CPU, or
    /// CUDA with feature `cuda`, [`allgrad_nn::has_fused_kernels`]), f32/f64 with parameters of
    /// its dtype, or bf16 activations (autocast) with f32 parameters.
    fn fused_for(&self, x: &Tensor) -> bool {
        let w = self.weight.dtype();
        allgrad_nn::has_fused_kernels(x)
            && (matches!(x.dtype(), DType::F32 | DType::F64) && w == x.dtype() || x.dtype() == DType::BF16 && w == DType::F32)
    }

    /// The fused path: statistics from one untracked moments pass (summed over ranks with
    /// `sync`), then the fused op, whose backward sums its per-channel sums over the same ranks.
    fn forward_fused(&self, x: &Tensor, mode: Mode, tail: BnTail) -> Result<Tensor> {
        let stats = self.stats(x, mode)?;
        allgrad_nn::batch_norm(x, &self.weight, &self.bias, &stats, self.eps, tail)
    }

    /// The statistics the fused op normalises `x` with: in training the batch's (over every
    /// rank's batch with `sync`, the running statistics updated), else the running ones.
    fn stats(&self, x: &Tensor, mode: Mode) -> Result<BnStats> {
        if allgrad_nn::transfer::takes_device_path(x.device()) {
            return self.stats_on_device(x, mode);
        }
        let c = self.weight.dim(0)?;
        let stats = if mode.train {
            let mut moments = allgrad_nn::transfer::read_vec::<f64>(&channel_moments(&x.detach())?)?;
            let mut count = [(x.elem_count() / c) as i64];
            if self.sync {
                mode.pg.all_reduce_slice(&mut moments, ReduceOp::Sum)?;
                mode.pg.all_reduce_slice(&mut count, ReduceOp::Sum)?;
            }
            let n = count[0] as f64;
            let mean: Vec<f64> = moments[..c].iter().map(|s| s / n).collect();
            // Clamped at 0 as the composed path's relu does (NaN passes through).
            let var: Vec<f64> =
                moments[c..].iter().zip(&mean).map(|(s2, m)| s2 / n - m * m).map(|v| if v < 0.0 { 0.0 } else { v }).collect();
            let dev = x.device();
            self.update_running(&Tensor::new(mean.as_slice(), dev)?, &Tensor::new(var.as_slice(), dev)?, n)?;
            let sum_over_ranks: Option<ChannelSum> = self.sync.then(|| {
                let pg = mode.pg.clone();
                Arc::new(move |s: &mut [f64]| Ok(pg.all_reduce_slice(s, ReduceOp::Sum)?)) as ChannelSum
            });
            BnStats::Batch { mean, var, count: n, sum_over_ranks }
        } else {
            let (mean, var) = self.running.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let host = allgrad_nn::transfer::read_f64;
            BnStats::Fixed { mean: host(&mean)?, var: host(&var)? }
        };
        Ok(stats)
    }

    /// [`BatchNorm::stats`] on the device path: the moments all-reduced as a tensor with
    /// `sync`, the statistics table from the finalize op, the running statistics updated by
    /// tensor ops, the backward's sums all-reduced as tensors; no value crosses to the host.
    fn stats_on_device(&self, x: &Tensor, mode: Mode) -> Result<BnStats> {
        if !mode.train {
            let (mean, var) = self.running_stats();
            return Ok(BnStats::FixedOnDevice { mean, var });
        }
        let c = self.weight.dim(0)?;
        let mut moments = allgrad_nn::batch_moments(x)?;
        if self.sync {
            moments = mode.pg.all_reduce(&moments, ReduceOp::Sum)?;
        }
        let table = allgrad_nn::batch_statistics(&moments)?;
        self.fold_running(&table.narrow(0, 0, c)?, &table.narrow(0, 2 * c, c)?)?;
        let sum_over_ranks: Option<TensorSum> = self.sync.then(|| {
            let pg = mode.pg.clone();
            Arc::new(move |t: &Tensor| pg.all_reduce(t, ReduceOp::Sum)) as TensorSum
        });
        Ok(BnStats::BatchOnDevice { table, sum_over_ranks })
    }

    /// Folds a batch's (global) mean and biased variance over `n` values into the running
    /// statistics (kept in the parameters' dtype, also for bf16 activations), with the unbiased
    /// variance as PyTorch does.
    fn update_running(&self, mean: &Tensor, var: &Tensor, n: f64) -> Result<()> {
        self.fold_running(mean, &(var.detach() * (n / (n - 1.0).max(1.0)))?)
    }

    /// Folds a batch's mean and unbiased variance into the running statistics:
    /// `running ← (1 − momentum)·running + momentum·batch`, in the parameters' dtype.
    fn fold_running(&self, mean: &Tensor, unbiased: &Tensor) -> Result<()> {
        let dt = self.weight.dtype();
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        let unbiased = unbiased.detach().to_dtype(dt)?;
        let mean_d = mean.detach().to_dtype(dt)?;
        let m = self.momentum;
        *running = (((&running.0 * (1.0 - m))? + (mean_d * m)?)?, ((&running.1 * (1.0 - m))? + (unbiased * m)?)?);
        Ok(())
    }

    /// The running mean and variance.
    pub fn running_stats(&self) -> (Tensor, Tensor) {
        self.running.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Replaces the running mean and variance (on resume), checking their shapes.
    pub fn set_running_stats(&self, mean: &Tensor, var: &Tensor) -> Result<()> {
        let c = self.weight.dim(0)?;
        if mean.dims() != [c] || var.dims() != [c] {
            candle_core::bail!(
                "batch norm {} has {c} channels, the running statistics given have shapes {:?} and {:?}",
                self.name,
                mean.dims(),
                var.dims()
            );
        }
        let dt = self.weight.dtype();
        *self.running.lock().unwrap_or_else(|p| p.into_inner()) = (mean.to_dtype(dt)?, var.to_dtype(dt)?);
        Ok(())
    }

    /// The layer's name (its parameters' prefix, e.g. `encoder.layer1.0.bn1`); the running
    /// statistics are the buffers `<name>.running_mean` and `<name>.running_var`.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// The running statistics of `layers` as named buffers (`<name>.running_mean`,
/// `<name>.running_var`). With `sync: true` they are identical on every rank by
/// construction (updated from the global statistics); with plain BatchNorm each rank's are
/// those of its own samples.
pub fn running_buffers(layers: &[&BatchNorm]) -> Result<Vec<(String, Tensor)>> {
    let mut out = Vec::with_capacity(2 * layers.len());
    for bn in layers {
        let (mean, var) = bn.running_stats();
        out.push((format!("{}.running_mean", bn.name), mean));
        out.push((format!("{}.running_var", bn.name), var));
    }
    Ok(out)
}

/// Restores what [`running_buffers`] returned: every layer's two buffers must be present, and
/// no other.
pub fn load_running_buffers(layers: &[&BatchNorm], buffers: &std::collections::HashMap<String, Tensor>) -> Result<()> {
    let get = |name: String| {
        buffers.get(&name).ok_or_else(|| candle_core::Error::Msg(format!("no buffer {name} among the {} given", buffers.len())))
    };
    for bn in layers {
        bn.set_running_stats(get(format!("{}.running_mean", bn.name))?, get(format!("{}.running_var", bn.name))?)?;
    }
    if buffers.len() != 2 * layers.len() {
        let known: std::collections::HashSet<String> =
            layers.iter().flat_map(|b| [format!("{}.running_mean", b.name), format!("{}.running_var", b.name)]).collect();
        let extra: Vec<&String> = buffers.keys().filter(|k| !known.contains(*k)).collect();
        candle_core::bail!("buffers {extra:?} belong to no batch norm of this model");
    }
    Ok(())
}
