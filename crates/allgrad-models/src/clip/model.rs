//! CLIP's two towers with Hugging Face's parameter names: a Vision Transformer (patch
//! embedding, class token, positional embeddings, pre-norm blocks, the class token's output
//! normalised and projected) and the causal text transformer (pooled at the end-of-text
//! token, normalised and projected), and the learned logit scale.
//!
//! Parameter names are those of `transformers`' `CLIPModel` (`vision_model.encoder.layers.0.
//! self_attn.q_proj.weight`, `text_projection.weight`, `logit_scale`, ...), so a checkpoint
//! loads and exports without renaming. No dropout (CLIP trains without it).

use candle_core::{Device, Result, Tensor};
use candle_nn::{Init, VarBuilder};

use super::config::{Activation, ClipConfig, ClipTextConfig, ClipVisionConfig};
use crate::bert::{Dense, Norm};

/// Added to the scores of keys a query may not see (later tokens in the text tower).
const MASKED: f64 = -1e30;

/// A linear layer without bias (the projections, the patch embedding).
fn weight(vb: &VarBuilder, out: usize, inp: usize) -> Result<Tensor> {
    vb.get_with_hints((out, inp), "weight", Init::Randn { mean: 0.0, stdev: 0.02 })
}

/// One pre-norm transformer block: `x + attn(ln1(x))`, then `h + mlp(ln2(h))`.
#[derive(Clone, Debug)]
struct Block {
    q: Dense,
    k: Dense,
    v: Dense,
    out: Dense,
    ln1: Norm,
    ln2: Norm,
    fc1: Dense,
    fc2: Dense,
    heads: usize,
    act: Activation,
}

impl Block {
    fn new(vb: VarBuilder, hidden: usize, inner: usize, heads: usize, eps: f64, act: Activation) -> Result<Self> {
        let a = vb.pp("self_attn");
        let m = vb.pp("mlp");
        Ok(Block {
            q: Dense::new(a.pp("q_proj"), hidden, hidden, 0.02)?,
            k: Dense::new(a.pp("k_proj"), hidden, hidden, 0.02)?,
            v: Dense::new(a.pp("v_proj"), hidden, hidden, 0.02)?,
            out: Dense::new(a.pp("out_proj"), hidden, hidden, 0.02)?,
            ln1: Norm::new(vb.pp("layer_norm1"), hidden, eps)?,
            ln2: Norm::new(vb.pp("layer_norm2"), hidden, eps)?,
            fc1: Dense::new(m.pp("fc1"), hidden, inner, 0.02)?,
            fc2: Dense::new(m.pp("fc2"), inner, hidden, 0.02)?,
            heads,
            act,
        })
    }

    /// `x` `[b, len, h]`; `causal`: each token attends to itself and earlier tokens only.
    fn forward(&self, x: &Tensor, causal: bool) -> Result<Tensor> {
        let (b, len, h) = x.dims3()?;
        let qkv = Dense::stacked(&[&self.q, &self.k, &self.v])?.forward(&self.ln1.forward(x)?)?;
        let ctx = if causal {
            causal_attention(&qkv, self.heads)?
        } else {
            // allgrad-nn's fused attention, every key visible.
            let bias = Tensor::zeros((b, len), qkv.dtype(), qkv.device())?;
            allgrad_nn::attention(&qkv, &bias, self.heads, None)?
        };
        let x = (x + self.out.forward(&ctx)?.reshape((b, len, h))?)?;
        let m = self.fc2.forward(&self.act.apply(&self.fc1.forward(&self.ln2.forward(&x)?)?)?)?;
        x + m
    }
}

/// Causal multi-head attention over packed `[b, len, 3h]` projections, from Candle's
/// differentiable ops and allgrad-nn's softmax (the fused kernel takes a per-key bias only).
fn causal_attention(qkv: &Tensor, heads: usize) -> Result<Tensor> {
    let (b, len, h3) = qkv.dims3()?;
    let h = h3 / 3;
    let d = h / heads;
    let split = |i: usize| qkv.narrow(2, i * h, h)?.reshape((b, len, heads, d))?.transpose(1, 2)?.contiguous();
    let (q, k, v) = (split(0)?, split(1)?, split(2)?);
    // MASKED above the diagonal (column j > row i), 0 elsewhere, made on the device from kept
    // position numbers (no upload).
    let pos = allgrad_nn::transfer::numbers(len, qkv.device())?;
    let mask = pos.reshape((1, len))?.broadcast_gt(&pos.reshape((len, 1))?)?.to_dtype(qkv.dtype())?.affine(MASKED, 0.0)?;
    let scores = (q.matmul(&k.t()?)? / (d as f64).sqrt())?.broadcast_add(&mask)?;
    let p = allgrad_nn::softmax_last_dim(&scores)?;
    p.matmul(&v)?.transpose(1, 2)?.reshape((b, len, h))
}

