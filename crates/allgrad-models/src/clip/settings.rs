//! The run-config sections of `method: clip` (`data`, `model`, `loss`, `eval`), as serde
//! types. Validation against files and the batch happens once, in the method
//! (`allgrad-train`); the objective re-checks what it relies on. The loss's `tile` (and the
//! `queue` it refuses) has one check, [`ClipLoss::tiling`], which both call.

use std::path::PathBuf;

use allgrad_data::webdataset::{CaptionField, WebDatasetOptions};
use allgrad_data::LoaderConfig;
use serde::{Deserialize, Serialize};

use crate::tiled::Tiling;
use crate::ModelError;

/// Which loss trains the towers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossKind {
    /// CLIP's symmetric InfoNCE over the global batch, every rank's embeddings gathered.
    #[default]
    Clip,
    /// CLIP's symmetric InfoNCE, the embeddings passed around a ring; memory independent of
    /// the number of ranks ([`crate::clip::ring`]).
    ClipRing,
    /// SigLIP's sigmoid loss, every text gathered at once.
    SiglipGather,
    /// SigLIP's sigmoid loss, the texts passed around a ring of point-to-point exchanges;
    /// memory independent of the number of ranks ([`crate::clip::ring`]).
    SiglipRing,
}

impl LossKind {
    /// The name in a config (`clip`, `clip_ring`, `siglip_gather`, `siglip_ring`).
    pub fn name(self) -> &'static str {
        match self {
            LossKind::Clip => "clip",
            LossKind::ClipRing => "clip_ring",
            LossKind::SiglipGather => "siglip_gather",
            LossKind::SiglipRing => "siglip_ring",
        }
    }
}

fn siglip_scale() -> f64 {
    10f64.ln()
}
fn siglip_bias() -> f64 {
    -10.0
}

/// The `loss` section.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClipLoss {
    /// `clip` (default), `clip_ring`, `siglip_gather` or `siglip_ring`.
    #[serde(default)]
    pub kind: LossKind,
    /// `clip`, `clip_ring` and `siglip_ring`: compute the logits in `tile x tile` blocks
    /// (exact; memory independent of the batch; [`Tiling`]); in the ring kinds, inside each
    /// received block.
    #[serde(default)]
    pub tile: Option<usize>,
    /// Not available: CLIP's tiled loss keeps no queue of past keys; the key is read only to
    /// refuse it with that reason ([`Tiling::without_queue`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<usize>,
    /// SigLIP only: the initial `logit_scale` (the log of the logits' multiplier; the paper's
    /// ln 10). CLIP takes its initial value from the model's `config.json`.
    #[serde(default = "siglip_scale")]
    pub siglip_scale_init: f64,
    /// SigLIP only: the initial logit bias `logit_bias` (the paper's −10).
    #[serde(default = "siglip_bias")]
    pub siglip_bias_init: f64,
}

impl Default for ClipLoss {
    fn default() -> Self {
        ClipLoss {
            kind: LossKind::Clip,
            tile: None,
            queue: None,
            siglip_scale_init: siglip_scale(),
            siglip_bias_init: siglip_bias(),
        }
    }
}

impl ClipLoss {
    /// `tile`, checked ([`Tiling::without_queue`]: a `queue` is refused), and refused with
    /// `siglip_gather`; the error names the key.
    pub fn tiling(&self) -> Result<Tiling, ModelError> {
        let tiling = Tiling::without_queue(self.tile, self.queue, self.kind.name())?;
        if tiling.tile().is_some() && self.kind == LossKind::SiglipGather {
            return Err(ModelError::LossKey {
                key: "tile",
                msg: "loss.tile applies to kinds clip, clip_ring and siglip_ring, not siglip_gather (its logits are \
                      whole; siglip_ring computes them block by block, in tiles with loss.tile)"
                    .into(),
            });
        }
        Ok(tiling)
    }

    /// Whether the loss is a ring form (`clip_ring`, `siglip_ring`).
    pub fn is_ring(&self) -> bool {
        matches!(self.kind, LossKind::ClipRing | LossKind::SiglipRing)
    }
}

/// The `model` section.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClipModelSection {
    /// A Hugging Face CLIP folder: `config.json` (the architecture) and `tokenizer.json`;
    /// `model.safetensors` too when `pretrained`.
    pub dir: PathBuf,
    /// Start from the folder's weights (default: false, a fresh model of its architecture).
    #[serde(default)]
    pub pretrained: bool,
    /// Longest caption in tokens, start and end of text included (default: the text tower's
    /// context length).
    #[serde(default)]
    pub max_len: Option<usize>,
    /// Per-channel mean of the input standardisation (default: the folder's
    /// `preprocessor_config.json`, else OpenAI CLIP's for 3 channels, 0.5 for 1).
    #[serde(default)]
    pub mean: Option<Vec<f32>>,
    /// Per-channel standard deviation (default: as `mean`).
    #[serde(default)]
    pub std: Option<Vec<f32>>,
}

fn random_crop() -> Option<[f64; 2]> {
    Some([0.9, 1.0])
}

