//! Tokenization through the `tokenizers` crate (a Hugging Face `tokenizer.json`), truncation
//! to `max_len` and padding to the longest sequence of the batch.

use std::path::Path;

use candle_core::{Device, Result, Tensor};
use tokenizers::{Tokenizer, TruncationParams};

/// A padded batch of token sequences, ready for [`super::BertModel::forward`].
#[derive(Clone, Debug)]
pub struct TokenBatch {
    /// Token ids `[b, len]` (u32), padded with the pad id.
    pub ids: Tensor,
    /// Token type ids `[b, len]` (u32; all 0 for single sentences).
    pub type_ids: Tensor,
    /// Attention mask `[b, len]` (u32: 1 for tokens, 0 for padding).
    pub mask: Tensor,
    /// The unpadded ids of each sequence.
    pub rows: Vec<Vec<u32>>,
}

impl TokenBatch {
    /// Pads `rows` (single-segment sequences) to the longest with `pad_id`.
    pub fn from_ids(rows: Vec<Vec<u32>>, pad_id: u32, device: &Device) -> Result<Self> {
        let b = rows.len();
        let len = rows.iter().map(Vec::len).max().unwrap_or(0);
        if b == 0 || len == 0 {
            candle_core::bail!("token batch: need at least one non-empty sequence, got {b} sequences of at most {len} tokens");
        }
        let mut ids = vec![pad_id; b * len];
        let mut mask = vec![0u32; b * len];
        for (r, row) in rows.iter().enumerate() {
            ids[r * len..r * len + row.len()].copy_from_slice(row);
            mask[r * len..r * len + row.len()].fill(1);
        }
        Ok(TokenBatch {
            ids: Tensor::from_vec(ids, (b, len), device)?,
            type_ids: Tensor::zeros((b, len), candle_core::DType::U32, device)?,
            mask: Tensor::from_vec(mask, (b, len), device)?,
            rows,
        })
    }

    /// Number of sequences.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether the batch is empty (never, for a batch built by [`TokenBatch::from_ids`]).
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
}

/// A Hugging Face tokenizer with the encoder's truncation.
#[derive(Clone)]
pub struct BertTokenizer {
    inner: Tokenizer,
    pad_id: u32,
}

fn tok_err(what: String) -> impl FnOnce(tokenizers::Error) -> candle_core::Error {
    move |e| candle_core::Error::Msg(format!("{what}: {e}"))
}

impl BertTokenizer {
    /// Reads `tokenizer.json`; sequences are truncated to `max_len` tokens, special tokens
    /// included. The pad id is the one of `[PAD]` (0 when the vocabulary has none).
    pub fn from_file(path: &Path, max_len: usize) -> Result<Self> {
        if max_len < 2 {
            candle_core::bail!("tokenizer: max_len must be at least 2 ([CLS] and [SEP]), got {max_len}");
        }
        let mut inner = Tokenizer::from_file(path).map_err(tok_err(format!("reading tokenizer {}", path.display())))?;
        inner
            .with_truncation(Some(TruncationParams { max_length: max_len, ..Default::default() }))
            .map_err(tok_err(format!("tokenizer {}: truncation to {max_len}", path.display())))?;
        inner.with_padding(None);
        let pad_id = inner.token_to_id("[PAD]").unwrap_or(0);
        Ok(BertTokenizer { inner, pad_id })
    }

    /// The id of padding.
    pub fn pad_id(&self) -> u32 {
        self.pad_id
    }

    /// Token ids of one sentence, special tokens included, truncated.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, true).map_err(tok_err(format!("tokenizing {text:?}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// A padded batch of `texts`.
    pub fn batch<S: AsRef<str>>(&self, texts: &[S], device: &Device) -> Result<TokenBatch> {
        let rows = texts.iter().map(|t| self.encode(t.as_ref())).collect::<Result<Vec<_>>>()?;
        TokenBatch::from_ids(rows, self.pad_id, device)
    }
}
