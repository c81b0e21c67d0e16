//! One BERT encoder layer: self-attention, then the GELU (exact, erf) feed-forward block with
//! dropout, residual and post-LayerNorm.

use candle_core::{Result, Tensor};
use candle_nn::VarBuilder;

use super::attention::SelfAttention;
use super::config::BertConfig;
use super::dropout::{DropoutKey, Site};
use super::layers::{Dense, Norm};

/// Hugging Face names under `encoder.layer.{i}`: `attention.*`, `intermediate.dense`,
/// `output.dense`, `output.LayerNorm`.
#[derive(Clone, Debug)]
pub struct EncoderLayer {
    attention: SelfAttention,
    intermediate: Dense,
    output: Dense,
    norm: Norm,
    dropout: f64,
}

impl EncoderLayer {
    /// Creates (or loads) the layer's parameters under `vb`.
    pub fn new(vb: VarBuilder, cfg: &BertConfig) -> Result<Self> {
        let (h, i, std) = (cfg.hidden_size, cfg.intermediate_size, cfg.initializer_range);
        Ok(EncoderLayer {
            attention: SelfAttention::new(vb.pp("attention"), cfg)?,
            intermediate: Dense::new(vb.pp("intermediate.dense"), h, i, std)?,
            output: Dense::new(vb.pp("output.dense"), i, h, std)?,
            norm: Norm::new(vb.pp("output.LayerNorm"), h, cfg.layer_norm_eps)?,
            dropout: cfg.hidden_dropout_prob,
        })
    }

    /// `x`: `[b, len, hidden]`; `bias`: the attention mask bias; `layer` (from 1) keys dropout.
    pub fn forward(&self, x: &Tensor, bias: &Tensor, layer: usize, dropout: Option<&DropoutKey>) -> Result<Tensor> {
        let a = self.attention.forward(x, bias, layer, dropout)?;
        let y = self.output.forward(&allgrad_nn::gelu_erf(&self.intermediate.forward(&a)?)?)?;
        let sum = match dropout {
            Some(key) => key.apply_residual(&y, &a, self.dropout, layer, Site::FeedForward)?,
            None => (super::dropout::promote_to(&y, &a)? + a)?,
        };
        self.norm.forward(&sum)
    }
}
