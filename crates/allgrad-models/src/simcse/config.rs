//! What a SimCSE run is made of: the encoder, the loss, the data.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::bert::Pooling;
use crate::tiled::Tiling;
use crate::ModelError;

/// The `model` side of SimCSE: which BERT and how sentence embeddings are read.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SimCseModel {
    /// A Hugging Face BERT folder: `config.json` and `tokenizer.json`, and `model.safetensors`
    /// when `pretrained`.
    pub dir: PathBuf,
    /// Start from the folder's weights; otherwise from a fresh initialisation keyed by the
    /// run's seed and each parameter's name (BERT's: normal(0, initializer_range)).
    #[serde(default = "yes")]
    pub pretrained: bool,
    /// How the sentence embedding is read from the last hidden states.
    #[serde(default = "default_pooling")]
    pub pooling: Pooling,
    /// During training only, pass the embedding through an MLP head (dense + tanh, new
    /// parameters `head.dense.*`), as in the paper's unsupervised recipe.
    #[serde(default = "yes")]
    pub mlp_head: bool,
    /// Sequences are truncated to this many tokens, special tokens included.
    #[serde(default = "default_max_len")]
    pub max_len: usize,
}

/// The loss of SimCSE.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SimCseLoss {
    /// Softmax temperature of the cosine similarities.
    pub temperature: f64,
    /// Added to the logit of each anchor's own hard negative (supervised data only; 0: none).
    pub hard_negative_weight: f64,
    /// Compute the loss in blocks of `tile x tile` logits ([`super::info_nce_tiled`];
    /// [`Tiling`]). Absent: the whole `b x B` (`b x 2B` with hard negatives) logits at once.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tile: Option<usize>,
    /// Also score every anchor against the candidates (positives, and hard negatives) of the
    /// last `queue` global batches ([`super::info_nce_tiled_queued`]; [`Tiling`]). Needs
    /// `tile`. Absent: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue: Option<usize>,
}

impl SimCseLoss {
    /// `tile` and `queue`, checked ([`Tiling::new`]); the error names the key.
    pub fn tiling(&self) -> Result<Tiling, ModelError> {
        Tiling::new(self.tile, self.queue)
    }
}

impl Default for SimCseLoss {
    fn default() -> Self {
        SimCseLoss { temperature: 0.05, hard_negative_weight: 0.0, tile: None, queue: None }
    }
}

/// The training sentences.
#[derive(Clone, Debug, PartialEq)]
pub enum SimCseData {
    /// Unsupervised: each sentence is its own positive, through a different dropout mask.
    Sentences(Vec<String>),
    /// Supervised: (anchor, positive, hard negative) triplets.
    Triplets(Vec<[String; 3]>),
}

impl SimCseData {
    /// Number of training samples.
    pub fn len(&self) -> usize {
        match self {
            SimCseData::Sentences(s) => s.len(),
            SimCseData::Triplets(t) => t.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn yes() -> bool {
    true
}
fn default_pooling() -> Pooling {
    Pooling::ClsBeforePooler
}
fn default_max_len() -> usize {
    32
}
