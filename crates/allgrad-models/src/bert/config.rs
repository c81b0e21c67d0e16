//! The architecture of a BERT encoder, read from a Hugging Face `config.json`.

use std::path::Path;

use candle_core::Result;
use serde::{Deserialize, Serialize};

/// The fields of a Hugging Face `BertConfig` that the encoder uses (other keys of a
/// `config.json` are ignored). Names follow Hugging Face so that the file reads unchanged.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct BertConfig {
    /// Size of the token vocabulary.
    pub vocab_size: usize,
    /// Width of the hidden states.
    pub hidden_size: usize,
    /// Number of encoder layers.
    pub num_hidden_layers: usize,
    /// Attention heads per layer (must divide `hidden_size`).
    pub num_attention_heads: usize,
    /// Width of the feed-forward layer.
    pub intermediate_size: usize,
    /// Activation of the feed-forward layer: only `gelu` (the exact, erf form) is supported.
    #[serde(default = "default_act")]
    pub hidden_act: String,
    /// Dropout probability on embeddings, attention output and feed-forward output.
    #[serde(default = "default_dropout")]
    pub hidden_dropout_prob: f64,
    /// Dropout probability on the attention probabilities.
    #[serde(default = "default_dropout")]
    pub attention_probs_dropout_prob: f64,
    /// Number of position embeddings (the longest sequence the model accepts).
    pub max_position_embeddings: usize,
    /// Number of token types (segments).
    #[serde(default = "default_type_vocab")]
    pub type_vocab_size: usize,
    /// Epsilon of every LayerNorm.
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    /// Standard deviation of the weights of a freshly initialised model.
    #[serde(default = "default_init")]
    pub initializer_range: f64,
    /// Token id of padding.
    #[serde(default)]
    pub pad_token_id: u32,
    /// Position embeddings: only `absolute` (learned, one per position) is supported.
    #[serde(default = "default_position_type")]
    pub position_embedding_type: String,
    /// Model type written to an exported `config.json`.
    #[serde(default = "default_model_type")]
    pub model_type: String,
}

fn default_act() -> String {
    "gelu".into()
}
fn default_dropout() -> f64 {
    0.1
}
fn default_type_vocab() -> usize {
    2
}
fn default_eps() -> f64 {
    1e-12
}
fn default_init() -> f64 {
    0.02
}
fn default_position_type() -> String {
    "absolute".into()
}
fn default_model_type() -> String {
    "bert".into()
}

impl BertConfig {
    /// A small configuration for tests: hidden 32, 2 layers, 4 heads, feed-forward 37.
    pub fn tiny(vocab_size: usize) -> Self {
        BertConfig {
            vocab_size,
            hidden_size: 32,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            intermediate_size: 37,
            hidden_act: default_act(),
            hidden_dropout_prob: 0.1,
            attention_probs_dropout_prob: 0.1,
            max_position_embeddings: 40,
            type_vocab_size: 2,
            layer_norm_eps: 1e-12,
            initializer_range: 0.02,
            pad_token_id: 0,
            position_embedding_type: default_position_type(),
            model_type: default_model_type(),
        }
    }

    /// Reads and checks `config.json`; errors name the file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| candle_core::Error::Msg(format!("reading BERT config {}: {e}", path.display())))?;
        let cfg: BertConfig = serde_json::from_str(&text)
            .map_err(|e| candle_core::Error::Msg(format!("parsing BERT config {}: {e}", path.display())))?;
        cfg.validate().map_err(|e| candle_core::Error::Msg(format!("BERT config {}: {e}", path.display())))?;
        Ok(cfg)
    }

    /// Checks the numbers; the message names the field.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_attention_heads", self.num_attention_heads),
            ("intermediate_size", self.intermediate_size),
            ("max_position_embeddings", self.max_position_embeddings),
            ("type_vocab_size", self.type_vocab_size),
        ];
        if let Some((k, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(format!("{k} must be positive"));
        }
        if !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(format!(
                "hidden_size {} is not divisible by num_attention_heads {}",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if self.hidden_act != "gelu" {
            return Err(format!("hidden_act {:?} is not supported (only \"gelu\", the erf form)", self.hidden_act));
        }
        if self.position_embedding_type != "absolute" {
            return Err(format!(
                "position_embedding_type {:?} is not supported (only \"absolute\")",
                self.position_embedding_type
            ));
        }
        for (k, p) in [
            ("hidden_dropout_prob", self.hidden_dropout_prob),
            ("attention_probs_dropout_prob", self.attention_probs_dropout_prob),
        ] {
            if !(0.0..1.0).contains(&p) {
                return Err(format!("{k} must be in [0, 1), got {p}"));
            }
        }
        if self.layer_norm_eps.is_nan() || self.layer_norm_eps < 0.0 {
            return Err(format!("layer_norm_eps must be non-negative, got {}", self.layer_norm_eps));
        }
        Ok(())
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }
}
