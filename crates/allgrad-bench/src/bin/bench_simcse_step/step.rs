//! One unsupervised SimCSE training step in allgrad, timed by phase.

use std::path::Path;
use std::time::Instant;

use allgrad::dist::ProcessGroup;
use allgrad::models::bert::Pooling;
use allgrad::models::simcse::{SimCse, SimCseData, SimCseLoss, SimCseModel};
use allgrad::models::{Batch, Objective};
use allgrad::train::optim::{OptimConfig, Optimizer};
use allgrad::train::params::ParamStore;
use candle_core::{DType, Device, Tensor, Var};

use allgrad_bench::machine::{self, Usage};
use allgrad_bench::sample::{insert_traffic, sample, Sample};

/// AdamW's learning rate (configs/simcse.yaml's peak; the step time does not depend on it).
const LR: f64 = 3e-5;

/// The `simcse` method's objective (mean pooling, MLP head, temperature 0.05) on the BERT of a
/// Hugging Face folder with its dropout (on), over `batch` fixed sentences, and the trainer's
/// AdamW (weight decay 0), on the CPU or a GPU, the forward optionally under bf16 autocast (as
/// the trainer runs `precision: bf16`): the step `scripts/bench/bench_simcse_step.py` runs in
/// PyTorch. On a GPU every phase boundary waits for the device.
pub struct AllgradStep {
    objective: SimCse,
    params: Vec<(String, Var)>,
    optimizer: Optimizer,
    indices: Vec<usize>,
    pg: ProcessGroup,
    step: usize,
    device: Device,
    bf16: bool,
}

impl AllgradStep {
    pub fn new(model_dir: &Path, sentences: Vec<String>, max_len: usize, device: &Device, bf16: bool) -> anyhow::Result<Self> {
        let batch = sentences.len();
        let model =
            SimCseModel { dir: model_dir.to_path_buf(), pretrained: true, pooling: Pooling::Mean, mlp_head: true, max_len };
        let data = SimCseData::Sentences(sentences);
        let mut objective = SimCse::new(model, SimCseLoss::default(), data, device.clone(), DType::F32)?;
        let store = ParamStore::new(0);
        objective.build(store.var_builder(DType::F32, device))?;
        let optimizer = Optimizer::new(OptimConfig::Adamw { lr: LR, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 });
        let (params, indices) = (store.vars(), (0..batch).collect());
        let pg = ProcessGroup::single();
        Ok(AllgradStep { objective, params, optimizer, indices, pg, step: 0, device: device.clone(), bf16 })
    }

    /// One step: forward (both views in one batch, dropout masks of this step, loss),
    /// backward (which frees the graph as it goes), AdamW update; the wall time also covers
    /// freeing the gradients.
    pub fn run(&mut self) -> anyhow::Result<Sample> {
        machine::device_peak::reset(&self.device);
        let traffic = allgrad_nn::host_traffic();
        let start = Usage::now();
        let batch = Batch { indices: &self.indices, epoch: 0, step: self.step, seed: 0 };
        let loss = {
            let _autocast = self.bf16.then(allgrad_nn::autocast::Autocast::bf16);
            self.objective.loss(&batch, &self.pg)?
        };
        self.device.synchronize()?;
        let at_fwd = Usage::now();
        let t_fwd = at_fwd.at;
        let traffic_fwd = allgrad_nn::host_traffic();
        let grads = loss.backward_release()?;
        self.device.synchronize()?;
        let at_bwd = Usage::now();
        let t_bwd = at_bwd.at;
        let traffic_bwd = allgrad_nn::host_traffic();
        let g = self
            .params
            .iter()
            .map(|(name, v)| grads.get(v).cloned().ok_or_else(|| anyhow::anyhow!("no gradient for {name}")))
            .collect::<anyhow::Result<Vec<Tensor>>>()?;
        let sharded = vec![false; g.len()];
        self.optimizer.step(&self.params, &g, &sharded, LR, &self.pg)?;
        self.device.synchronize()?;
        let t_opt = Instant::now();
        let traffic_opt = allgrad_nn::host_traffic();
        drop((g, grads));
        self.step += 1;
        let end = Usage::now();
        let secs = |a: Instant, b: Instant| b.duration_since(a).as_secs_f64();
        let mut s =
            sample(start, end, [("fwd", secs(start.at, t_fwd)), ("bwd", secs(t_fwd, t_bwd)), ("opt", secs(t_bwd, t_opt))]);
        s.extend(at_fwd.backward_counts(&at_bwd).map(|(k, v)| (k.to_string(), v)));
        if let Some(mib) = machine::device_peak::read(&self.device) {
            s.insert("gpu_peak".into(), mib);
        }
        if let Some(mib) = machine::device_peak::reserved(&self.device) {
            s.insert("gpu_reserved".into(), mib);
        }
        insert_traffic(&mut s, [traffic, traffic_fwd, traffic_bwd, traffic_opt]);
        Ok(s)
    }
}
