//! A CLIP or SigLIP run's model as a Hugging Face folder that `transformers`' `CLIPModel` (or
//! `SiglipModel`) loads: the run directory's `config.yaml` gives the source folder
//! (architecture, tokenizer); its newest checkpoint gives the trained weights, `logit_bias`
//! included when the run learned one (a sigmoid loss).

use std::path::{Path, PathBuf};

use allgrad_models::clip::{export_clip_folder, image_processor, ClipFolder};

use super::clip::ClipSections;
use crate::error::TrainResult;

/// Writes the newest checkpoint of the CLIP run in `run_dir` as a Hugging Face folder at `out`
/// (default `run_dir/hf`) and returns its path.
pub fn export_run(run_dir: &Path, out: Option<&Path>) -> TrainResult<PathBuf> {
    let (sections, ck, out) = super::run_export::read_run::<ClipSections>(run_dir, out, "clip")?;
    let folder = ClipFolder::open(&sections.model.dir)?;
    let processor = image_processor(&sections.model, &folder)?;
    export_clip_folder(&ck.model, &sections.model.dir, &out, &processor)?;
    Ok(out)
}
