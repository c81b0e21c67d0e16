//! CLIP's and SigLIP's two towers with Hugging Face's parameter names.
//!
//! - CLIP (`CLIPModel`): a Vision Transformer (patch embedding, class token, positional
//!   embeddings, a pre-norm, pre-norm blocks, the class token's output normalised and
//!   projected) and the causal text transformer (pooled at the end-of-text token, normalised
//!   and projected), and the learned logit scale.
//! - SigLIP (`SiglipModel`): the Vision Transformer without class token or pre-norm (a bias
//!   on the patch embedding), every token normalised, then the attention-pool head (a learned
//!   probe attends to every token, then a residual MLP); the text transformer without causal
//!   mask, padded to its context length and pooled at the last position, then a linear head;
//!   the learned logit scale and bias.
//!
//! Parameter names are those of `transformers` (`vision_model.encoder.layers.0.self_attn.
//! q_proj.weight`, `text_projection.weight`, `vision_model.head.probe`, `logit_scale`, ...),
//! so a checkpoint loads and exports without renaming. No dropout (neither trains with it).

use candle_core::{Device, Result, Tensor};
use candle_nn::{Init, VarBuilder};

use super::config::{Activation, Architecture, ClipConfig, ClipTextConfig, ClipVisionConfig, TextPooling};
use crate::bert::{Dense, Norm};

/// A linear layer's weight without bias (the projections), fresh from N(0, `std`).
fn weight(vb: &VarBuilder, out: usize, inp: usize, std: f64) -> Result<Tensor> {
    vb.get_with_hints((out, inp), "weight", normal(std))
}

fn normal(stdev: f64) -> Init {
    Init::Randn { mean: 0.0, stdev }
}

fn uniform(bound: f64) -> Init {
    Init::Uniform { lo: -bound, up: bound }
}

/// PyTorch's default of `nn.Linear` and `nn.Conv2d` (weights, and biases alike):
/// U(±fan_in^-1/2).
fn torch_default(fan_in: usize) -> Init {
    uniform((fan_in as f64).powf(-0.5))
}

/// The fresh values of a block's parameters, OpenCLIP's (a checkpoint's values replace them).
#[derive(Clone, Copy, Debug)]
struct BlockInit {
    qkv: Init,
    out: Init,
    fc1: Init,
    fc1_bias: Init,
    fc2: Init,
    fc2_bias: Init,
}

impl BlockInit {
    /// OpenCLIP's text transformer (`TextTransformer.init_parameters`), scaled by the width w
    /// and the depth L: the packed in-projection N(0, w^-1/2), the attention's and the MLP's
    /// output projections N(0, w^-1/2 (2L)^-1/2), the MLP's first layer N(0, (2w)^-1/2); the
    /// attention's biases zero (`nn.MultiheadAttention`'s), the MLP's PyTorch's default.
    fn text(width: usize, inner: usize, layers: usize) -> Self {
        let w = width as f64;
        let proj = w.powf(-0.5) * (2.0 * layers.max(1) as f64).powf(-0.5);
        BlockInit {
            qkv: normal(w.powf(-0.5)),
            out: normal(proj),
            fc1: normal((2.0 * w).powf(-0.5)),
            fc1_bias: torch_default(width),
            fc2: normal(proj),
            fc2_bias: torch_default(inner),
        }
    }

    /// OpenCLIP's image transformer, which keeps PyTorch's defaults: the packed `[3w, w]`
    /// in-projection Xavier-uniform, U(±(6 / 4w)^1/2), and zero attention biases
    /// (`nn.MultiheadAttention`'s), `nn.Linear`'s U(±fan_in^-1/2) for the output projection
    /// and the MLP (weights and biases).
    fn vision(width: usize, inner: usize) -> Self {
        BlockInit {
            qkv: uniform((6.0 / (4.0 * width as f64)).sqrt()),
            out: torch_default(width),
            fc1: torch_default(width),
            fc1_bias: torch_default(width),
            fc2: torch_default(inner),
            fc2_bias: torch_default(inner),
        }
    }
}

/// The sizes of a block.
#[derive(Clone, Copy, Debug)]
struct BlockCfg {
    hidden: usize,
    inner: usize,
    heads: usize,
    eps: f64,
    act: Activation,
}

