//! Multi-head self-attention with a padding mask (BERT's `attention.self` and
//! `attention.output`).

use candle_core::{Result, Tensor};
use candle_nn::VarBuilder;

use super::config::BertConfig;
use super::dropout::{DropoutKey, Site};
use super::layers::{Dense, Norm};

/// Added to the scores of padded keys: their probability is exactly 0 in f32 and f64.
const MASKED: f64 = -1e30;

/// Self-attention followed by the output projection, dropout, residual and LayerNorm.
#[derive(Clone, Debug)]
pub struct SelfAttention {
    query: Dense,
    key: Dense,
    value: Dense,
    output: Dense,
    norm: Norm,
    heads: usize,
    hidden_dropout: f64,
    attention_dropout: f64,
}

/// The additive key bias `[b, len]` of a `[b, len]` mask (1 = token, 0 = padding): 0 for a
/// token, `-1e30` for padding.
pub fn mask_bias(mask: &Tensor) -> Result<Tensor> {
    mask.dims2()?;
    mask.affine(-MASKED, MASKED)
}

impl SelfAttention {
    /// Creates (or loads) `self.{query,key,value}` and `output.{dense,LayerNorm}` under `vb`
    /// (the layer's `attention` prefix).
    pub fn new(vb: VarBuilder, cfg: &BertConfig) -> Result<Self> {
        let h = cfg.hidden_size;
        let std = cfg.initializer_range;
        Ok(SelfAttention {
            query: Dense::new(vb.pp("self.query"), h, h, std)?,
            key: Dense::new(vb.pp("self.key"), h, h, std)?,
            value: Dense::new(vb.pp("self.value"), h, h, std)?,
            output: Dense::new(vb.pp("output.dense"), h, h, std)?,
            norm: Norm::new(vb.pp("output.LayerNorm"), h, cfg.layer_norm_eps)?,
            heads: cfg.num_attention_heads,
            hidden_dropout: cfg.hidden_dropout_prob,
            attention_dropout: cfg.attention_probs_dropout_prob,
        })
    }

    /// `x`: `[b, len, hidden]`; `bias`: [`mask_bias`] of the batch; `layer` keys dropout.
    ///
    /// The three projections run as one stacked linear layer and the attention proper as
    /// allgrad-nn's fused [`allgrad_nn::attention`].
    pub fn forward(&self, x: &Tensor, bias: &Tensor, layer: usize, dropout: Option<&DropoutKey>) -> Result<Tensor> {
        let (b, len, _) = x.dims3()?;
        let qkv = Dense::stacked(&[&self.query, &self.key, &self.value])?.forward(x)?;
        let mask = match dropout {
            Some(key) if self.attention_dropout > 0.0 => {
                let shape = (b, self.heads, len, len);
                Some(key.attention_mask(shape, self.attention_dropout, layer, x.dtype(), x.device())?)
            }
            _ => None,
        };
        let ctx = allgrad_nn::attention(&qkv, bias, self.heads, mask.as_ref())?;
        let out = self.output.forward(&ctx)?;
        let sum = match dropout {
            Some(key) => key.apply_residual(&out, x, self.hidden_dropout, layer, Site::AttentionOutput)?,
            None => (super::dropout::promote_to(&out, x)? + x)?,
        };
        self.norm.forward(&sum)
    }
}
