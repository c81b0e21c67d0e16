//! A BERT encoder (Hugging Face `BertModel`) whose every op has a backward: embeddings,
//! self-attention with a padding mask, GELU (erf) feed-forward, post-LayerNorm (allgrad-nn's
//! differentiable layer norm and softmax: Candle's fused ones stop gradients), the `cls`,
//! `cls_before_pooler` and `mean` poolings, dropout from keyed streams, and loading of
//! Hugging Face folders (`config.json`, `model.safetensors`, `tokenizer.json`).
//!
//! ```no_run
//! use allgrad_models::bert::{BertFolder, Pooling};
//! use candle_core::{DType, Device};
//! # fn main() -> candle_core::Result<()> {
//! let folder = BertFolder::open(std::path::Path::new("data/models/all-MiniLM-L6-v2"))?;
//! let model = folder.model(DType::F32, &Device::Cpu)?;
//! let batch = folder.tokenizer(32)?.batch(&["a sentence", "another one"], &Device::Cpu)?;
//! let emb = model.embed(&batch, Pooling::Mean, None)?; // [2, 384]
//! # Ok(()) }
//! ```

mod attention;
mod checkpoint;
mod config;
mod dropout;
mod embeddings;
mod encode;
mod encoder_layer;
mod export;
mod layers;
mod model;
mod tokenizer;

pub use attention::{mask_bias, SelfAttention};
pub use checkpoint::{BertFolder, Checkpoint};
pub use config::BertConfig;
pub use dropout::{DropoutKey, Site};
pub use embeddings::Embeddings;
pub use encode::{cosine_matrix, embed_ids, embed_lines, embed_records, embed_texts, EmbeddedText};
pub use encoder_layer::EncoderLayer;
pub use export::export_hf_folder;
pub use layers::{Dense, Norm};
pub use model::{BertModel, Pooling};
pub use tokenizer::{BertTokenizer, TokenBatch};