/// The blocks of a tower (`<vb>.encoder.layers.<i>`).
fn blocks(vb: &VarBuilder, n: usize, cfg: BlockCfg, init: BlockInit) -> Result<Vec<Block>> {
    (0..n).map(|i| Block::new(vb.pp("encoder.layers").pp(i.to_string()), cfg, init)).collect()
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
    fn new(vb: VarBuilder, cfg: BlockCfg, init: BlockInit) -> Result<Self> {
        let a = vb.pp("self_attn");
        let m = vb.pp("mlp");
        let (hidden, inner) = (cfg.hidden, cfg.inner);
        let zero = Init::Const(0.0);
        Ok(Block {
            q: Dense::with_init(a.pp("q_proj"), hidden, hidden, init.qkv, zero)?,
            k: Dense::with_init(a.pp("k_proj"), hidden, hidden, init.qkv, zero)?,
            v: Dense::with_init(a.pp("v_proj"), hidden, hidden, init.qkv, zero)?,
            out: Dense::with_init(a.pp("out_proj"), hidden, hidden, init.out, zero)?,
            ln1: Norm::new(vb.pp("layer_norm1"), hidden, cfg.eps)?,
            ln2: Norm::new(vb.pp("layer_norm2"), hidden, cfg.eps)?,
            fc1: Dense::with_init(m.pp("fc1"), hidden, inner, init.fc1, init.fc1_bias)?,
            fc2: Dense::with_init(m.pp("fc2"), inner, hidden, init.fc2, init.fc2_bias)?,
            heads: cfg.heads,
            act: cfg.act,
        })
    }

    /// `x` `[b, len, h]`; `causal`: each token attends to itself and earlier tokens only.
    fn forward(&self, x: &Tensor, causal: bool) -> Result<Tensor> {
        let (b, len, h) = x.dims3()?;
        let qkv = Dense::stacked(&[&self.q, &self.k, &self.v])?.forward(&self.ln1.forward(x)?)?;
        // allgrad-nn's fused attention, causal in CLIP's text tower. No key is masked out:
        // CLIP's padding follows the end-of-text token, which no causal query looks past; the
        // image tower and SigLIP's text tower attend to every token (SigLIP to its padding too,
        // as it was trained).
        let bias = Tensor::zeros((b, len), qkv.dtype(), qkv.device())?;
        let ctx = if causal {
            allgrad_nn::causal_attention(&qkv, &bias, self.heads, None)?
        } else {
            allgrad_nn::attention(&qkv, &bias, self.heads, None)?
        };
        let x = (x + self.out.forward(&ctx)?.reshape((b, len, h))?)?;
        let m = self.fc2.forward(&self.act.apply(&self.fc1.forward(&self.ln2.forward(&x)?)?)?)?;
        x + m
    }
}

/// How the image tower turns its tokens into one embedding.
#[derive(Clone, Debug)]
enum VisionPool {
    /// CLIP: the class token's output, normalised (`post_layernorm`), then projected
    /// (`visual_projection.weight`, no bias).
    Class { post: Norm, projection: Tensor },
    /// SigLIP: every token normalised (`post_layernorm`), then the attention-pool head.
    Head { post: Norm, head: AttentionPool },
}

/// SigLIP's multi-head attention pooling (`vision_model.head.*`): a learned probe attends to
/// every token (`torch.nn.MultiheadAttention`'s packed `in_proj_weight` / `in_proj_bias` and
/// `out_proj`), then `y + mlp(layernorm(y))`.
#[derive(Clone, Debug)]
struct AttentionPool {
    probe: Tensor,
    in_weight: Tensor,
    in_bias: Tensor,
    out: Dense,
    norm: Norm,
    fc1: Dense,
    fc2: Dense,
    heads: usize,
    act: Activation,
}

