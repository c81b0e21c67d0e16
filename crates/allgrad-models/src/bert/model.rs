//! The BERT encoder (Hugging Face `BertModel`): embeddings, encoder layers, optional pooler,
//! and the three sentence poolings.

use candle_core::{Result, Tensor, D};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use super::attention::mask_bias;
use super::config::BertConfig;
use super::dropout::DropoutKey;
use super::embeddings::Embeddings;
use super::encoder_layer::EncoderLayer;
use super::layers::Dense;
use super::tokenizer::TokenBatch;

/// How a sentence embedding is read from the last hidden states.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Pooling {
    /// The `[CLS]` state through the pooler (dense + tanh), as `BertModel`'s `pooler_output`.
    #[default]
    Cls,
    /// The `[CLS]` state as it leaves the last layer.
    ClsBeforePooler,
    /// The mean of the states of real tokens (padding excluded).
    Mean,
}

/// A BERT encoder. Parameter names are Hugging Face's (`embeddings.*`, `encoder.layer.{i}.*`,
/// `pooler.dense.*`) relative to the `VarBuilder` it is built from.
#[derive(Clone, Debug)]
pub struct BertModel {
    embeddings: Embeddings,
    layers: Vec<EncoderLayer>,
    pooler: Option<Dense>,
    config: BertConfig,
}

impl BertModel {
    /// Creates (or loads) every parameter under `vb`; the pooler only when `with_pooler`.
    pub fn new(vb: VarBuilder, config: &BertConfig, with_pooler: bool) -> Result<Self> {
        config.validate().map_err(|e| candle_core::Error::Msg(format!("BERT config: {e}")))?;
        let embeddings = Embeddings::new(vb.pp("embeddings"), config)?;
        let layers = (0..config.num_hidden_layers)
            .map(|i| EncoderLayer::new(vb.pp(format!("encoder.layer.{i}")), config))
            .collect::<Result<Vec<_>>>()?;
        let h = config.hidden_size;
        let pooler = if with_pooler { Some(Dense::new(vb.pp("pooler.dense"), h, h, config.initializer_range)?) } else { None };
        Ok(BertModel { embeddings, layers, pooler, config: config.clone() })
    }

    /// The architecture.
    pub fn config(&self) -> &BertConfig {
        &self.config
    }

    /// Whether the model has its pooler (needed by [`Pooling::Cls`]).
    pub fn has_pooler(&self) -> bool {
        self.pooler.is_some()
    }

    /// The last hidden states `[b, len, hidden]`. With `dropout`, every dropout site draws
    /// its mask from the key's streams (training); without, dropout is off (evaluation).
    pub fn forward(&self, batch: &TokenBatch, dropout: Option<&DropoutKey>) -> Result<Tensor> {
        let mask = batch.mask.to_dtype(self.embeddings_dtype())?;
        let bias = mask_bias(&mask)?;
        let mut x = self.embeddings.forward(&batch.ids, &batch.type_ids, dropout)?;
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(&x, &bias, i + 1, dropout)?;
        }
        Ok(x)
    }

    fn embeddings_dtype(&self) -> candle_core::DType {
        self.embeddings.dtype()
    }

    /// The dtype of the parameters.
    pub fn dtype(&self) -> candle_core::DType {
        self.embeddings.dtype()
    }

    /// The device of the parameters.
    pub fn device(&self) -> &candle_core::Device {
        self.embeddings.device()
    }

    /// The `[CLS]` state `[b, hidden]` of `hidden` (`[b, len, hidden]`).
    pub fn cls(hidden: &Tensor) -> Result<Tensor> {
        hidden.narrow(1, 0, 1)?.squeeze(1)
    }

    /// The pooler (dense + tanh) applied to `x` (`[b, hidden]`).
    pub fn pooler(&self, x: &Tensor) -> Result<Tensor> {
        match &self.pooler {
            Some(p) => p.forward(x)?.tanh(),
            None => {
                candle_core::bail!("this BERT model has no pooler (pooler.dense.weight): use pooling mean or cls_before_pooler")
            }
        }
    }

    /// Sentence embeddings `[b, hidden]` from the last hidden states; `mask` is the batch's
    /// `[b, len]` attention mask (mean pooling counts only real tokens).
    pub fn pool(&self, hidden: &Tensor, mask: &Tensor, pooling: Pooling) -> Result<Tensor> {
        match pooling {
            Pooling::Cls => self.pooler(&Self::cls(hidden)?),
            Pooling::ClsBeforePooler => Self::cls(hidden),
            Pooling::Mean => {
                let m = mask.to_dtype(hidden.dtype())?.unsqueeze(D::Minus1)?; // [b, len, 1]
                let sum = hidden.broadcast_mul(&m)?.sum(1)?;
                sum.broadcast_div(&m.sum(1)?)
            }
        }
    }

    /// [`BertModel::forward`] then [`BertModel::pool`].
    pub fn embed(&self, batch: &TokenBatch, pooling: Pooling, dropout: Option<&DropoutKey>) -> Result<Tensor> {
        let hidden = self.forward(batch, dropout)?;
        self.pool(&hidden, &batch.mask, pooling)
    }
}