/// The Vision Transformer with its projection (`vision_model.*`, `visual_projection.weight`).
#[derive(Clone, Debug)]
pub struct VisionTower {
    cfg: ClipVisionConfig,
    patch: Tensor,
    class: Tensor,
    positions: Tensor,
    pre: Norm,
    blocks: Vec<Block>,
    post: Norm,
    projection: Tensor,
}

impl VisionTower {
    /// Creates (or loads) the tower's parameters under `vb` (the model's root).
    pub fn new(vb: &VarBuilder, cfg: &ClipVisionConfig, projection_dim: usize) -> Result<Self> {
        let m = vb.pp("vision_model");
        let e = m.pp("embeddings");
        let h = cfg.hidden_size;
        let p = cfg.patch_size;
        let patch = e.pp("patch_embedding").get_with_hints(
            (h, cfg.num_channels, p, p),
            "weight",
            Init::Randn { mean: 0.0, stdev: 0.02 },
        )?;
        let class = e.get_with_hints(h, "class_embedding", Init::Randn { mean: 0.0, stdev: 0.02 })?;
        let positions = e.pp("position_embedding").get_with_hints(
            (cfg.num_patches() + 1, h),
            "weight",
            Init::Randn { mean: 0.0, stdev: 0.02 },
        )?;
        let blocks = (0..cfg.num_hidden_layers)
            .map(|i| {
                let vb = m.pp("encoder.layers").pp(i.to_string());
                Block::new(vb, h, cfg.intermediate_size, cfg.num_attention_heads, cfg.layer_norm_eps, cfg.hidden_act)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(VisionTower {
            cfg: cfg.clone(),
            patch,
            class,
            positions,
            pre: Norm::new(m.pp("pre_layrnorm"), h, cfg.layer_norm_eps)?,
            blocks,
            post: Norm::new(m.pp("post_layernorm"), h, cfg.layer_norm_eps)?,
            projection: weight(&vb.pp("visual_projection"), projection_dim, h)?,
        })
    }

    /// Image embeddings `[b, projection_dim]` (not normalised) of `pixels` `[b, c, s, s]`.
    pub fn forward(&self, pixels: &Tensor) -> Result<Tensor> {
        let (b, c, hh, ww) = pixels.dims4()?;
        let (s, p) = (self.cfg.image_size, self.cfg.patch_size);
        if c != self.cfg.num_channels || hh != s || ww != s {
            candle_core::bail!(
                "clip vision tower: images {:?} do not match the config's {} channels of {s} x {s}",
                pixels.dims(),
                self.cfg.num_channels
            );
        }
        let g = s / p;
        let h = self.cfg.hidden_size;
        // Patches as rows (channel, row, column within the patch: the convolution's order),
        // then one linear layer: a convolution whose stride is its kernel.
        let patches = pixels
            .to_dtype(self.patch.dtype())?
            .reshape((b, c, g, p, g, p))?
            .permute((0, 2, 4, 1, 3, 5))?
            .reshape((b, g * g, c * p * p))?;
        let x = allgrad_nn::linear(&patches, &self.patch.reshape((h, c * p * p))?, None)?;
        let class = self.class.reshape((1, 1, h))?.broadcast_as((b, 1, h))?;
        let x = Tensor::cat(&[&class, &x], 1)?.broadcast_add(&self.positions.unsqueeze(0)?)?;
        let mut x = self.pre.forward(&x)?;
        for block in &self.blocks {
            x = block.forward(&x, false)?;
        }
        let pooled = self.post.forward(&x.narrow(1, 0, 1)?.squeeze(1)?)?;
        allgrad_nn::linear(&pooled, &self.projection, None)
    }
}

/// The causal text transformer with its projection (`text_model.*`, `text_projection.weight`).
#[derive(Clone, Debug)]
pub struct TextTower {
    cfg: ClipTextConfig,
    tokens: Tensor,
    positions: Tensor,
    blocks: Vec<Block>,
    last: Norm,
    projection: Tensor,
}

impl TextTower {
    /// Creates (or loads) the tower's parameters under `vb` (the model's root).
    pub fn new(vb: &VarBuilder, cfg: &ClipTextConfig, projection_dim: usize) -> Result<Self> {
        let m = vb.pp("text_model");
        let e = m.pp("embeddings");
        let h = cfg.hidden_size;
        let tokens =
            e.pp("token_embedding").get_with_hints((cfg.vocab_size, h), "weight", Init::Randn { mean: 0.0, stdev: 0.02 })?;
        let positions = e.pp("position_embedding").get_with_hints(
            (cfg.max_position_embeddings, h),
            "weight",
            Init::Randn { mean: 0.0, stdev: 0.01 },
        )?;
        let blocks = (0..cfg.num_hidden_layers)
            .map(|i| {
                let vb = m.pp("encoder.layers").pp(i.to_string());
                Block::new(vb, h, cfg.intermediate_size, cfg.num_attention_heads, cfg.layer_norm_eps, cfg.hidden_act)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(TextTower {
            cfg: cfg.clone(),
            tokens,
            positions,
            blocks,
            last: Norm::new(m.pp("final_layer_norm"), h, cfg.layer_norm_eps)?,
            projection: weight(&vb.pp("text_projection"), projection_dim, h)?,
        })
    }

    /// Where each sequence is pooled: as `transformers` does, the position of the largest id
    /// (its first occurrence) when `eos_token_id` is the legacy 2, else the first position of
    /// `eos_token_id` (position 0 when absent, as `argmax` of all zeros gives).
    pub fn pool_positions(&self, ids: &[Vec<u32>]) -> Vec<usize> {
        ids.iter()
            .map(|row| {
                if self.cfg.eos_token_id == 2 {
                    let max = row.iter().copied().max().unwrap_or(0);
                    row.iter().position(|t| *t == max).unwrap_or(0)
                } else {
                    row.iter().position(|t| *t == self.cfg.eos_token_id).unwrap_or(0)
                }
            })
            .collect()
    }

    /// Text embeddings `[b, projection_dim]` (not normalised) of token ids, each row padded
    /// with `pad_id` to the longest. Padding follows the end-of-text token, and attention is
    /// causal, so it changes no pooled number.
    pub fn forward(&self, ids: &[Vec<u32>], pad_id: u32, device: &Device) -> Result<Tensor> {
        let b = ids.len();
        let len = ids.iter().map(Vec::len).max().unwrap_or(0);
        if b == 0 || len == 0 {
            candle_core::bail!("clip text tower: no tokens ({b} sequences)");
        }
        if len > self.cfg.max_position_embeddings {
            candle_core::bail!(
                "clip text tower: a sequence of {len} tokens exceeds max_position_embeddings {}",
                self.cfg.max_position_embeddings
            );
        }
        if let Some(bad) = ids.iter().flatten().find(|t| **t as usize >= self.cfg.vocab_size) {
            candle_core::bail!("clip text tower: token id {bad} is outside the vocabulary of {}", self.cfg.vocab_size);
        }
        let flat: Vec<u32> =
            ids.iter().flat_map(|r| r.iter().copied().chain(std::iter::repeat_n(pad_id, len - r.len()))).collect();
        let h = self.cfg.hidden_size;
        let flat = Tensor::from_vec(flat, b * len, device)?;
        let x = self.tokens.index_select(&flat, 0)?.reshape((b, len, h))?;
        let mut x = x.broadcast_add(&self.positions.narrow(0, 0, len)?.unsqueeze(0)?)?;
        for block in &self.blocks {
            x = block.forward(&x, true)?;
        }
        let x = self.last.forward(&x)?;
        let at: Vec<u32> = self.pool_positions(ids).iter().enumerate().map(|(i, p)| (i * len + p) as u32).collect();
        let pooled = x.reshape((b * len, h))?.index_select(&Tensor::from_vec(at, b, device)?, 0)?;
        allgrad_nn::linear(&pooled, &self.projection, None)
    }
}

/// Both towers and the logit scale.
#[derive(Clone, Debug)]
pub struct ClipModel {
    /// The image tower.
    pub vision: VisionTower,
    /// The text tower.
    pub text: TextTower,
    /// `logit_scale` (`[]`, as in `transformers`): logits are `exp(s) · cos` (the trainer
    /// keeps `s` in `[0, ln 100]`, [`super::loss::MAX_LOGIT_SCALE`]).
    pub logit_scale: Tensor,
}

impl ClipModel {
    /// Creates (or loads) every parameter under `vb` (Hugging Face names).
    pub fn new(vb: &VarBuilder, cfg: &ClipConfig) -> Result<Self> {
        Ok(ClipModel {
            vision: VisionTower::new(vb, &cfg.vision_config, cfg.projection_dim)?,
            text: TextTower::new(vb, &cfg.text_config, cfg.projection_dim)?,
            logit_scale: vb.get_with_hints((), "logit_scale", Init::Const(cfg.logit_scale_init_value))?,
        })
    }

    /// `[n_images, n_texts]` logits of CLIP: `exp(s)` times the cosine of every
    /// image and text embedding (`logits_per_image` of `transformers`).
    pub fn logits(&self, image_embeds: &Tensor, text_embeds: &Tensor) -> Result<Tensor> {
        let i = crate::losses::l2_normalize(image_embeds)?;
        let t = crate::losses::l2_normalize(text_embeds)?;
        let scale = super::loss::clip_scale(&self.logit_scale)?.to_dtype(i.dtype())?;
        i.matmul(&t.t()?)?.broadcast_mul(&scale)
    }
}
