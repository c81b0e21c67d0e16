//! Inference over many texts: sentence embeddings in length-sorted batches (little padding),
//! returned in input order, dropout off; and the JSON lines of the `embed` command.

use candle_core::{Result, Tensor, D};
use serde::Serialize;

use super::model::{BertModel, Pooling};
use super::tokenizer::{BertTokenizer, TokenBatch};

/// Embeddings `[n, hidden]` (the model's dtype, detached) of `texts` in their order, and the
/// token ids of each, through `batch` sequences per forward. With `normalize`, each row has
/// unit L2 norm.
pub fn embed_texts<S: AsRef<str>>(
    model: &BertModel,
    tokenizer: &BertTokenizer,
    pooling: Pooling,
    texts: &[S],
    batch: usize,
    normalize: bool,
) -> Result<(Vec<Vec<u32>>, Tensor)> {
    let ids = texts.iter().map(|t| tokenizer.encode(t.as_ref())).collect::<Result<Vec<_>>>()?;
    let emb = embed_ids(model, tokenizer.pad_id(), pooling, &ids, batch)?;
    let emb = if normalize { crate::losses::l2_normalize(&emb)? } else { emb };
    Ok((ids, emb))
}

/// As [`embed_texts`], from token ids (padding with `pad_id`); `[0, hidden]` for no rows.
pub fn embed_ids(model: &BertModel, pad_id: u32, pooling: Pooling, ids: &[Vec<u32>], batch: usize) -> Result<Tensor> {
    if batch == 0 {
        candle_core::bail!("embed: batch must be at least 1");
    }
    let device = model.device().clone();
    let hidden = model.config().hidden_size;
    if ids.is_empty() {
        return Tensor::zeros((0, hidden), model.dtype(), &device);
    }
    let mut order: Vec<usize> = (0..ids.len()).collect();
    order.sort_by_key(|&i| (ids[i].len(), i));
    let mut parts = Vec::new();
    for chunk in order.chunks(batch) {
        let rows = chunk.iter().map(|&i| ids[i].clone()).collect();
        let tokens = TokenBatch::from_ids(rows, pad_id, &device)?;
        parts.push(model.embed(&tokens, pooling, None)?.detach());
    }
    let sorted = Tensor::cat(&parts, 0)?.contiguous()?;
    // Row k of `sorted` is text order[k]: invert the permutation.
    let mut back = vec![0u32; ids.len()];
    for (k, &i) in order.iter().enumerate() {
        back[i] = k as u32;
    }
    sorted.index_select(&Tensor::from_vec(back, ids.len(), &device)?, 0)
}

/// One line of the `embed` command's output.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct EmbeddedText {
    /// The input line.
    pub text: String,
    /// Its token ids, special tokens included, truncated.
    pub ids: Vec<u32>,
    /// Its embedding (f32).
    pub embedding: Vec<f32>,
}

/// The embeddings of `texts` as [`EmbeddedText`]s, in order.
pub fn embed_records(
    model: &BertModel,
    tokenizer: &BertTokenizer,
    pooling: Pooling,
    texts: &[String],
    batch: usize,
    normalize: bool,
) -> Result<Vec<EmbeddedText>> {
    let (ids, emb) = embed_texts(model, tokenizer, pooling, texts, batch, normalize)?;
    let rows = if texts.is_empty() { Vec::new() } else { emb.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()? };
    Ok(texts.iter().zip(ids).zip(rows).map(|((t, ids), embedding)| EmbeddedText { text: t.clone(), ids, embedding }).collect())
}

/// Cosine similarities `[n, m]` of the rows of `a` `[n, d]` and `b` `[m, d]`, in f64.
pub fn cosine_matrix(a: &Tensor, b: &Tensor) -> Result<Vec<Vec<f64>>> {
    let unit = |x: &Tensor| -> Result<Tensor> {
        let x = x.to_dtype(candle_core::DType::F64)?;
        x.broadcast_div(&x.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?.maximum(1e-12)?)
    };
    unit(a)?.matmul(&unit(b)?.t()?)?.to_vec2::<f64>()
}

/// The `embed` command: every non-empty line of `input` through the encoder of `folder`,
/// written to `output` as one JSON object per line, `{"text", "ids", "embedding"}`, in
/// order. Returns the number of lines embedded.
pub fn embed_lines(
    folder: &super::BertFolder,
    pooling: Pooling,
    max_len: usize,
    normalize: bool,
    input: impl std::io::BufRead,
    mut output: impl std::io::Write,
) -> Result<usize> {
    let texts: Vec<String> = input
        .lines()
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(|e| candle_core::Error::Msg(format!("embed: reading the input: {e}")))?
        .into_iter()
        .map(|l| l.trim_end_matches('\r').to_string())
        .filter(|l| !l.trim().is_empty())
        .collect();
    let model = folder.model(candle_core::DType::F32, &candle_core::Device::Cpu)?;
    let tokenizer = folder.tokenizer(max_len)?;
    for record in embed_records(&model, &tokenizer, pooling, &texts, 32, normalize)? {
        let line = serde_json::to_string(&record).map_err(|e| candle_core::Error::Msg(format!("embed: {e}")))?;
        writeln!(output, "{line}").map_err(|e| candle_core::Error::Msg(format!("embed: writing the output: {e}")))?;
    }
    Ok(texts.len())
}