impl AttentionPool {
    /// Fresh: the probe N(0, w^-1/2) (timm's latent query), the rest as an image block's
    /// attention and MLP ([`BlockInit::vision`]).
    fn new(vb: VarBuilder, cfg: &ClipVisionConfig) -> Result<Self> {
        let h = cfg.hidden_size;
        let a = vb.pp("attention");
        let m = vb.pp("mlp");
        let init = BlockInit::vision(h, cfg.intermediate_size);
        let zero = Init::Const(0.0);
        Ok(AttentionPool {
            probe: vb.get_with_hints((1, 1, h), "probe", normal((h as f64).powf(-0.5)))?,
            in_weight: a.get_with_hints((3 * h, h), "in_proj_weight", init.qkv)?,
            in_bias: a.get_with_hints(3 * h, "in_proj_bias", zero)?,
            out: Dense::with_init(a.pp("out_proj"), h, h, init.out, zero)?,
            norm: Norm::new(vb.pp("layernorm"), h, cfg.layer_norm_eps)?,
            fc1: Dense::with_init(m.pp("fc1"), h, cfg.intermediate_size, init.fc1, init.fc1_bias)?,
            fc2: Dense::with_init(m.pp("fc2"), cfg.intermediate_size, h, init.fc2, init.fc2_bias)?,
            heads: cfg.num_attention_heads,
            act: cfg.hidden_act,
        })
    }

    /// `x` `[b, n, h]` to `[b, h]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, n, h) = x.dims3()?;
        let (heads, d) = (self.heads, h / self.heads);
        // The probe's query (one for all images), the tokens' keys and values.
        let q = allgrad_nn::linear(
            &self.probe.reshape((1, h))?,
            &self.in_weight.narrow(0, 0, h)?,
            Some(&self.in_bias.narrow(0, 0, h)?),
        )?;
        let q = q.reshape((1, heads, 1, d))?.broadcast_as((b, heads, 1, d))?.contiguous()?;
        let kv = allgrad_nn::linear(x, &self.in_weight.narrow(0, h, 2 * h)?, Some(&self.in_bias.narrow(0, h, 2 * h)?))?;
        let split = |i: usize| kv.narrow(2, i * h, h)?.reshape((b, n, heads, d))?.transpose(1, 2)?.contiguous();
        let (k, v) = (split(0)?, split(1)?);
        let scores = (q.matmul(&k.t()?)? / (d as f64).sqrt())?; // [b, heads, 1, n]
        let p = allgrad_nn::softmax_last_dim(&scores)?;
        let ctx = p.matmul(&v)?.reshape((b, h))?; // heads merged: [b, heads, 1, d] -> [b, h]
        let y = self.out.forward(&ctx)?;
        let m = self.fc2.forward(&self.act.apply(&self.fc1.forward(&self.norm.forward(&y)?)?)?)?;
        y + m
    }
}

/// The image tower with its pooling: CLIP's (`vision_model.*`, `visual_projection.weight`) or
/// SigLIP's (`vision_model.*` with `vision_model.head.*`).
#[derive(Clone, Debug)]
pub struct VisionTower {
    cfg: ClipVisionConfig,
    patch: Tensor,
    /// SigLIP's patch embedding has a bias.
    patch_bias: Option<Tensor>,
    /// CLIP's class token.
    class: Option<Tensor>,
    positions: Tensor,
    /// CLIP's norm before the blocks (`pre_layrnorm`).
    pre: Option<Norm>,
    blocks: Vec<Block>,
    pool: VisionPool,
}

impl VisionTower {
    /// Creates (or loads) the tower's parameters under `vb` (the model's root): CLIP's tower,
    /// projected to `projection_dim`.
    pub fn new(vb: &VarBuilder, cfg: &ClipVisionConfig, projection_dim: usize) -> Result<Self> {
        Self::of(vb, cfg, projection_dim, Architecture::Clip)
    }

