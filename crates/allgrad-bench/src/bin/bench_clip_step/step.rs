//! One CLIP training step in allgrad, timed by phase.

use std::time::Instant;

use allgrad::dist::ProcessGroup;
use allgrad::models::clip::loss::MAX_LOGIT_SCALE;
use allgrad::models::clip::{clip_loss, ClipConfig, ClipModel};
use allgrad::train::config::ParamGroupsConfig;
use allgrad::train::optim::{groups, OptimConfig, Optimizer};
use allgrad::train::params::ParamStore;
use candle_core::{DType, Device, Tensor, Var};

use allgrad_bench::machine::Usage;
use allgrad_bench::sample::{sample, Sample};

/// AdamW as OpenCLIP trains a ViT CLIP (its `main.py` defaults: lr 5e-4, betas 0.9 / 0.98,
/// eps 1e-6) with weight decay 0.2 on the parameters of two or more dimensions only
/// (`param_groups.exclude_1d`, OpenCLIP's groups).
pub const LR: f64 = 5e-4;
pub const BETA2: f64 = 0.98;
pub const EPS: f64 = 1e-6;
pub const WEIGHT_DECAY: f64 = 0.2;

/// The towers' sizes, shared with the PyTorch side (`bench_clip_step.py`'s options).
#[derive(Clone, Copy, Debug)]
pub struct Towers {
    pub image_size: usize,
    pub patch: usize,
    pub vision_width: usize,
    pub vision_layers: usize,
    pub text_width: usize,
    pub text_layers: usize,
    pub context: usize,
    pub vocab: usize,
    pub embed_dim: usize,
    pub head_width: usize,
}

impl Towers {
    /// The `config.json` of these towers as `transformers`' `CLIPConfig` writes it: exact GELU
    /// (OpenCLIP's default, `quick_gelu` off), MLP ratio 4, heads of `head_width`, layer-norm
    /// epsilon 1e-5, OpenAI's end-of-text id (the largest: OpenCLIP's argmax pooling finds it).
    pub fn config(&self) -> anyhow::Result<ClipConfig> {
        let json = serde_json::json!({
            "projection_dim": self.embed_dim,
            "logit_scale_init_value": (1.0f64 / 0.07).ln(),
            "text_config": {
                "vocab_size": self.vocab, "hidden_size": self.text_width, "intermediate_size": 4 * self.text_width,
                "num_hidden_layers": self.text_layers, "num_attention_heads": self.text_width / self.head_width,
                "max_position_embeddings": self.context, "hidden_act": "gelu", "layer_norm_eps": 1e-5,
                "eos_token_id": self.vocab - 1,
            },
            "vision_config": {
                "hidden_size": self.vision_width, "intermediate_size": 4 * self.vision_width,
                "num_hidden_layers": self.vision_layers, "num_attention_heads": self.vision_width / self.head_width,
                "num_channels": 3, "image_size": self.image_size, "patch_size": self.patch, "hidden_act": "gelu",
                "layer_norm_eps": 1e-5,
            },
        });
        ClipConfig::from_json(&json.to_string()).map_err(|e| anyhow::anyhow!("the benchmark's towers: {e}"))
    }
}

/// `batch` fixed captions of `context` tokens each (every caption fills the context, as
/// OpenCLIP's tokenizer pads every caption to it, so both sides run the same sequence
/// length): ids below the end-of-text id from a fixed linear congruential sequence, the
/// end-of-text id (`vocab - 1`) last.
pub fn captions(batch: usize, context: usize, vocab: usize) -> Vec<Vec<u32>> {
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = || {
        state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        ((state >> 33) % (vocab as u64 - 2)) as u32 + 1
    };
    (0..batch).map(|_| (0..context - 1).map(|_| next()).chain([vocab as u32 - 1]).collect()).collect()
}

