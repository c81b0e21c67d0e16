//! Hugging Face CLIP and SigLIP folders in and out: `config.json`, `model.safetensors` (the
//! names of `transformers`' `CLIPModel` or `SiglipModel`) and `tokenizer.json`, read into a
//! [`ClipModel`], and a trained model written back as a folder `from_pretrained` loads.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Result, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};
use tokenizers::{Tokenizer, TruncationParams};

use super::config::{ClipConfig, TextPooling};
use super::model::ClipModel;
use super::preprocess::ImageProcessor;

fn msg(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

/// The tokenizer of a CLIP or SigLIP folder (`tokenizer.json`): its special tokens added,
/// truncated to the text tower's context length. For CLIP, the end-of-text token (where the
/// text is pooled) is checked to end every caption, kept last when a caption is cut, and pads.
#[derive(Clone)]
pub struct ClipTokenizer {
    inner: Tokenizer,
    pad_id: u32,
    max_len: usize,
    eot_id: Option<u32>,
}

impl ClipTokenizer {
    /// Reads `tokenizer.json`; sequences longer than `max_len` tokens are cut to `max_len`.
    ///
    /// `pooling` is the text tower's ([`ClipConfig::text_pooling`]). CLIP pools at the
    /// end-of-text token, so the tokenizer must end every caption with it: the token of
    /// `eos_token_id` ([`TextPooling::FirstOf`]), or with the legacy `eos_token_id` 2
    /// ([`TextPooling::LargestId`]) `<|endoftext|>`, which must be the vocabulary's largest
    /// id. Otherwise an error says which is missing (rather than pooling at position 0). A
    /// cut caption's last token is replaced by the end-of-text token; captions are padded
    /// with it. SigLIP ([`TextPooling::Last`]) pads with `pad_id` (its `pad_token_id`).
    pub fn from_file(path: &Path, max_len: usize, pooling: TextPooling, pad_id: u32) -> Result<Self> {
        if max_len < 2 {
            candle_core::bail!("clip tokenizer: max_len must be at least 2 (start and end of text), got {max_len}");
        }
        let mut inner = Tokenizer::from_file(path).map_err(|e| msg(format!("reading tokenizer {}: {e}", path.display())))?;
        inner
            .with_truncation(Some(TruncationParams { max_length: max_len, ..Default::default() }))
            .map_err(|e| msg(format!("tokenizer {}: truncation to {max_len}: {e}", path.display())))?;
        inner.with_padding(None);
        let eot_id = match pooling {
            TextPooling::Last => None,
            TextPooling::FirstOf(eos) => {
                if inner.id_to_token(eos).is_none() {
                    candle_core::bail!(
                        "tokenizer {} has no token of id {eos} (text_config.eos_token_id), the end-of-text token \
                         where CLIP pools the text: set eos_token_id to the tokenizer's end-of-text id",
                        path.display()
                    );
                }
                Some(eos)
            }
            TextPooling::LargestId => {
                let Some(eot) = inner.token_to_id("<|endoftext|>") else {
                    candle_core::bail!(
                        "tokenizer {} has no <|endoftext|> token, and text_config.eos_token_id is the legacy 2 (pool at \
                         the largest id, OpenAI's end-of-text): set eos_token_id to the tokenizer's end-of-text id",
                        path.display()
                    );
                };
                let largest = inner.get_vocab(true).into_values().max().unwrap_or(0);
                if eot != largest {
                    candle_core::bail!(
                        "tokenizer {}: <|endoftext|> is id {eot}, not the largest id {largest}, and \
                         text_config.eos_token_id is the legacy 2 (pool at the largest id): set eos_token_id to {eot}",
                        path.display()
                    );
                }
                Some(eot)
            }
        };
        if let Some(eot) = eot_id {
            // The tokenizer must end a caption with it (its post-processor appends it).
            let probe = inner.encode("a", true).map_err(|e| msg(format!("tokenizer {}: {e}", path.display())))?;
            if probe.get_ids().last() != Some(&eot) {
                let name = inner.id_to_token(eot).unwrap_or_default();
                candle_core::bail!(
                    "tokenizer {} does not end a caption with the end-of-text token {name:?} (id {eot}), where CLIP pools \
                     the text (it encodes \"a\" as {:?})",
                    path.display(),
                    probe.get_ids()
                );
            }
        }
        let pad_id = eot_id.unwrap_or(pad_id);
        Ok(ClipTokenizer { inner, pad_id, max_len, eot_id })
    }

    /// The id rows are padded with.
    pub fn pad_id(&self) -> u32 {
        self.pad_id
    }

    /// Token ids of `text`, the tokenizer's special tokens included, at most `max_len` of them.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, true).map_err(|e| msg(format!("tokenizing {text:?}: {e}")))?;
        let mut ids = enc.get_ids().to_vec();
        let full = ids.len() == self.max_len;
        if let (Some(eot), Some(last), true) = (self.eot_id, ids.last_mut(), full) {
            *last = eot;
        }
        Ok(ids)
    }
}