/// The `data` section: exactly one of `csv`, `images` and `shards`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClipData {
    /// A CSV of pairs, header `image,caption` (paths relative to the CSV's folder).
    #[serde(default)]
    pub csv: Option<PathBuf>,
    /// An IDX folder (`train-images-idx3-ubyte.gz`, ...): its training split, captioned from
    /// `classes` and `templates`.
    #[serde(default)]
    pub images: Option<PathBuf>,
    /// With `images`: each class's names, its name first, then synonyms.
    #[serde(default)]
    pub classes: Vec<Vec<String>>,
    /// With `images`: caption templates, each with one `{}` for a class name.
    #[serde(default)]
    pub templates: Vec<String>,
    /// Use only the first `limit` pairs (`csv` and `images`).
    #[serde(default)]
    pub limit: Option<usize>,
    /// A folder of webdataset shards of image-caption pairs (as img2dataset or `write-shards
    /// --captions` write them): `jpg`/`png`/`webp` members with the caption in `caption`; the shards
    /// and the stream's settings are `webdataset`'s (paths relative to this folder).
    #[serde(default)]
    pub shards: Option<PathBuf>,
    /// With `shards`: the training shards, epoch length, streams, shuffle buffer and what a
    /// corrupt sample (one without its caption among them) does.
    #[serde(default)]
    pub webdataset: WebDatasetOptions,
    /// With `shards`: where a sample's caption is, `txt` (a member) or `json:caption` (a field
    /// of the `json` member). Default `txt`.
    #[serde(default)]
    pub caption: CaptionField,
    /// The loader's worker threads and prefetch: images are decoded and preprocessed and
    /// captions tokenized there, never on the training thread.
    #[serde(default)]
    pub loader: LoaderConfig,
    /// OpenCLIP's training augmentation: a random box of this fraction of the image's area
    /// (aspect ratio 3/4 to 4/3) resized to the model's input, in place of the resize and
    /// centre crop of evaluation. `null`: training images are preprocessed as for evaluation.
    #[serde(default = "random_crop")]
    pub random_crop: Option<[f64; 2]>,
}

impl Default for ClipData {
    fn default() -> Self {
        ClipData {
            csv: None,
            images: None,
            classes: Vec::new(),
            templates: Vec::new(),
            limit: None,
            shards: None,
            webdataset: WebDatasetOptions::default(),
            caption: CaptionField::default(),
            loader: LoaderConfig::default(),
            random_crop: random_crop(),
        }
    }
}

fn zero_shot() -> usize {
    1000
}
fn retrieval() -> usize {
    200
}
fn eval_batch() -> usize {
    250
}

/// The `eval` section: zero-shot classification and image-text retrieval on `eval.images` or
/// the test split of `data.images` ([`super::open_test_set`]), before training and after
/// every epoch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClipEval {
    /// Prompt templates of zero-shot classification (each class's name in every one; the
    /// normalised text embeddings averaged per class) and of the retrieval captions, which
    /// also use the synonyms. Held out from `data.templates` for an honest test.
    pub templates: Vec<String>,
    /// Test images classified zero-shot (the first ones of the test split; 0: none).
    #[serde(default = "zero_shot")]
    pub zero_shot: usize,
    /// Test pairs of the retrieval benchmark (image to text and text to image recall@1 and
    /// @5; 0: none).
    #[serde(default = "retrieval")]
    pub retrieval: usize,
    /// Images embedded per forward pass.
    #[serde(default = "eval_batch")]
    pub batch: usize,
    /// What to evaluate on instead of the test split of `data.images` (a run training from
    /// shards or a CSV names one here): an IDX folder (its test split) or an image folder (one
    /// sub-folder per class, sorted by name, PNG, JPEG or WebP files inside).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub images: Option<PathBuf>,
    /// The evaluated classes' names (in the IDX labels' order, or the sub-folders' sorted
    /// order), each its name first, then synonyms. Default: `data.classes` for an IDX test
    /// split, each sub-folder's name (`_` read as a space) for an image folder.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub classes: Vec<Vec<String>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(loss: ClipLoss) -> (&'static str, String) {
        match loss.tiling().unwrap_err() {
            ModelError::LossKey { key, msg } => (key, msg),
            e => panic!("not a LossKey: {e}"),
        }
    }

    #[test]
    fn the_tile_is_checked_once_and_a_queue_or_a_siglip_tile_refused() {
        assert_eq!(ClipLoss { tile: Some(4), ..Default::default() }.tiling().unwrap().tile(), Some(4));
        assert_eq!(ClipLoss { kind: LossKind::SiglipRing, ..Default::default() }.tiling().unwrap(), Tiling::UNTILED);
        // The ring kinds take a tile (inside each received block).
        for kind in [LossKind::ClipRing, LossKind::SiglipRing] {
            assert_eq!(ClipLoss { kind, tile: Some(4), ..Default::default() }.tiling().unwrap().tile(), Some(4), "{kind:?}");
        }
        let (key, msg) = refused(ClipLoss { tile: Some(0), ..Default::default() });
        assert!(key == "tile" && msg.starts_with("loss.tile = 0") && msg.contains("at least 1"), "{msg}");
        let (key, msg) = refused(ClipLoss { tile: Some(4), queue: Some(2), ..Default::default() });
        assert!(key == "queue" && msg.starts_with("loss.queue = 2: the clip loss keeps no queue"), "{msg}");
        let (key, msg) = refused(ClipLoss { kind: LossKind::SiglipGather, tile: Some(4), ..Default::default() });
        assert!(key == "tile" && msg.contains("applies to kinds clip, clip_ring and siglip_ring, not siglip_gather"), "{msg}");
    }
}