    /// Creates (or loads) the tower of `arch` (SigLIP's embeds to `hidden_size`; it ignores
    /// `projection_dim`).
    pub fn of(vb: &VarBuilder, cfg: &ClipVisionConfig, projection_dim: usize, arch: Architecture) -> Result<Self> {
        let m = vb.pp("vision_model");
        let e = m.pp("embeddings");
        let h = cfg.hidden_size;
        let p = cfg.patch_size;
        let siglip = arch == Architecture::Siglip;
        // Fresh values as OpenCLIP's `VisionTransformer`: the patch convolution PyTorch's
        // default, the class token, positions and projection N(0, w^-1/2), the blocks
        // [`BlockInit::vision`].
        let scale = normal((h as f64).powf(-0.5));
        let patch_init = torch_default(cfg.num_channels * p * p);
        let patch = e.pp("patch_embedding").get_with_hints((h, cfg.num_channels, p, p), "weight", patch_init)?;
        let patch_bias = if siglip { Some(e.pp("patch_embedding").get_with_hints(h, "bias", patch_init)?) } else { None };
        let class = if siglip { None } else { Some(e.get_with_hints(h, "class_embedding", scale)?) };
        let positions =
            e.pp("position_embedding").get_with_hints((cfg.num_patches() + usize::from(!siglip), h), "weight", scale)?;
        let pre = if siglip { None } else { Some(Norm::new(m.pp("pre_layrnorm"), h, cfg.layer_norm_eps)?) };
        let block = BlockCfg {
            hidden: h,
            inner: cfg.intermediate_size,
            heads: cfg.num_attention_heads,
            eps: cfg.layer_norm_eps,
            act: cfg.hidden_act,
        };
        let blocks = blocks(&m, cfg.num_hidden_layers, block, BlockInit::vision(h, cfg.intermediate_size))?;
        let post = Norm::new(m.pp("post_layernorm"), h, cfg.layer_norm_eps)?;
        let pool = if siglip {
            VisionPool::Head { post, head: AttentionPool::new(m.pp("head"), cfg)? }
        } else {
            VisionPool::Class { post, projection: weight(&vb.pp("visual_projection"), projection_dim, h, (h as f64).powf(-0.5))? }
        };
        Ok(VisionTower { cfg: cfg.clone(), patch, patch_bias, class, positions, pre, blocks, pool })
    }

    /// Image embeddings `[b, d]` (not normalised) of `pixels` `[b, c, s, s]`.
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
        let mut x = allgrad_nn::linear(&patches, &self.patch.reshape((h, c * p * p))?, self.patch_bias.as_ref())?;
        if let Some(class) = &self.class {
            let class = class.reshape((1, 1, h))?.broadcast_as((b, 1, h))?;
            x = Tensor::cat(&[&class, &x], 1)?;
        }
        let mut x = x.broadcast_add(&self.positions.unsqueeze(0)?)?;
        if let Some(pre) = &self.pre {
            x = pre.forward(&x)?;
        }
        for block in &self.blocks {
            x = block.forward(&x, false)?;
        }
        match &self.pool {
            VisionPool::Class { post, projection } => {
                let pooled = post.forward(&x.narrow(1, 0, 1)?.squeeze(1)?)?;
                allgrad_nn::linear(&pooled, projection, None)
            }
            VisionPool::Head { post, head } => head.forward(&post.forward(&x)?),
        }
    }
}

/// The text transformer with its projection: CLIP's (`text_model.*`, `text_projection.weight`)
/// or SigLIP's (`text_model.*` with `text_model.head.*`).
#[derive(Clone, Debug)]
pub struct TextTower {
    cfg: ClipTextConfig,
    pooling: TextPooling,
    tokens: Tensor,
    positions: Tensor,
    blocks: Vec<Block>,
    last: Norm,
    projection: Tensor,
    /// SigLIP's head has a bias.
    projection_bias: Option<Tensor>,
}

impl TextTower {
    /// Creates (or loads) CLIP's text tower under `vb` (the model's root), pooled at the
    /// end-of-text token as `cfg.eos_token_id` says.
    pub fn new(vb: &VarBuilder, cfg: &ClipTextConfig, projection_dim: usize) -> Result<Self> {
        let pooling = ClipConfig::pooling_of(Architecture::Clip, cfg.eos_token_id);
        Self::of(vb, cfg, projection_dim, Architecture::Clip, pooling)
    }

