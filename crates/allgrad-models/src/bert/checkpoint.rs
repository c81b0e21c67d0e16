//! Loading Hugging Face `BertModel` checkpoints: `config.json` and `model.safetensors`, with
//! or without the `bert.` prefix of task models (`BertForMaskedLM` and the like).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Result, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};

use super::config::BertConfig;
use super::model::BertModel;

/// The tensors of a checkpoint file by encoder-relative name: a `bert.` prefix is removed,
/// and old-style `LayerNorm.gamma`/`beta` read as `LayerNorm.weight`/`bias`. Tensors outside
/// the encoder (a masked-LM head, `position_ids`) are kept but never asked for.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    tensors: HashMap<String, Tensor>,
    file: PathBuf,
}

impl Checkpoint {
    /// Reads a `.safetensors` file onto the CPU.
    pub fn read(file: &Path) -> Result<Self> {
        let raw = candle_core::safetensors::load(file, &Device::Cpu)
            .map_err(|e| candle_core::Error::Msg(format!("reading BERT weights {}: {e}", file.display())))?;
        let tensors = raw
            .into_iter()
            .map(|(k, v)| {
                let k = k.strip_prefix("bert.").unwrap_or(&k).to_string();
                let k = match (k.contains("LayerNorm"), k.rsplit_once('.')) {
                    (true, Some((head, "gamma"))) => format!("{head}.weight"),
                    (true, Some((head, "beta"))) => format!("{head}.bias"),
                    _ => k,
                };
                (k, v)
            })
            .collect();
        Ok(Checkpoint { tensors, file: file.to_path_buf() })
    }

    /// Whether the checkpoint holds the pooler (`pooler.dense.weight` and `.bias`).
    pub fn has_pooler(&self) -> bool {
        self.tensors.contains_key("pooler.dense.weight") && self.tensors.contains_key("pooler.dense.bias")
    }

    /// The tensor `name` (encoder-relative) with shape `shape`; a missing or mis-shaped tensor
    /// is an error naming it and the file.
    pub fn tensor(&self, name: &str, shape: &Shape) -> Result<&Tensor> {
        let t = self.tensors.get(name).ok_or_else(|| {
            candle_core::Error::Msg(format!("BERT weights {}: no tensor {name} (nor bert.{name})", self.file.display()))
        })?;
        if t.shape() != shape {
            candle_core::bail!(
                "BERT weights {}: tensor {name} has shape {:?}, the config needs {:?}",
                self.file.display(),
                t.dims(),
                shape.dims()
            );
        }
        Ok(t)
    }

    /// Builds a model from these weights alone (no trainable variables: inference).
    pub fn model(&self, config: &BertConfig, dtype: DType, device: &Device) -> Result<BertModel> {
        let backend = Pretrained { ckpt: self.clone(), into: None };
        BertModel::new(VarBuilder::from_backend(Box::new(backend), dtype, device.clone()), config, self.has_pooler())
    }

    /// Builds a model whose parameters are created through `vb` (e.g. the trainer's seeded
    /// store of variables) and then overwritten with these weights, so that training starts
    /// from the checkpoint. The pooler is created only when `with_pooler`.
    pub fn init_model(&self, config: &BertConfig, vb: VarBuilder<'_>, with_pooler: bool) -> Result<BertModel> {
        let (dtype, device) = (vb.dtype(), vb.device().clone());
        let backend = Pretrained { ckpt: self.clone(), into: Some(vb) };
        BertModel::new(VarBuilder::from_backend(Box::new(backend), dtype, device), config, with_pooler)
    }
}

/// A VarBuilder backend that reads a [`Checkpoint`]; with `into`, it copies each tensor into
/// the variable `into` creates under the same name.
struct Pretrained<'a> {
    ckpt: Checkpoint,
    into: Option<VarBuilder<'a>>,
}

impl SimpleBackend for Pretrained<'_> {
    fn get(&self, s: Shape, name: &str, h: Init, dtype: DType, dev: &Device) -> Result<Tensor> {
        let value = self.ckpt.tensor(name, &s)?.to_dtype(dtype)?.to_device(dev)?.contiguous()?;
        match &self.into {
            None => Ok(value),
            Some(vb) => {
                let target = vb.get_with_hints_dtype(s, name, h, dtype)?;
                target.slice_set(&value, 0, 0)?;
                Ok(target)
            }
        }
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> Result<Tensor> {
        match self.ckpt.tensors.get(name) {
            Some(t) => t.to_dtype(dtype)?.to_device(dev),
            None => candle_core::bail!("BERT weights {}: no tensor {name}", self.ckpt.file.display()),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.ckpt.tensors.contains_key(name)
    }
}

/// A Hugging Face BERT folder: `config.json`, `model.safetensors`, `tokenizer.json`.
#[derive(Clone, Debug)]
pub struct BertFolder {
    /// The folder.
    pub dir: PathBuf,
    /// Its `config.json`.
    pub config: BertConfig,
    /// Its `model.safetensors`.
    pub checkpoint: Checkpoint,
}

impl BertFolder {
    /// Reads `config.json` and `model.safetensors` of `dir`.
    pub fn open(dir: &Path) -> Result<Self> {
        let config = BertConfig::from_file(&dir.join("config.json"))?;
        let checkpoint = Checkpoint::read(&dir.join("model.safetensors"))?;
        Ok(BertFolder { dir: dir.to_path_buf(), config, checkpoint })
    }

    /// The model, for inference.
    pub fn model(&self, dtype: DType, device: &Device) -> Result<BertModel> {
        self.checkpoint.model(&self.config, dtype, device)
    }

    /// The tokenizer (`tokenizer.json`), truncating to `max_len`.
    pub fn tokenizer(&self, max_len: usize) -> Result<super::BertTokenizer> {
        if max_len > self.config.max_position_embeddings {
            candle_core::bail!(
                "max_len {max_len} exceeds the model's max_position_embeddings {} ({})",
                self.config.max_position_embeddings,
                self.dir.display()
            );
        }
        super::BertTokenizer::from_file(&self.dir.join("tokenizer.json"), max_len)
    }
}
