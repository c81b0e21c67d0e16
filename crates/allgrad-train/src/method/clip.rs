//! `clip`: [`Clip`], CLIP or SigLIP (`loss.kind`) on image-caption pairs, a Vision
//! Transformer and a causal text transformer trained with one loss over the global batch.
//!
//! ```yaml
//! method: clip
//! data: { images: data/fashion-mnist, classes: [[t-shirt, tee], ...], templates: ["a photo of a {}."] }  # or csv: pairs.csv
//! model: { dir: data/clip-tiny, pretrained: false }   # a Hugging Face CLIP folder
//! loss: { kind: clip }                 # tile: T | kind: clip_ring (tile: T) | siglip_gather | siglip_ring (tile: T)
//! eval: { templates: ["a picture of a {}"], zero_shot: 1000, retrieval: 200 }
//! ```

use std::path::Path;

use allgrad_data::webdataset::{CaptionField, WebDatasetOptions};
use allgrad_data::DataError;
use allgrad_models::clip::{
    has_idx_test_split, image_processor, ClassCaptions, Clip, ClipConfig, ClipData, ClipEval, ClipFolder, ClipLoss,
    ClipModelSection,
};
use allgrad_models::Objective;
use candle_core::Device;
use serde::{Deserialize, Serialize};

use super::{Method, SectionError};
use crate::config::RunConfig;

/// The sections of `clip`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ClipSections {
    /// The image-caption pairs.
    pub data: ClipData,
    /// The two towers (a Hugging Face CLIP folder).
    pub model: ClipModelSection,
    /// The loss (default: CLIP's).
    #[serde(default)]
    pub loss: ClipLoss,
    /// Zero-shot classification and retrieval before training and after every epoch
    /// (default: none).
    #[serde(default)]
    pub eval: Option<ClipEval>,
}

fn need_file(key: &str, path: &Path, what: &str) -> Result<(), SectionError> {
    if path.is_file() {
        return Ok(());
    }
    Err(SectionError::new(key, format!("{} does not exist ({what})", path.display())))
}

/// `clip`; see the module docs.
pub struct ClipMethod;

impl Method for ClipMethod {
    type Sections = ClipSections;