    fn of(
        vb: &VarBuilder,
        cfg: &ClipTextConfig,
        projection_dim: usize,
        arch: Architecture,
        pooling: TextPooling,
    ) -> Result<Self> {
        let m = vb.pp("text_model");
        let e = m.pp("embeddings");
        let h = cfg.hidden_size;
        // Fresh values as OpenCLIP's `TextTransformer`: tokens N(0, 0.02), positions
        // N(0, 0.01), the blocks [`BlockInit::text`], the projection N(0, w^-1/2) (a head's
        // bias zero).
        let tokens = e.pp("token_embedding").get_with_hints((cfg.vocab_size, h), "weight", normal(0.02))?;
        let positions = e.pp("position_embedding").get_with_hints((cfg.max_position_embeddings, h), "weight", normal(0.01))?;
        let block = BlockCfg {
            hidden: h,
            inner: cfg.intermediate_size,
            heads: cfg.num_attention_heads,
            eps: cfg.layer_norm_eps,
            act: cfg.hidden_act,
        };
        let init = BlockInit::text(h, cfg.intermediate_size, cfg.num_hidden_layers);
        let blocks = blocks(&m, cfg.num_hidden_layers, block, init)?;
        let std = (h as f64).powf(-0.5);
        let (projection, projection_bias) = match arch {
            Architecture::Clip => (weight(&vb.pp("text_projection"), projection_dim, h, std)?, None),
            Architecture::Siglip => {
                let out = cfg.projection_size.unwrap_or(h);
                let head = m.pp("head");
                (weight(&head, out, h, std)?, Some(head.get_with_hints(out, "bias", Init::Const(0.0))?))
            }
        };
        Ok(TextTower {
            cfg: cfg.clone(),
            pooling,
            tokens,
            positions,
            blocks,
            last: Norm::new(m.pp("final_layer_norm"), h, cfg.layer_norm_eps)?,
            projection,
            projection_bias,
        })
    }

    /// Where each sequence is pooled ([`TextPooling::positions`]): CLIP's end-of-text token
    /// (an error for a sequence without it), SigLIP's last position of the padded sequence.
    pub fn pool_positions(&self, ids: &[Vec<u32>]) -> Result<Vec<usize>> {
        self.pooling.positions(ids, self.padded_len(ids))
    }

    /// The length the batch is padded to: the longest sequence (CLIP: padding follows the
    /// end-of-text token and attention is causal, so it changes no pooled number), or the
    /// context length (SigLIP: it attends to its padding and pools at the last position, as
    /// it was trained).
    fn padded_len(&self, ids: &[Vec<u32>]) -> usize {
        match self.pooling {
            TextPooling::Last => self.cfg.max_position_embeddings,
            _ => ids.iter().map(Vec::len).max().unwrap_or(0),
        }
    }

    /// Text embeddings `[b, d]` (not normalised) of token ids, each row padded with `pad_id`
    /// (to the longest for CLIP, to the context length for SigLIP).
    pub fn forward(&self, ids: &[Vec<u32>], pad_id: u32, device: &Device) -> Result<Tensor> {
        let b = ids.len();
        let longest = ids.iter().map(Vec::len).max().unwrap_or(0);
        if b == 0 || longest == 0 {
            candle_core::bail!("clip text tower: no tokens ({b} sequences)");
        }
        if longest > self.cfg.max_position_embeddings {
            candle_core::bail!(
                "clip text tower: a sequence of {longest} tokens exceeds max_position_embeddings {}",
                self.cfg.max_position_embeddings
            );
        }
        if let Some(bad) = ids.iter().flatten().chain([&pad_id]).find(|t| **t as usize >= self.cfg.vocab_size) {
            candle_core::bail!("clip text tower: token id {bad} is outside the vocabulary of {}", self.cfg.vocab_size);
        }
        let len = self.padded_len(ids);
        let pooled_at = self.pool_positions(ids)?;
        let flat: Vec<u32> =
            ids.iter().flat_map(|r| r.iter().copied().chain(std::iter::repeat_n(pad_id, len - r.len()))).collect();
        let h = self.cfg.hidden_size;
        let flat = Tensor::from_vec(flat, b * len, device)?;
        let x = self.tokens.index_select(&flat, 0)?.reshape((b, len, h))?;
        let mut x = x.broadcast_add(&self.positions.narrow(0, 0, len)?.unsqueeze(0)?)?;
        let causal = self.pooling != TextPooling::Last;
        for block in &self.blocks {
            x = block.forward(&x, causal)?;
        }
        let x = self.last.forward(&x)?;
        let at: Vec<u32> = pooled_at.iter().enumerate().map(|(i, p)| (i * len + p) as u32).collect();
        let pooled = x.reshape((b * len, h))?.index_select(&Tensor::from_vec(at, b, device)?, 0)?;
        allgrad_nn::linear(&pooled, &self.projection, self.projection_bias.as_ref())
    }
}

