//! A CLIP run's model as a Hugging Face folder that `transformers`' `CLIPModel` loads: the
//! run directory's `config.yaml` gives the source folder (architecture, tokenizer); its newest
//! checkpoint gives the trained weights (SigLIP's `logit_bias` is not part of `CLIPModel` and
//! is left out).

use std::path::{Path, PathBuf};

use allgrad_models::clip::export_clip_folder;
use candle_core::Device;

use super::clip::ClipSections;
use crate::checkpoint::load_latest;
use crate::config::RunConfig;
use crate::error::{TrainError, TrainResult};

/// Writes the newest checkpoint of the CLIP run in `run_dir` as a Hugging Face folder at `out`
/// (default `run_dir/hf`) and returns its path.
pub fn export_run(run_dir: &Path, out: Option<&Path>) -> TrainResult<PathBuf> {
    let cfg_path = run_dir.join("config.yaml");
    let text = std::fs::read_to_string(&cfg_path).map_err(|source| TrainError::Io {
        action: "reading",
        path: cfg_path.clone(),
        source,
    })?;
    let cfg = RunConfig::parse(&text, &cfg_path, &[]).map_err(|e| TrainError::Setup(e.to_string()))?;
    if cfg.method != "clip" {
        return Err(TrainError::Setup(format!("{}: method `{}`, not clip", cfg_path.display(), cfg.method)));
    }
    let sections: ClipSections = serde_yaml::from_value(serde_yaml::Value::Mapping(cfg.sections.clone()))
        .map_err(|e| TrainError::Setup(format!("{}: {e}", cfg_path.display())))?;
    let ck = load_latest(run_dir, &Device::Cpu)?
        .ok_or_else(|| TrainError::Setup(format!("{} has no checkpoint to export", run_dir.display())))?;
    let out = out.map(Path::to_path_buf).unwrap_or_else(|| run_dir.join("hf"));
    export_clip_folder(&ck.model, &sections.model.dir, &out)?;
    Ok(out)
}