    fn path_keys(&self) -> &'static [&'static str] {
        &["data.csv", "data.images", "data.shards", "eval.images", "model.dir"]
    }

    /// The one validation of the sections: the objective relies on it and checks nothing
    /// again (the image preprocessing is checked by building it, as the objective does).
    fn validate(&self, s: &ClipSections, run: &RunConfig, world_size: usize) -> Result<(), SectionError> {
        let d = &s.data;
        let class_captions = |key: &str| {
            ClassCaptions::check(&d.classes, &d.templates)
                .map_err(|(which, msg)| SectionError::new(format!("{key}.{which}"), msg))
        };
        match (&d.csv, &d.images, &d.shards) {
            (Some(csv), None, None) => need_file("data.csv", csv, "a CSV of image,caption")?,
            (None, Some(dir), None) => {
                need_file("data.images", &dir.join("train-images-idx3-ubyte.gz"), "an IDX folder")?;
                class_captions("data")?;
            }
            (None, None, Some(dir)) => {
                d.webdataset.validate(run.train.global_batch, world_size).map_err(|e| match e {
                    DataError::Config { field, reason } => SectionError::new(format!("data.{field}"), reason),
                    e => SectionError::new("data.webdataset", e.to_string()),
                })?;
                let shards = d.webdataset.train_shards(dir).map_err(|e| SectionError::new("data.webdataset.train", e.to_string()))?;
                if let Some(missing) = shards.iter().find(|p| !p.is_file()) {
                    return Err(SectionError::new("data.webdataset.train", format!("shard {} does not exist", missing.display())));
                }
            }
            (None, None, None) => {
                return Err(SectionError::new(
                    "data",
                    "needs `csv` (pairs), `images` (an IDX folder captioned from class names) or `shards` (webdataset shards of pairs)",
                ))
            }
            _ => return Err(SectionError::new("data", "give one of `csv`, `images` and `shards`")),
        }
        if d.shards.is_none() && (d.webdataset != WebDatasetOptions::default() || d.caption != CaptionField::default()) {
            return Err(SectionError::new("data.webdataset", "webdataset and caption apply to `shards` only"));
        }
        if let Some(limit) = d.limit {
            if limit < run.train.global_batch {
                return Err(SectionError::new(
                    "data.limit",
                    format!("data.limit = {limit} is smaller than train.global_batch = {}", run.train.global_batch),
                ));
            }
        }
        let m = &s.model;
        need_file("model.dir", &m.dir.join("config.json"), "a Hugging Face CLIP folder has config.json")?;
        need_file("model.dir", &m.dir.join("tokenizer.json"), "a Hugging Face CLIP folder has tokenizer.json")?;
        if m.pretrained {
            need_file("model.dir", &m.dir.join("model.safetensors"), "pretrained weights; or set model.pretrained: false")?;
        }
        let cfg = ClipConfig::from_file(&m.dir.join("config.json")).map_err(|e| SectionError::new("model.dir", e.to_string()))?;
        let ctx = cfg.text_config.max_position_embeddings;
        if let Some(n) = m.max_len {
            if !(2..=ctx).contains(&n) {
                return Err(SectionError::new(
                    "model.max_len",
                    format!("must be between 2 and the context length {ctx}, got {n}"),
                ));
            }
        }
        // The preprocessing the objective will run: the folder's preprocessor_config.json (an
        // unknown resample filter named), the mean and std against the tower's channels.
        let folder = ClipFolder { dir: m.dir.clone(), config: cfg };
        let processor = image_processor(m, &folder).map_err(|e| SectionError::new("model.dir", e.to_string()))?;
        let key = if m.mean.is_some() || m.std.is_some() { "model.mean" } else { "model.dir" };
        processor.pipeline(folder.config.vision_config.num_channels, d.random_crop).map_err(|e| {
            SectionError::new(if e.to_string().contains("crop") { "data.random_crop" } else { key }, e.to_string())
        })?;
        let l = &s.loss;
        l.tiling().map_err(|e| SectionError::from_model(e, "loss"))?;
        for (key, v) in [("loss.siglip_scale_init", l.siglip_scale_init), ("loss.siglip_bias_init", l.siglip_bias_init)] {
            if !v.is_finite() {
                return Err(SectionError::new(key, format!("must be finite, got {v}")));
            }
        }
        if let Some(e) = &s.eval {
            // eval.images: an IDX folder (its test split) or an image folder (one sub-folder per
            // class); without it, data.images' test split. eval.classes names the classes of
            // either (else data.classes for an IDX split, the sub-folders' names for a folder).
            let idx =
                match (&e.images, &d.images) {
                    (Some(dir), _) if !dir.is_dir() => {
                        return Err(SectionError::new(
                            "eval.images",
                            format!(
                            "{} is not a folder (an IDX folder with a test split, or an image folder: one sub-folder per class)",
                            dir.display()
                        ),
                        ))
                    }
                    (Some(dir), _) => has_idx_test_split(dir),
                    (None, Some(dir)) if !has_idx_test_split(dir) => {
                        return Err(SectionError::new(
                            "data.images",
                            format!("{} has no t10k-images-idx3-ubyte(.gz) (the test split evaluated)", dir.display()),
                        ))
                    }
                    (None, Some(_)) => true,
                    (None, None) => return Err(SectionError::new(
                        "eval",
                        "needs eval.images (an IDX folder or an image folder) or data.images (its test split and class names)",
                    )),
                };
            let classes = if e.classes.is_empty() && idx { &d.classes } else { &e.classes };
            if idx || !e.classes.is_empty() {
                ClassCaptions::check(classes, &e.templates).map_err(|(which, msg)| {
                    let key = match (which, e.classes.is_empty()) {
                        ("templates", _) => "eval.templates",
                        (_, true) => "data.classes",
                        (_, false) => "eval.classes",
                    };
                    SectionError::new(key, msg)
                })?;
            } else {
                ClassCaptions::check(&[vec!["class".to_string()]], &e.templates)
                    .map_err(|(_, msg)| SectionError::new("eval.templates", msg))?;
            }
            if e.batch == 0 {
                return Err(SectionError::new("eval.batch", "must be at least 1"));
            }
        }
        Ok(())
    }

    fn objective(&self, s: ClipSections, run: &RunConfig, device: &Device) -> candle_core::Result<Box<dyn Objective>> {
        let mut objective = Clip::new(&s.model, s.loss, &s.data, run.seed, run.train.global_batch, device.clone())?;
        if let Some(e) = &s.eval {
            objective = objective.with_evaluation(&s.data, e)?;
        }
        Ok(Box::new(objective))
    }
}