/// Both towers, the logit scale and, for SigLIP, the logit bias.
#[derive(Clone, Debug)]
pub struct ClipModel {
    /// The architecture.
    pub arch: Architecture,
    /// The image tower.
    pub vision: VisionTower,
    /// The text tower.
    pub text: TextTower,
    /// `logit_scale` (`[]` in CLIP, `[1]` in SigLIP, as in `transformers`): logits are
    /// `exp(s) · cos` (the trainer keeps `s` in `[0, ln 100]`, [`super::loss::MAX_LOGIT_SCALE`]).
    pub logit_scale: Tensor,
    /// `logit_bias` (`[1]` in SigLIP; `[]` for a CLIP model trained with a sigmoid loss; absent
    /// otherwise).
    pub logit_bias: Option<Tensor>,
}

/// SigLIP's initial logit bias (Zhai et al., 2023) when nothing else gives one.
pub const SIGLIP_BIAS_INIT: f64 = -10.0;

impl ClipModel {
    /// Creates (or loads) every parameter under `vb` (Hugging Face names). A CLIP model has a
    /// logit bias when `vb` holds one (a checkpoint trained with a sigmoid loss).
    pub fn new(vb: &VarBuilder, cfg: &ClipConfig) -> Result<Self> {
        let bias = (cfg.model_type == Architecture::Siglip || vb.contains_tensor("logit_bias")).then_some(SIGLIP_BIAS_INIT);
        Self::with_bias(vb, cfg, bias)
    }

    /// [`ClipModel::new`] with a logit bias starting at `bias_init` when given (a sigmoid loss;
    /// a checkpoint's value wins). SigLIP always has one (starting at [`SIGLIP_BIAS_INIT`]
    /// without `bias_init`).
    pub fn with_bias(vb: &VarBuilder, cfg: &ClipConfig, bias_init: Option<f64>) -> Result<Self> {
        let arch = cfg.model_type;
        let scalar: &[usize] = if arch == Architecture::Siglip { &[1] } else { &[] };
        let bias_init = match arch {
            Architecture::Siglip => Some(bias_init.unwrap_or(SIGLIP_BIAS_INIT)),
            Architecture::Clip => bias_init,
        };
        Ok(ClipModel {
            arch,
            vision: VisionTower::of(vb, &cfg.vision_config, cfg.projection_dim, arch)?,
            text: TextTower::of(vb, &cfg.text_config, cfg.projection_dim, arch, cfg.text_pooling())?,
            logit_scale: vb.get_with_hints(scalar, "logit_scale", Init::Const(cfg.logit_scale_init_value))?,
            logit_bias: bias_init.map(|b| vb.get_with_hints(scalar, "logit_bias", Init::Const(b))).transpose()?,
        })
    }

    /// `[n_images, n_texts]` logits as `transformers` computes them: CLIP's `exp(s) · cos`
    /// (`CLIPModel`'s `logits_per_image`), SigLIP's `exp(s) · cos + b` (`SiglipModel`'s).
    pub fn logits(&self, image_embeds: &Tensor, text_embeds: &Tensor) -> Result<Tensor> {
        let i = crate::losses::l2_normalize(image_embeds)?;
        let t = crate::losses::l2_normalize(text_embeds)?;
        let cos = i.matmul(&t.t()?)?;
        match (self.arch, &self.logit_bias) {
            (Architecture::Siglip, Some(bias)) => {
                let scale = self.logit_scale.flatten_all()?.exp()?.to_dtype(i.dtype())?;
                cos.broadcast_mul(&scale)?.broadcast_add(&bias.flatten_all()?.to_dtype(i.dtype())?)
            }
            _ => cos.broadcast_mul(&super::loss::clip_scale(&self.logit_scale)?.to_dtype(i.dtype())?),
        }
    }
}
