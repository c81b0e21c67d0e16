//! The architecture of a CLIP or SigLIP model, read from a Hugging Face `config.json`
//! (`CLIPConfig`: `text_config`, `vision_config`, `projection_dim`, `logit_scale_init_value`;
//! or `SiglipConfig`, selected by `model_type: siglip`). A key left out takes `transformers`'
//! default for that architecture; keys this implementation does not use are ignored, as
//! `transformers` ignores unknown keys.

use std::path::Path;

use candle_core::Result;
use serde::{Deserialize, Serialize};

/// The activation of the transformer blocks' MLP (`hidden_act`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// `x · σ(1.702 x)`, the original CLIP's.
    #[default]
    QuickGelu,
    /// The exact GELU, `x · Φ(x)`.
    Gelu,
    /// GELU's tanh approximation, `x/2 · (1 + tanh(√(2/π) (x + 0.044715 x³)))` (SigLIP's;
    /// `gelu_new` in `transformers` is the same function).
    #[serde(alias = "gelu_new")]
    GeluPytorchTanh,
}

impl Activation {
    /// Applies the activation (differentiable).
    pub fn apply(&self, x: &candle_core::Tensor) -> Result<candle_core::Tensor> {
        match self {
            // x / (1 + exp(-1.702 x)), from Candle's differentiable ops.
            Activation::QuickGelu => x.div(&((x * -1.702)?.exp()? + 1.0)?),
            Activation::Gelu => allgrad_nn::gelu_erf(x),
            // Candle's differentiable `gelu` is this tanh form.
            Activation::GeluPytorchTanh => x.gelu(),
        }
    }
}

fn eps() -> f64 {
    1e-5
}
fn quick_gelu() -> Activation {
    Activation::QuickGelu
}

/// `text_config`: CLIP's causal text transformer.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ClipTextConfig {
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// Width of the transformer.
    pub hidden_size: usize,
    /// Width of the blocks' MLP.
    pub intermediate_size: usize,
    /// Number of blocks.
    pub num_hidden_layers: usize,
    /// Attention heads per block.
    pub num_attention_heads: usize,
    /// Longest sequence (the context length, 77 for OpenAI's models).
    pub max_position_embeddings: usize,
    /// The MLP's activation.
    #[serde(default = "quick_gelu")]
    pub hidden_act: Activation,
    /// LayerNorm epsilon.
    #[serde(default = "eps")]
    pub layer_norm_eps: f64,
    /// The end-of-text id (default 49407, OpenAI's, as in `transformers`). CLIP pools the text
    /// where it is: with the legacy value 2 at the largest id of each sequence (the end-of-text
    /// token of OpenAI's vocabulary), else at the first occurrence of this id; a sequence
    /// without it is an error. SigLIP pools at the last position and does not read it.
    #[serde(default = "eot", deserialize_with = "token_id")]
    pub eos_token_id: u32,
    /// SigLIP: the id every caption is padded with to the context length (default 1, as in
    /// `transformers`). CLIP pads with its end-of-text token (padding after it changes nothing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pad_token_id: Option<u32>,
    /// SigLIP: the width of the text head's output (default `hidden_size`); the image tower's
    /// `hidden_size`, the width of the shared space.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub projection_size: Option<usize>,
}

/// OpenAI's `<|endoftext|>`, `transformers`' default `eos_token_id` of CLIP's text tower.
pub const OPENAI_EOT: u32 = 49407;

/// The legacy `eos_token_id` of old CLIP configs: pool at the largest id of each sequence.
pub const LEGACY_EOS: u32 = 2;

fn eot() -> u32 {
    OPENAI_EOT
}

/// A token id, or a list holding one (`transformers` accepts both); anything else is an error
/// naming the key.
fn token_id<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<u32, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Id {
        One(u32),
        List(Vec<u32>),
        Other(serde_json::Value),
    }
    match Id::deserialize(d)? {
        Id::One(id) => Ok(id),
        Id::List(ids) if ids.len() == 1 => Ok(ids[0]),
        Id::List(ids) => Err(serde::de::Error::custom(format!(
            "eos_token_id {ids:?}: one end-of-text id is needed (the text is pooled where it is)"
        ))),
        Id::Other(v) => Err(serde::de::Error::custom(format!(
            "eos_token_id {v}: a token id is needed (the text is pooled at the end-of-text token)"
        ))),
    }
}

/// Where the text tower pools each sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TextPooling {
    /// CLIP with the legacy `eos_token_id` 2: the first position of the sequence's largest id.
    LargestId,
    /// CLIP: the first position of this end-of-text id (a sequence without it is an error).
    FirstOf(u32),
    /// SigLIP: the last position of the padded sequence.
    Last,
}

