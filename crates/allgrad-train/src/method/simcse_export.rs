//! A SimCSE run's encoder as a Hugging Face folder: the run directory's `config.yaml` gives
//! the source model folder (architecture, tokenizer, sequence limit) and the pooling; its newest
//! checkpoint gives the trained weights (`bert.*`; the training head is left out).

use std::path::{Path, PathBuf};

use allgrad_models::bert::export_hf_folder;
use candle_core::Device;

use super::simcse::SimCseSections;
use crate::checkpoint::load_latest;
use crate::config::RunConfig;
use crate::error::{TrainError, TrainResult};

/// Writes the newest checkpoint of the SimCSE run in `run_dir` as a Hugging Face folder at
/// `out` (default `run_dir/hf`) and returns its path. Relative paths in the run's config
/// (the model folder) are taken from the current directory, as when the run trained.
pub fn export_run(run_dir: &Path, out: Option<&Path>) -> TrainResult<PathBuf> {
    let cfg_path = run_dir.join("config.yaml");
    let text = std::fs::read_to_string(&cfg_path).map_err(|source| TrainError::Io {
        action: "reading",
        path: cfg_path.clone(),
        source,
    })?;
    let cfg = RunConfig::parse(&text, &cfg_path, &[]).map_err(|e| TrainError::Setup(e.to_string()))?;
    if cfg.method != "simcse" {
        return Err(TrainError::Setup(format!("{}: method `{}`, not simcse", cfg_path.display(), cfg.method)));
    }
    let sections: SimCseSections = serde_yaml::from_value(serde_yaml::Value::Mapping(cfg.sections.clone()))
        .map_err(|e| TrainError::Setup(format!("{}: {e}", cfg_path.display())))?;
    let ck = load_latest(run_dir, &Device::Cpu)?
        .ok_or_else(|| TrainError::Setup(format!("{} has no checkpoint to export", run_dir.display())))?;
    let out = out.map(Path::to_path_buf).unwrap_or_else(|| run_dir.join("hf"));
    let m = &sections.model;
    export_hf_folder(&ck.model, "bert.", &m.dir, &out, m.pooling)?;
    Ok(out)
}
