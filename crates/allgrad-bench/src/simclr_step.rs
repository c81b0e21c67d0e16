//! One SimCLR training step in allgrad, timed by phase.

use std::time::Instant;

use allgrad::dist::ProcessGroup;
use allgrad::models::batch_norm::Mode;
use allgrad::models::losses::nt_xent;
use allgrad::models::resnet::{ResNet, ResNetConfig, Stem};
use allgrad::train::optim::{OptimConfig, Optimizer};
use allgrad::train::params::ParamStore;
use candle_core::Var;
use candle_core::{DType, Device, Tensor};
use candle_nn::Linear;

use crate::machine::Usage;
use crate::sample::{insert_traffic, sample, Sample};

/// ResNet-18 or -50 (CIFAR stem) + projector (features)-2048-128, NT-Xent (temperature 0.5),
/// SGD (lr 0.1, allgrad's optimizer as the trainer runs it: in place, one parallel pass per
/// parameter) on `2 * batch` fixed random views, on the CPU or a GPU: the step
/// `scripts/bench/bench_simclr_step.py` runs in PyTorch. On a GPU every phase boundary waits for
/// the device, so the phases time the work rather than its queueing.
pub struct AllgradStep {
    batch: usize,
    pg: ProcessGroup,
    enc: ResNet,
    p1: Linear,
    p2: Linear,
    params: Vec<(String, Var)>,
    sgd: Optimizer,
    x: Tensor,
    /// The forward under bf16 autocast (`precision: bf16`), the loss in f32.
    bf16: bool,
}

impl AllgradStep {
    pub fn new(batch: usize, width: usize, depth: usize, dev: &Device) -> anyhow::Result<Self> {
        let store = ParamStore::new(0);
        let vb = store.var_builder(DType::F32, dev);
        let cfg = ResNetConfig { depth, width, in_channels: 3, stem: Stem::Cifar, sync_bn: false };
        let enc = ResNet::new(&cfg, vb.pp("encoder"))?;
        let p1 = candle_nn::linear(enc.feature_dim(), 2048, vb.pp("proj.0"))?;
        let p2 = candle_nn::linear(2048, 128, vb.pp("proj.1"))?;
        let params = store.vars();
        let sgd = Optimizer::new(OptimConfig::Sgd { lr: 0.1, momentum: 0.0, nesterov: false, weight_decay: 0.0 });
        let x = Tensor::randn(0f32, 1.0, (2 * batch, 3, 32, 32), dev)?;
        Ok(AllgradStep { batch, pg: ProcessGroup::single(), enc, p1, p2, params, sgd, x, bf16: false })
    }

    /// The same step with its forward under bf16 autocast, as the trainer runs `precision: bf16`.
    pub fn bf16(mut self, on: bool) -> Self {
        self.bf16 = on;
        self
    }

    /// One step: forward (encoder, projector, loss), backward (which frees the graph as it
    /// goes), SGD update; the wall time also covers freeing the gradients.
    pub fn run(&mut self) -> anyhow::Result<Sample> {
        self.run_probed(&mut |_| {})
    }

    /// [`AllgradStep::run`], calling `probe` at the end of each phase (`"fwd"`, `"bwd"`,
    /// `"opt"`) while that phase's tensors are alive (the memory benchmark reads its figures
    /// there).
    pub fn run_probed(&mut self, probe: &mut dyn FnMut(&'static str)) -> anyhow::Result<Sample> {
        crate::machine::device_peak::reset(self.x.device());
        let traffic = allgrad_nn::host_traffic();
        let start = Usage::now();
        let b = self.batch;
        // Only the loss holds the graph, so that the backward releases it as it goes (as the
        // trainer's step does).
        let loss = {
            let z = {
                let _autocast = self.bf16.then(allgrad_nn::autocast::Autocast::bf16);
                let h = self.enc.forward(&self.x, Mode { train: true, pg: &self.pg })?;
                let dense = allgrad_nn::linear_module;
                dense(&self.p2, &allgrad_nn::relu(&dense(&self.p1, &h)?)?)?
            };
            let z = allgrad_nn::autocast::full(&z)?;
            nt_xent(&z.narrow(0, 0, b)?, &z.narrow(0, b, b)?, 0.5, &self.pg)?
        };
        let dev = self.x.device();
        dev.synchronize()?;
        let at_fwd = Usage::now();
        let t_fwd = at_fwd.at;
        let traffic_fwd = allgrad_nn::host_traffic();
        probe("fwd");
        let grads = loss.backward_release()?;
        dev.synchronize()?;
        let at_bwd = Usage::now();
        let t_bwd = at_bwd.at;
        let traffic_bwd = allgrad_nn::host_traffic();
        probe("bwd");
        let g: Vec<Tensor> = self
            .params
            .iter()
            .map(|(name, v)| grads.get(v).cloned().ok_or_else(|| anyhow::anyhow!("no gradient for {name}")))
            .collect::<anyhow::Result<_>>()?;
        self.sgd.step(&self.params, &g, &vec![false; g.len()], 0.1, &self.pg)?;
        dev.synchronize()?;
        let t_opt = Instant::now();
        let traffic_opt = allgrad_nn::host_traffic();
        probe("opt");
        drop(grads);
        let end = Usage::now();
        let secs = |a: Instant, b: Instant| b.duration_since(a).as_secs_f64();
        let mut s =
            sample(start, end, [("fwd", secs(start.at, t_fwd)), ("bwd", secs(t_fwd, t_bwd)), ("opt", secs(t_bwd, t_opt))]);
        s.extend(at_fwd.backward_counts(&at_bwd).map(|(k, v)| (k.to_string(), v)));
        if let Some(mib) = crate::machine::device_peak::read(dev) {
            s.insert("gpu_peak".into(), mib);
        }
        if let Some(mib) = crate::machine::device_peak::reserved(dev) {
            s.insert("gpu_reserved".into(), mib);
        }
        insert_traffic(&mut s, [traffic, traffic_fwd, traffic_bwd, traffic_opt]);
        Ok(s)
    }
}