impl TextPooling {
    /// The pooled position of each sequence (unpadded token ids; [`TextPooling::Last`]: the
    /// last of `padded_len`). A sequence without the end-of-text token is an error naming it
    /// (`transformers` would pool it at position 0, silently).
    pub fn positions(&self, ids: &[Vec<u32>], padded_len: usize) -> Result<Vec<usize>> {
        ids.iter()
            .enumerate()
            .map(|(i, row)| match *self {
                TextPooling::LargestId => {
                    let max = row.iter().copied().max().unwrap_or(0);
                    Ok(row.iter().position(|t| *t == max).unwrap_or(0))
                }
                TextPooling::FirstOf(eos) => row.iter().position(|t| *t == eos).ok_or_else(|| {
                    candle_core::Error::Msg(format!(
                        "clip text tower: sequence {i} ({} tokens) has no end-of-text token (eos_token_id {eos}), \
                         where CLIP pools the text; tokenize with the model's tokenizer, which appends it",
                        row.len()
                    ))
                }),
                TextPooling::Last => Ok(padded_len.saturating_sub(1)),
            })
            .collect()
    }
}

/// `vision_config`: the Vision Transformer.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ClipVisionConfig {
    /// Width of the transformer.
    pub hidden_size: usize,
    /// Width of the blocks' MLP.
    pub intermediate_size: usize,
    /// Number of blocks.
    pub num_hidden_layers: usize,
    /// Attention heads per block.
    pub num_attention_heads: usize,
    /// Input channels (3 for RGB, 1 for grayscale).
    #[serde(default = "three")]
    pub num_channels: usize,
    /// Side of the (square) input image in pixels.
    pub image_size: usize,
    /// Side of a patch in pixels (divides `image_size`).
    pub patch_size: usize,
    /// The MLP's activation.
    #[serde(default = "quick_gelu")]
    pub hidden_act: Activation,
    /// LayerNorm epsilon.
    #[serde(default = "eps")]
    pub layer_norm_eps: f64,
    /// SigLIP: pool with the attention-pool head (`head.*`, default true; SigLIP's
    /// `SiglipModel` needs it).
    #[serde(default = "yes")]
    pub vision_use_head: bool,
}

fn yes() -> bool {
    true
}

fn three() -> usize {
    3
}

impl ClipVisionConfig {
    /// Patches per image.
    pub fn num_patches(&self) -> usize {
        (self.image_size / self.patch_size).pow(2)
    }
}

/// Which towers a folder holds (`model_type` of its `config.json`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Architecture {
    /// `CLIPModel`: a class token pooled and projected; a causal text transformer pooled at the
    /// end-of-text token and projected.
    #[default]
    Clip,
    /// `SiglipModel`: patches with a bias, no class token, an attention-pool head (a learned
    /// probe attending to every patch, then an MLP); a bidirectional text transformer pooled
    /// at the last position, then a linear head with a bias; a learned logit bias.
    Siglip,
}

/// `CLIPConfig` or `SiglipConfig`: both towers, the width of the shared embedding space and
/// the initial logit scale.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ClipConfig {
    /// `clip` (default) or `siglip`.
    #[serde(default)]
    pub model_type: Architecture,
    /// The text tower.
    pub text_config: ClipTextConfig,
    /// The image tower.
    pub vision_config: ClipVisionConfig,
    /// Width of the joint embedding space (both projections' output). SigLIP: the image
    /// tower's `hidden_size` (its config has no such key).
    #[serde(default)]
    pub projection_dim: usize,
    /// Initial `logit_scale` (`ln(1 / 0.07)` = 2.6592 in CLIP).
    #[serde(default = "scale_init")]
    pub logit_scale_init_value: f64,
}

fn scale_init() -> f64 {
    2.6592
}

/// `transformers`' defaults of the keys this implementation reads, per architecture: what a
/// `config.json` that leaves a key out means.
fn defaults(arch: Architecture) -> (serde_json::Value, serde_json::Value) {
    use serde_json::json;
    match arch {
        Architecture::Clip => (
            json!({"vocab_size": 49408, "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 12,
                   "num_attention_heads": 8, "max_position_embeddings": 77, "hidden_act": "quick_gelu",
                   "layer_norm_eps": 1e-5, "eos_token_id": OPENAI_EOT}),
            json!({"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                   "num_channels": 3, "image_size": 224, "patch_size": 32, "hidden_act": "quick_gelu",
                   "layer_norm_eps": 1e-5}),
        ),
        Architecture::Siglip => (
            json!({"vocab_size": 32000, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                   "num_attention_heads": 12, "max_position_embeddings": 64, "hidden_act": "gelu_pytorch_tanh",
                   "layer_norm_eps": 1e-6, "eos_token_id": OPENAI_EOT, "pad_token_id": 1}),
            json!({"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                   "num_channels": 3, "image_size": 224, "patch_size": 16, "hidden_act": "gelu_pytorch_tanh",
                   "layer_norm_eps": 1e-6, "vision_use_head": true}),
        ),
    }
}

