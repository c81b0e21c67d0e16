//! The architecture of a CLIP model, read from a Hugging Face `config.json` (`CLIPConfig`:
//! `text_config`, `vision_config`, `projection_dim`, `logit_scale_init_value`). Keys this
//! implementation does not use are ignored, as `transformers` ignores unknown keys.

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
}

impl Activation {
    /// Applies the activation (differentiable).
    pub fn apply(&self, x: &candle_core::Tensor) -> Result<candle_core::Tensor> {
        match self {
            // x / (1 + exp(-1.702 x)), from Candle's differentiable ops.
            Activation::QuickGelu => x.div(&((x * -1.702)?.exp()? + 1.0)?),
            Activation::Gelu => allgrad_nn::gelu_erf(x),
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
    /// The end-of-text id. As in `transformers`: with the legacy value 2 the text is pooled at
    /// the largest id of each sequence (the end-of-text token of OpenAI's vocabulary), else at
    /// the first occurrence of this id.
    #[serde(default = "two")]
    pub eos_token_id: u32,
}

fn two() -> u32 {
    2
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

/// `CLIPConfig`: both towers, the width of the shared embedding space and the initial logit
/// scale.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ClipConfig {
    /// The text tower.
    pub text_config: ClipTextConfig,
    /// The image tower.
    pub vision_config: ClipVisionConfig,
    /// Width of the joint embedding space (both projections' output).
    pub projection_dim: usize,
    /// Initial `logit_scale` (`ln(1 / 0.07)` = 2.6592 in CLIP).
    #[serde(default = "scale_init")]
    pub logit_scale_init_value: f64,
}

fn scale_init() -> f64 {
    2.6592
}

impl ClipConfig {
    /// Reads and checks a `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).map_err(|e| candle_core::Error::Msg(format!("reading {}: {e}", path.display())))?;
        let cfg: ClipConfig = serde_json::from_str(&text)
            .map_err(|e| candle_core::Error::Msg(format!("parsing CLIP config {}: {e}", path.display())))?;
        cfg.check().map_err(|e| candle_core::Error::Msg(format!("CLIP config {}: {e}", path.display())))?;
        Ok(cfg)
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
        Ok(())
    }
}
