//! BERT's input embeddings: word + position + token type, then LayerNorm and dropout.

use candle_core::{Result, Tensor};
use candle_nn::{Init, VarBuilder};

use super::config::BertConfig;
use super::dropout::{DropoutKey, Site};
use super::layers::Norm;

/// The embedding tables (Hugging Face names under `embeddings.`).
#[derive(Clone, Debug)]
pub struct Embeddings {
    word: Tensor,
    position: Tensor,
    token_type: Tensor,
    norm: Norm,
    dropout: f64,
}

impl Embeddings {
    /// Creates (or loads) `word_embeddings`, `position_embeddings`, `token_type_embeddings`
    /// and `LayerNorm` under `vb`.
    pub fn new(vb: VarBuilder, cfg: &BertConfig) -> Result<Self> {
        let init = Init::Randn { mean: 0.0, stdev: cfg.initializer_range };
        let h = cfg.hidden_size;
        Ok(Embeddings {
            word: vb.get_with_hints((cfg.vocab_size, h), "word_embeddings.weight", init)?,
            position: vb.get_with_hints((cfg.max_position_embeddings, h), "position_embeddings.weight", init)?,
            token_type: vb.get_with_hints((cfg.type_vocab_size, h), "token_type_embeddings.weight", init)?,
            norm: Norm::new(vb.pp("LayerNorm"), h, cfg.layer_norm_eps)?,
            dropout: cfg.hidden_dropout_prob,
        })
    }

    /// `[b, len, hidden]` from token ids and token type ids (`[b, len]`, u32). Ids out of
    /// range are an error naming the id.
    pub fn forward(&self, ids: &Tensor, type_ids: &Tensor, dropout: Option<&DropoutKey>) -> Result<Tensor> {
        let (b, len) = ids.dims2()?;
        let positions = self.position.dim(0)?;
        if len > positions {
            candle_core::bail!("BERT embeddings: sequence length {len} exceeds max_position_embeddings {positions}");
        }
        check_ids(ids, self.word.dim(0)?, "token id", "vocab_size")?;
        check_ids(type_ids, self.token_type.dim(0)?, "token type id", "type_vocab_size")?;
        let h = self.word.dim(1)?;
        let words = self.word.embedding(&ids.flatten_all()?)?.reshape((b, len, h))?;
        let types = self.token_type.embedding(&type_ids.flatten_all()?)?.reshape((b, len, h))?;
        let pos = self.position.narrow(0, 0, len)?.unsqueeze(0)?;
        let x = self.norm.forward(&(words + types)?.broadcast_add(&pos)?)?;
        match dropout {
            Some(key) => key.apply(&x, self.dropout, 0, Site::Embeddings),
            None => Ok(x),
        }
    }
}

/// Fails on an id outside the table. On the host path only: on a device (and the CPU's device
/// path) reading the ids back would stop the host in every forward, and Candle's device
/// `index_select` is left to meet an id from a tokenizer whose vocabulary exceeds the model's.
fn check_ids(ids: &Tensor, n: usize, what: &str, field: &str) -> Result<()> {
    if allgrad_nn::transfer::takes_device_path(ids.device()) {
        return Ok(());
    }
    if let Some(bad) = ids.flatten_all()?.to_vec1::<u32>()?.into_iter().find(|&i| i as usize >= n) {
        candle_core::bail!("BERT embeddings: {what} {bad} is out of range ({field} = {n})");
    }
    Ok(())
}

impl Embeddings {
    /// The dtype of the parameters.
    pub fn dtype(&self) -> candle_core::DType {
        self.word.dtype()
    }

    /// The device of the parameters.
    pub fn device(&self) -> &candle_core::Device {
        self.word.device()
    }
}