/// CLIP's towers of [`Towers`], freshly initialised, OpenCLIP's symmetric InfoNCE over the batch
/// on one rank (`clip_loss`), the trainer's AdamW with OpenCLIP's parameter groups and the
/// logit scale's clamp to [0, ln 100] after the update: the step `scripts/bench/bench_clip_step.py`
/// runs with open-clip-torch. Inputs are fixed random images `[B, 3, S, S]` and captions
/// ([`captions`]), made once.
pub struct AllgradStep {
    model: ClipModel,
    params: Vec<(String, Var)>,
    optimizer: Optimizer,
    pixels: Tensor,
    ids: Vec<Vec<u32>>,
    pad_id: u32,
    scale_index: usize,
    pg: ProcessGroup,
    device: Device,
}

impl AllgradStep {
    pub fn new(towers: Towers, batch: usize) -> anyhow::Result<Self> {
        let device = Device::Cpu;
        let cfg = towers.config()?;
        let store = ParamStore::new(0);
        let model = ClipModel::new(&store.var_builder(DType::F32, &device), &cfg)?;
        let params = store.vars();
        let optim = OptimConfig::Adamw { lr: LR, beta1: 0.9, beta2: BETA2, eps: EPS, weight_decay: WEIGHT_DECAY };
        let shapes: Vec<(String, Vec<usize>)> = params.iter().map(|(n, v)| (n.clone(), v.dims().to_vec())).collect();
        let rules = groups::resolve(&optim, &ParamGroupsConfig::default(), &shapes).map_err(anyhow::Error::msg)?;
        let optimizer = Optimizer::with_rules(optim, rules);
        let scale_index = params
            .iter()
            .position(|(n, _)| n == "logit_scale")
            .ok_or_else(|| anyhow::anyhow!("the CLIP model has no logit_scale"))?;
        let s = towers.image_size;
        let pixels = Tensor::randn(0f32, 1f32, (batch, 3, s, s), &device)?;
        let ids = captions(batch, towers.context, towers.vocab);
        let pad_id = towers.vocab as u32 - 1;
        Ok(AllgradStep { model, params, optimizer, pixels, ids, pad_id, scale_index, pg: ProcessGroup::single(), device })
    }

    /// The numbers in the parameters.
    pub fn parameter_count(&self) -> usize {
        self.params.iter().map(|(_, v)| v.elem_count()).sum()
    }

    /// One step: forward (both towers, the loss), backward (which frees the graph as it goes),
    /// AdamW update and the clamp; the wall time also covers freeing the gradients.
    pub fn run(&mut self) -> anyhow::Result<Sample> {
        let start = Usage::now();
        // The embeddings go out of scope with the forward: only the loss holds the graph,
        // which the backward frees as it goes.
        let loss = {
            let images = self.model.vision.forward(&self.pixels)?;
            let texts = self.model.text.forward(&self.ids, self.pad_id, &self.device)?;
            clip_loss(&images, &texts, &self.model.logit_scale, &self.pg)?
        };
        let at_fwd = Usage::now();
        let t_fwd = at_fwd.at;
        let grads = loss.backward_release()?;
        let at_bwd = Usage::now();
        let t_bwd = at_bwd.at;
        let g = self
            .params
            .iter()
            .map(|(name, v)| grads.get(v).cloned().ok_or_else(|| anyhow::anyhow!("no gradient for {name}")))
            .collect::<anyhow::Result<Vec<Tensor>>>()?;
        let sharded = vec![false; g.len()];
        self.optimizer.step(&self.params, &g, &sharded, LR, &self.pg)?;
        // The logit scale clamped to [0, ln 100], as the trainer clamps it (Trainer::clamp_params).
        let v = &self.params[self.scale_index].1;
        v.set(&v.as_tensor().detach().clamp(0f32, MAX_LOGIT_SCALE.ln() as f32)?)?;
        let t_opt = Instant::now();
        drop((g, grads));
        let end = Usage::now();
        let secs = |a: Instant, b: Instant| b.duration_since(a).as_secs_f64();
        let mut s =
            sample(start, end, [("fwd", secs(start.at, t_fwd)), ("bwd", secs(t_fwd, t_bwd)), ("opt", secs(t_bwd, t_opt))]);
        s.extend(at_fwd.backward_counts(&at_bwd).map(|(k, v)| (k.to_string(), v)));
        Ok(s)
    }
}
