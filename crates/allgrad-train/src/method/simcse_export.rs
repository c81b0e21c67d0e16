//! A SimCSE run's encoder as a Hugging Face folder: the run directory's `config.yaml` gives
//! the source model folder (architecture, tokenizer, sequence limit) and the pooling; its newest
//! checkpoint gives the trained weights (`bert.*`; the training head is left out).

use std::path::{Path, PathBuf};

use allgrad_models::bert::export_hf_folder;

use super::simcse::SimCseSections;
use crate::error::TrainResult;

/// Writes the newest checkpoint of the SimCSE run in `run_dir` as a Hugging Face folder at
/// `out` (default `run_dir/hf`) and returns its path. Relative paths in the run's config
/// (the model folder) are taken from the current directory, as when the run trained.
pub fn export_run(run_dir: &Path, out: Option<&Path>) -> TrainResult<PathBuf> {
    let (sections, ck, out) = super::run_export::read_run::<SimCseSections>(run_dir, out, "simcse")?;
    let m = &sections.model;
    export_hf_folder(&ck.model, "bert.", &m.dir, &out, m.pooling)?;
    Ok(out)
}
