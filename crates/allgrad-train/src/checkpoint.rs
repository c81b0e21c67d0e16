//! Checkpoints: `DIR/checkpoints/step_<N>/{model,optimizer}.safetensors` and `state.json`,
//! with `DIR/checkpoints/latest` naming the newest.
//!
//! Writes are atomic: everything goes to a temporary directory, each file and the directory
//! are fsynced, the directory is renamed into place, and only then is `latest` replaced (by
//! writing a temporary file and renaming it). A process killed at any point leaves `latest`
//! naming a complete checkpoint. Only the last `keep_last` checkpoints are kept.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

/// The `checkpoint` section.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    /// Save every this many steps (0: only at the end of the run).
    pub every: usize,
    /// How many checkpoints to keep.
    pub keep_last: usize,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig { every: 0, keep_last: 3 }
    }
}

/// Everything about the run's position that a resume needs, besides tensors.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TrainState {
    /// Optimizer steps completed.
    pub step: usize,
    /// Epoch of the next step.
    pub epoch: usize,
    /// Position of the next step within its epoch (the sampler's position).
    pub batch_in_epoch: usize,
    /// Optimizer updates applied (AdamW's bias correction).
    pub optimizer_steps: u64,
    /// The run's seed: every random stream is keyed by it and by (epoch, sample, step), so
    /// the seed is the whole random state.
    pub seed: u64,
    /// World size of the run that wrote the checkpoint.
    pub world_size: usize,
}

/// A loaded checkpoint.
pub struct Checkpoint {
    /// Model parameters by name.
    pub model: HashMap<String, Tensor>,
    /// Optimizer state by `<param>/<slot>`.
    pub optimizer: BTreeMap<String, Tensor>,
    /// Position and random state.
    pub state: TrainState,
    /// Where it was read from.
    pub path: PathBuf,
}

/// Test hook: ALLGRAD_FAULT=checkpoint:<stage> aborts the process at that stage of a save
/// (`model`, `optimizer`, `rename`), to prove that a crash never corrupts `latest`.
fn fault(stage: &str) {
    if std::env::var("ALLGRAD_FAULT").map(|v| v == format!("checkpoint:{stage}")).unwrap_or(false) {
        eprintln!("ALLGRAD_FAULT: aborting during checkpoint save at stage {stage}");
        std::process::abort();
    }
}

fn io(what: impl std::fmt::Display, e: std::io::Error) -> candle_core::Error {
    candle_core::Error::Msg(format!("{what}: {e}"))
}

fn fsync_file(p: &Path) -> candle_core::Result<()> {
    File::open(p).and_then(|f| f.sync_all()).map_err(|e| io(format!("fsync {}", p.display()), e))
}

fn fsync_dir(p: &Path) -> candle_core::Result<()> {
    File::open(p).and_then(|f| f.sync_all()).map_err(|e| io(format!("fsync directory {}", p.display()), e))
}

/// Writes a checkpoint of `step` under `run_dir/checkpoints` and prunes old ones.
pub fn save(
    run_dir: &Path,
    model: &HashMap<String, Tensor>,
    optimizer: &BTreeMap<String, Tensor>,
    state: &TrainState,
    keep_last: usize,
) -> candle_core::Result<PathBuf> {
    let root = run_dir.join("checkpoints");
    fs::create_dir_all(&root).map_err(|e| io(format!("creating {}", root.display()), e))?;
    let name = format!("step_{}", state.step);
    let tmp = root.join(format!(".{name}.tmp-{}", std::process::id()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| io(format!("removing {}", tmp.display()), e))?;
    }
    fs::create_dir(&tmp).map_err(|e| io(format!("creating {}", tmp.display()), e))?;

    let model_path = tmp.join("model.safetensors");
    candle_core::safetensors::save(model, &model_path)?;
    fsync_file(&model_path)?;
    fault("model");
    let opt_path = tmp.join("optimizer.safetensors");
    let opt: HashMap<String, Tensor> = optimizer.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    candle_core::safetensors::save(&opt, &opt_path)?;
    fsync_file(&opt_path)?;
    fault("optimizer");
    let state_path = tmp.join("state.json");
    let json = serde_json::to_vec_pretty(state).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    fs::write(&state_path, json).map_err(|e| io(format!("writing {}", state_path.display()), e))?;
    fsync_file(&state_path)?;
    fsync_dir(&tmp)?;
    fault("rename");

    let dest = root.join(&name);
    if dest.exists() {
        fs::remove_dir_all(&dest).map_err(|e| io(format!("replacing {}", dest.display()), e))?;
    }
    fs::rename(&tmp, &dest).map_err(|e| io(format!("renaming {} to {}", tmp.display(), dest.display()), e))?;
    fsync_dir(&root)?;
    let latest_tmp = root.join(format!(".latest.tmp-{}", std::process::id()));
    fs::write(&latest_tmp, format!("{name}\n")).map_err(|e| io(format!("writing {}", latest_tmp.display()), e))?;
    fsync_file(&latest_tmp)?;
    fs::rename(&latest_tmp, root.join("latest")).map_err(|e| io("updating checkpoints/latest", e))?;
    fsync_dir(&root)?;
    prune(&root, keep_last.max(1), &name);
    Ok(dest)
}

/// Removes all but the newest `keep` checkpoints (never `current`), and leftovers of
/// interrupted saves.
fn prune(root: &Path, keep: usize, current: &str) {
    let Ok(entries) = fs::read_dir(root) else { return };
    let mut steps = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') && name.contains(".tmp-") {
            let _ = if e.path().is_dir() { fs::remove_dir_all(e.path()) } else { fs::remove_file(e.path()) };
        } else if let Some(n) = name.strip_prefix("step_").and_then(|n| n.parse::<usize>().ok()) {
            steps.push((n, name));
        }
    }
    steps.sort();
    let excess = steps.len().saturating_sub(keep);
    for (_, name) in steps.into_iter().take(excess) {
        if name != current {
            let _ = fs::remove_dir_all(root.join(name));
        }
    }
}

/// Loads the checkpoint `latest` names, or `None` when the run has none.
pub fn load_latest(run_dir: &Path, device: &Device) -> candle_core::Result<Option<Checkpoint>> {
    let root = run_dir.join("checkpoints");
    let latest = root.join("latest");
    let name = match fs::read_to_string(&latest) {
        Ok(s) => s.trim().to_string(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io(format!("reading {}", latest.display()), e)),
    };
    if !name.starts_with("step_") || name.contains('/') {
        candle_core::bail!("{} names {name:?}, which is not a checkpoint directory", latest.display());
    }
    let dir = root.join(&name);
    let ctx = |what: &str| format!("checkpoint {} ({what})", dir.display());
    let model = candle_core::safetensors::load(dir.join("model.safetensors"), device)
        .map_err(|e| candle_core::Error::Msg(format!("{}: {e}", ctx("model.safetensors"))))?;
    let optimizer = candle_core::safetensors::load(dir.join("optimizer.safetensors"), device)
        .map_err(|e| candle_core::Error::Msg(format!("{}: {e}", ctx("optimizer.safetensors"))))?
        .into_iter()
        .collect();
    let raw = fs::read(dir.join("state.json")).map_err(|e| io(ctx("state.json"), e))?;
    let state: TrainState =
        serde_json::from_slice(&raw).map_err(|e| candle_core::Error::Msg(format!("{}: {e}", ctx("state.json"))))?;
    Ok(Some(Checkpoint { model, optimizer, state, path: dir }))
}
