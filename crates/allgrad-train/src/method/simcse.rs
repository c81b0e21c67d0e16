//! `simcse`: [`SimCse`], a BERT encoder trained with InfoNCE over the global batch, on
//! unlabelled sentences (unsupervised: dropout is the augmentation) or on (anchor, positive,
//! hard negative) triplets (supervised).
//!
//! ```yaml
//! method: simcse
//! data: { sentences: data/wordnet/sentences.txt, limit: 4096 }   # or triplets: FILE.csv
//! model: { dir: data/models/all-MiniLM-L6-v2, pooling: cls_before_pooler, max_len: 32 }
//! loss: { temperature: 0.05 }                  # hard_negative_weight: triplets only; tile: 4096 for the tiled loss
//! eval: { retrieval: data/wordnet/retrieval.tsv, similarity_dir: data/eval/gensim }
//! ```

use std::path::{Path, PathBuf};

use allgrad_models::simcse::{read_nli_triplets, read_sentences, SimCse, SimCseData, SimCseEval, SimCseLoss, SimCseModel};
use allgrad_models::Objective;
use candle_core::Device;
use serde::{Deserialize, Serialize};

use super::{Method, SectionError};
use crate::config::RunConfig;

/// The sections of `simcse`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SimCseSections {
    /// The training text.
    pub data: SimCseDataConfig,
    /// The encoder.
    pub model: SimCseModel,
    /// The loss (default: temperature 0.05, no hard-negative weight).
    #[serde(default)]
    pub loss: SimCseLoss,
    /// The benchmarks evaluated before training and after every epoch (default: none).
    #[serde(default)]
    pub eval: SimCseEval,
}

/// The `data` section: exactly one of `sentences` and `triplets`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SimCseDataConfig {
    /// Unsupervised: a text file, one sentence a line (`wiki1m_for_simcse.txt` format).
    #[serde(default)]
    pub sentences: Option<PathBuf>,
    /// Supervised: a CSV with columns `sent0,sent1,hard_neg` (`nli_for_simcse.csv` format).
    #[serde(default)]
    pub triplets: Option<PathBuf>,
    /// Use only the first `limit` samples of the file.
    #[serde(default)]
    pub limit: Option<usize>,
}

impl SimCseDataConfig {
    /// Reads the file (the first `limit` samples).
    pub fn read(&self) -> candle_core::Result<SimCseData> {
        let limit = self.limit.unwrap_or(usize::MAX);
        match (&self.sentences, &self.triplets) {
            (Some(p), None) => Ok(SimCseData::Sentences(read_sentences(p)?.into_iter().take(limit).collect())),
            (None, Some(p)) => Ok(SimCseData::Triplets(read_nli_triplets(p)?.into_iter().take(limit).collect())),
            _ => candle_core::bail!("simcse: data needs exactly one of `sentences` and `triplets`"),
        }
    }
}

fn need_file(key: &str, path: &Path, what: &str) -> Result<(), SectionError> {
    if path.is_file() {
        return Ok(());
    }
    Err(SectionError::new(
        key,
        format!(
            "{} does not exist ({what}; a relative path in a config file is taken from the file's folder, one given \
             with --set from the current directory)",
            path.display()
        ),
    ))
}

/// `simcse`; see the module docs.
pub struct SimCseMethod;

impl Method for SimCseMethod {
    type Sections = SimCseSections;

    fn path_keys(&self) -> &'static [&'static str] {
        &["data.sentences", "data.triplets", "model.dir", "eval.retrieval", "eval.similarity_dir", "eval.sts"]
    }

    fn validate(&self, s: &SimCseSections, run: &RunConfig, _world_size: usize) -> Result<(), SectionError> {
        let d = &s.data;
        let (file, key) = match (&d.sentences, &d.triplets) {
            (Some(p), None) => (p, "data.sentences"),
            (None, Some(p)) => (p, "data.triplets"),
            (Some(_), Some(_)) => return Err(SectionError::new("data", "give `sentences` or `triplets`, not both")),
            (None, None) => return Err(SectionError::new("data", "needs `sentences` (unsupervised) or `triplets` (supervised)")),
        };
        need_file(key, file, "the training text")?;
        if let Some(limit) = d.limit {
            if limit < run.train.global_batch {
                return Err(SectionError::new(
                    "data.limit",
                    format!("data.limit = {limit} is smaller than train.global_batch = {}", run.train.global_batch),
                ));
            }
        }
        let m = &s.model;
        need_file("model.dir", &m.dir.join("config.json"), "a Hugging Face BERT folder has config.json")?;
        need_file("model.dir", &m.dir.join("tokenizer.json"), "a Hugging Face BERT folder has tokenizer.json")?;
        if m.pretrained {
            let hint = "pretrained weights; scripts/data/get_minilm.sh fetches all-MiniLM-L6-v2, or set model.pretrained: false";
            need_file("model.dir", &m.dir.join("model.safetensors"), hint)?;
        }
        if m.max_len < 2 {
            return Err(SectionError::new("model.max_len", format!("must be at least 2 ([CLS] and [SEP]), got {}", m.max_len)));
        }
        let l = &s.loss;
        if !(l.temperature > 0.0 && l.temperature.is_finite()) {
            return Err(SectionError::new("loss.temperature", format!("must be positive, got {}", l.temperature)));
        }
        if !l.hard_negative_weight.is_finite() {
            return Err(SectionError::new(
                "loss.hard_negative_weight",
                format!("must be finite, got {}", l.hard_negative_weight),
            ));
        }
        if l.hard_negative_weight != 0.0 && d.triplets.is_none() {
            return Err(SectionError::new("loss.hard_negative_weight", "needs data.triplets (sentences have no hard negatives)"));
        }
        l.tiling().map_err(|e| SectionError::from_model(e, "loss"))?;
        let e = &s.eval;
        if e.max_len < 2 {
            return Err(SectionError::new("eval.max_len", format!("must be at least 2, got {}", e.max_len)));
        }
        if e.batch == 0 {
            return Err(SectionError::new("eval.batch", "must be at least 1"));
        }
        Ok(())
    }

    fn objective(&self, s: SimCseSections, run: &RunConfig, device: &Device) -> candle_core::Result<Box<dyn Objective>> {
        let data = s.data.read()?;
        let objective = SimCse::new(s.model, s.loss, data, device.clone(), run.candle_dtype())?.with_evaluation(&s.eval)?;
        Ok(Box::new(objective))
    }
}