/// The tensors of a `model.safetensors` by name.
#[derive(Clone, Debug)]
pub struct ClipWeights {
    tensors: HashMap<String, Tensor>,
    file: PathBuf,
}

impl ClipWeights {
    /// Reads a `.safetensors` file onto the CPU.
    pub fn read(file: &Path) -> Result<Self> {
        let tensors = candle_core::safetensors::load(file, &Device::Cpu)
            .map_err(|e| msg(format!("reading CLIP weights {}: {e}", file.display())))?;
        Ok(ClipWeights { tensors, file: file.to_path_buf() })
    }

    fn tensor(&self, name: &str, shape: &Shape) -> Result<Tensor> {
        let t = self.tensors.get(name).ok_or_else(|| msg(format!("CLIP weights {}: no tensor {name}", self.file.display())))?;
        // A one-number tensor is read whether stored as `[]` or `[1]` (CLIP's logit scale is
        // the one, SigLIP's the other).
        if t.elem_count() == 1 && shape.elem_count() == 1 {
            return t.reshape(shape);
        }
        if t.shape() != shape {
            candle_core::bail!(
                "CLIP weights {}: tensor {name} has shape {:?}, the config needs {:?}",
                self.file.display(),
                t.dims(),
                shape.dims()
            );
        }
        Ok(t.clone())
    }

    /// A model of these weights alone (constants: inference).
    pub fn model(&self, cfg: &ClipConfig, dtype: DType, device: &Device) -> Result<ClipModel> {
        let backend = Pretrained { weights: self.clone(), into: None };
        ClipModel::new(&VarBuilder::from_backend(Box::new(backend), dtype, device.clone()), cfg)
    }

    /// A model whose parameters are created through `vb` (the trainer's seeded variables)
    /// and then overwritten with these weights: training starts from the checkpoint. With
    /// `bias_init` (a sigmoid loss) the model has a logit bias: the checkpoint's when it holds
    /// one (a SigLIP folder, or an export of a run with a sigmoid loss), else `bias_init`.
    pub fn init_model(&self, cfg: &ClipConfig, bias_init: Option<f64>, vb: VarBuilder<'_>) -> Result<ClipModel> {
        let (dtype, device) = (vb.dtype(), vb.device().clone());
        let backend = Pretrained { weights: self.clone(), into: Some(vb) };
        ClipModel::with_bias(&VarBuilder::from_backend(Box::new(backend), dtype, device), cfg, bias_init)
    }
}

/// Tensors a checkpoint may lack, which then take their initial value: the logit bias (a CLIP
/// checkpoint has none; a sigmoid loss starts it from its initial value).
const OPTIONAL: [&str; 1] = ["logit_bias"];

/// A VarBuilder backend reading [`ClipWeights`]; with `into`, each tensor is copied into the
/// variable `into` creates under the same name.
struct Pretrained<'a> {
    weights: ClipWeights,
    into: Option<VarBuilder<'a>>,
}

