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

use allgrad_models::clip::{Clip, ClipConfig, ClipData, ClipEval, ClipLoss, ClipModelSection};
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
        &["data.csv", "data.images", "model.dir", "eval.images"]
    }

    fn validate(&self, s: &ClipSections, run: &RunConfig, _world_size: usize) -> Result<(), SectionError> {
        let d = &s.data;
        match (&d.csv, &d.images) {
            (Some(csv), None) => need_file("data.csv", csv, "a CSV of image,caption")?,
            (None, Some(dir)) => {
                need_file("data.images", &dir.join("train-images-idx3-ubyte.gz"), "an IDX folder")?;
                if d.classes.is_empty() || d.classes.iter().any(|c| c.is_empty()) {
                    return Err(SectionError::new(
                        "data.classes",
                        "each class needs a list of names (its name first, then synonyms)",
                    ));
                }
                if d.templates.is_empty() {
                    return Err(SectionError::new("data.templates", "needs at least one template"));
                }
                if let Some(t) = d.templates.iter().find(|t| t.matches("{}").count() != 1) {
                    return Err(SectionError::new(
                        "data.templates",
                        format!("{t:?} must hold exactly one {{}} (the class name)"),
                    ));
                }
            }
            (Some(_), Some(_)) => return Err(SectionError::new("data", "give `csv` or `images`, not both")),
            (None, None) => {
                return Err(SectionError::new(
                    "data",
                    "needs `csv` (pairs) or `images` (an IDX folder captioned from class names)",
                ))
            }
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
        let c = cfg.vision_config.num_channels;
        for (key, v) in [("model.mean", &m.mean), ("model.std", &m.std)] {
            if let Some(v) = v {
                if v.len() != c {
                    return Err(SectionError::new(key, format!("needs {c} entries (the tower's channels), got {}", v.len())));
                }
            }
        }
        if m.std.as_ref().is_some_and(|v| v.iter().any(|s| !(s.is_finite() && *s > 0.0))) {
            return Err(SectionError::new("model.std", "every entry must be positive"));
        }
        let l = &s.loss;
        l.tiling().map_err(|e| SectionError::from_model(e, "loss"))?;
        for (key, v) in [("loss.siglip_scale_init", l.siglip_scale_init), ("loss.siglip_bias_init", l.siglip_bias_init)] {
            if !v.is_finite() {
                return Err(SectionError::new(key, format!("must be finite, got {v}")));
            }
        }
        if let Some(e) = &s.eval {
            match &e.images {
                Some(dir) if !dir.is_dir() => {
                    return Err(SectionError::new(
                        "eval.images",
                        format!("{} is not a folder (an image folder: one sub-folder per class)", dir.display()),
                    ))
                }
                Some(_) => {}
                None if d.images.is_none() => {
                    return Err(SectionError::new(
                        "eval",
                        "needs eval.images (an image folder) or data.images (its test split and class names)",
                    ))
                }
                None => {
                    if !e.classes.is_empty() {
                        return Err(SectionError::new(
                            "eval.classes",
                            "applies to eval.images only (data.classes names the IDX classes)",
                        ));
                    }
                }
            }
            if e.classes.iter().any(|c| c.is_empty()) {
                return Err(SectionError::new("eval.classes", "each class needs a list of names (its name first)"));
            }
            if e.templates.is_empty() {
                return Err(SectionError::new("eval.templates", "needs at least one template"));
            }
            if let Some(t) = e.templates.iter().find(|t| t.matches("{}").count() != 1) {
                return Err(SectionError::new("eval.templates", format!("{t:?} must hold exactly one {{}}")));
            }
            if e.batch == 0 {
                return Err(SectionError::new("eval.batch", "must be at least 1"));
            }
        }
        Ok(())
    }

    fn objective(&self, s: ClipSections, run: &RunConfig, device: &Device) -> candle_core::Result<Box<dyn Objective>> {
        let mut objective = Clip::new(&s.model, s.loss, &s.data, run.seed, device.clone())?;
        if let Some(e) = &s.eval {
            objective = objective.with_evaluation(&s.data, e)?;
        }
        Ok(Box::new(objective))
    }
}