impl ClipConfig {
    /// Reads and checks a `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).map_err(|e| candle_core::Error::Msg(format!("reading {}: {e}", path.display())))?;
        Self::from_json(&text).map_err(|e| candle_core::Error::Msg(format!("CLIP config {}: {e}", path.display())))
    }

    /// Parses and checks the text of a `config.json`: keys left out take `transformers`'
    /// defaults of the architecture `model_type` names.
    pub fn from_json(text: &str) -> std::result::Result<Self, String> {
        let mut v: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        let arch: Architecture = match v.get("model_type") {
            None => Architecture::Clip,
            Some(t) => serde_json::from_value(t.clone())
                .map_err(|_| format!("model_type {t}: allgrad reads `clip` and `siglip` models"))?,
        };
        let (text_defaults, vision_defaults) = defaults(arch);
        let top = v.as_object_mut().ok_or("not a JSON object")?;
        for (key, fill) in [("text_config", text_defaults), ("vision_config", vision_defaults)] {
            let section = top.entry(key).or_insert_with(|| serde_json::json!({}));
            let section = section.as_object_mut().ok_or_else(|| format!("{key} is not an object"))?;
            for (k, d) in fill.as_object().into_iter().flatten() {
                section.entry(k.clone()).or_insert_with(|| d.clone());
            }
        }
        if arch == Architecture::Clip {
            top.entry("projection_dim").or_insert_with(|| serde_json::json!(512));
        }
        let mut cfg: ClipConfig = serde_json::from_value(v).map_err(|e| e.to_string())?;
        if arch == Architecture::Siglip {
            cfg.projection_dim = cfg.vision_config.hidden_size;
        }
        cfg.check()?;
        Ok(cfg)
    }

    /// Where the text tower pools: SigLIP at the last position; CLIP at the end-of-text token
    /// ([`TextPooling::LargestId`] with the legacy `eos_token_id` 2).
    pub fn text_pooling(&self) -> TextPooling {
        Self::pooling_of(self.model_type, self.text_config.eos_token_id)
    }

    /// [`ClipConfig::text_pooling`] of an architecture and `eos_token_id`.
    pub fn pooling_of(arch: Architecture, eos_token_id: u32) -> TextPooling {
        match (arch, eos_token_id) {
            (Architecture::Siglip, _) => TextPooling::Last,
            (Architecture::Clip, LEGACY_EOS) => TextPooling::LargestId,
            (Architecture::Clip, eos) => TextPooling::FirstOf(eos),
        }
    }

    /// The sizes fit together: heads divide widths, patches divide the image, nothing is zero.
    pub fn check(&self) -> std::result::Result<(), String> {
        let (t, v) = (&self.text_config, &self.vision_config);
        let positive = [
            ("text_config.vocab_size", t.vocab_size),
            ("text_config.hidden_size", t.hidden_size),
            ("text_config.num_attention_heads", t.num_attention_heads),
            ("text_config.max_position_embeddings", t.max_position_embeddings),
            ("vision_config.hidden_size", v.hidden_size),
            ("vision_config.num_attention_heads", v.num_attention_heads),
            ("vision_config.patch_size", v.patch_size),
            ("vision_config.num_channels", v.num_channels),
            ("projection_dim", self.projection_dim),
        ];
        if let Some((k, _)) = positive.iter().find(|(_, n)| *n == 0) {
            return Err(format!("{k} must be at least 1"));
        }
        if t.hidden_size % t.num_attention_heads != 0 {
            return Err(format!(
                "text_config.hidden_size {} is not divisible by num_attention_heads {}",
                t.hidden_size, t.num_attention_heads
            ));
        }
        if v.hidden_size % v.num_attention_heads != 0 {
            return Err(format!(
                "vision_config.hidden_size {} is not divisible by num_attention_heads {}",
                v.hidden_size, v.num_attention_heads
            ));
        }
        if v.image_size % v.patch_size != 0 || v.image_size == 0 {
            return Err(format!(
                "vision_config.image_size {} is not a positive multiple of patch_size {}",
                v.image_size, v.patch_size
            ));
        }
        if self.model_type == Architecture::Siglip {
            if !v.vision_use_head {
                return Err("vision_config.vision_use_head is false: SiglipModel pools images with its head".into());
            }
            let p = t.projection_size.unwrap_or(t.hidden_size);
            if p != v.hidden_size {
                return Err(format!(
                    "text_config.projection_size {p} differs from vision_config.hidden_size {}: the two towers' \
                     embeddings are compared in one space",
                    v.hidden_size
                ));
            }
            if let Some(pad) = t.pad_token_id.filter(|p| *p as usize >= t.vocab_size) {
                return Err(format!("text_config.pad_token_id {pad} is outside the vocabulary of {}", t.vocab_size));
            }
        }
        Ok(())
    }
}