impl SimpleBackend for Pretrained<'_> {
    fn get(&self, s: Shape, name: &str, h: Init, dtype: DType, dev: &Device) -> Result<Tensor> {
        if OPTIONAL.contains(&name) && !self.weights.tensors.contains_key(name) {
            return match &self.into {
                None => Ok(h.var(s, dtype, dev)?.as_tensor().clone()),
                Some(vb) => vb.get_with_hints_dtype(s, name, h, dtype),
            };
        }
        let value = self.weights.tensor(name, &s)?.to_dtype(dtype)?.to_device(dev)?.contiguous()?;
        match &self.into {
            None => Ok(value),
            Some(vb) => {
                let target = vb.get_with_hints_dtype(s, name, h, dtype)?;
                if target.rank() == 0 {
                    // slice_set needs a dimension: a scalar goes through a view of one element.
                    target.reshape(1)?.slice_set(&value.reshape(1)?, 0, 0)?;
                } else {
                    target.slice_set(&value, 0, 0)?;
                }
                Ok(target)
            }
        }
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> Result<Tensor> {
        match self.weights.tensors.get(name) {
            Some(t) => t.to_dtype(dtype)?.to_device(dev),
            None => candle_core::bail!("CLIP weights {}: no tensor {name}", self.weights.file.display()),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.weights.tensors.contains_key(name)
    }
}

/// A Hugging Face CLIP folder.
#[derive(Clone, Debug)]
pub struct ClipFolder {
    /// The folder.
    pub dir: PathBuf,
    /// Its `config.json`.
    pub config: ClipConfig,
}

impl ClipFolder {
    /// Reads `config.json` of `dir` (weights and tokenizer are read when asked for).
    pub fn open(dir: &Path) -> Result<Self> {
        Ok(ClipFolder { dir: dir.to_path_buf(), config: ClipConfig::from_file(&dir.join("config.json"))? })
    }

    /// Its `model.safetensors`.
    pub fn weights(&self) -> Result<ClipWeights> {
        ClipWeights::read(&self.dir.join("model.safetensors"))
    }

    /// The model of its weights, for inference.
    pub fn model(&self, dtype: DType, device: &Device) -> Result<ClipModel> {
        self.weights()?.model(&self.config, dtype, device)
    }

    /// Its tokenizer, cutting at `max_len` tokens (at most the context length); for CLIP, an
    /// error when it does not end captions with the end-of-text token the text tower pools
    /// at ([`ClipTokenizer::from_file`]).
    pub fn tokenizer(&self, max_len: usize) -> Result<ClipTokenizer> {
        let limit = self.config.text_config.max_position_embeddings;
        if max_len > limit {
            candle_core::bail!(
                "max_len {max_len} exceeds the text tower's max_position_embeddings {limit} ({})",
                self.dir.display()
            );
        }
        let t = &self.config.text_config;
        ClipTokenizer::from_file(
            &self.dir.join("tokenizer.json"),
            max_len,
            self.config.text_pooling(),
            t.pad_token_id.unwrap_or(1),
        )
    }
}

/// Files of the source folder copied into an export when present (`tokenizer.json` must be).
const COPIED: [&str; 5] = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"];

/// Writes the model whose parameters are `params` (Hugging Face names; other names are left
/// out) as a folder `out` that `transformers`' `CLIPModel.from_pretrained` (or
/// `SiglipModel.from_pretrained`, as `config.json` says) loads: `source`'s `config.json` and
/// tokenizer files, the image preprocessing the run used as `preprocessor_config.json`
/// (`processor`; `CLIPImageProcessor` reads it), and the parameters in f32 as
/// `model.safetensors`, `logit_bias` included when the run has one (SigLIP's; `CLIPModel`
/// ignores it, and allgrad reads it back). Every tensor the config needs must be present with
/// its shape (checked by loading the folder back before returning).
pub fn export_clip_folder(params: &HashMap<String, Tensor>, source: &Path, out: &Path, processor: &ImageProcessor) -> Result<()> {
    let folder = ClipFolder::open(source)?;
    std::fs::create_dir_all(out).map_err(|e| msg(format!("creating {}: {e}", out.display())))?;
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    for (name, t) in params {
        if name.starts_with("vision_model.")
            || name.starts_with("text_model.")
            || name.ends_with("_projection.weight")
            || name == "logit_scale"
            || name == "logit_bias"
        {
            tensors.insert(name.clone(), t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.contiguous()?);
        }
    }
    std::fs::copy(source.join("config.json"), out.join("config.json"))
        .map_err(|e| msg(format!("copying config.json to {}: {e}", out.display())))?;
    for f in COPIED {
        let from = source.join(f);
        if from.is_file() {
            std::fs::copy(&from, out.join(f))
                .map_err(|e| msg(format!("copying {} to {}: {e}", from.display(), out.display())))?;
        } else if f == "tokenizer.json" {
            candle_core::bail!("export: {} has no tokenizer.json", source.display());
        }
    }
    processor.write(&out.join(super::preprocess::PREPROCESSOR_CONFIG))?;
    let file = out.join("model.safetensors");
    crate::save_safetensors(&tensors, &file)?;
    // Read back: every tensor the architecture needs, with its shape.
    ClipWeights::read(&file)?.model(&folder.config, DType::F32, &Device::Cpu)?;
    Ok(())
}
