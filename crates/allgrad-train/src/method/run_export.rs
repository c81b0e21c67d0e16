//! What every `export-hf` of a run reads first: the run directory's `config.yaml` (checked to
//! be of the method being exported, its sections parsed as that method's), its newest
//! checkpoint, and the output folder (default `run_dir/hf`).

use std::path::{Path, PathBuf};

use candle_core::Device;
use serde::de::DeserializeOwned;

use crate::checkpoint::{load_latest, Checkpoint};
use crate::config::RunConfig;
use crate::error::{TrainError, TrainResult};

/// The sections of the `method` run in `run_dir`, its newest checkpoint (on the CPU) and the
/// folder to write: `out`, else `run_dir/hf`.
pub(crate) fn read_run<S: DeserializeOwned>(
    run_dir: &Path,
    out: Option<&Path>,
    method: &str,
) -> TrainResult<(S, Checkpoint, PathBuf)> {
    let cfg_path = run_dir.join("config.yaml");
    let text = std::fs::read_to_string(&cfg_path).map_err(|source| TrainError::Io {
        action: "reading",
        path: cfg_path.clone(),
        source,
    })?;
    let cfg = RunConfig::parse(&text, &cfg_path, &[]).map_err(|e| TrainError::Setup(e.to_string()))?;
    if cfg.method != method {
        return Err(TrainError::Setup(format!("{}: method `{}`, not {method}", cfg_path.display(), cfg.method)));
    }
    let sections: S = serde_yaml::from_value(serde_yaml::Value::Mapping(cfg.sections().clone()))
        .map_err(|e| TrainError::Setup(format!("{}: {e}", cfg_path.display())))?;
    let ck = load_latest(run_dir, &Device::Cpu)?
        .ok_or_else(|| TrainError::Setup(format!("{} has no checkpoint to export", run_dir.display())))?;
    let out = out.map(Path::to_path_buf).unwrap_or_else(|| run_dir.join("hf"));
    Ok((sections, ck, out))
}
