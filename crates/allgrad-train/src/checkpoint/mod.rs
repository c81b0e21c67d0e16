//! Checkpoints: `DIR/checkpoints/step_<N>/{model,optimizer,buffers}.safetensors` and
//! `state.json`, with `DIR/checkpoints/latest` naming the newest; and [`restore`], which puts
//! a loaded checkpoint back into a run.
//!
//! `stream.json` (when the data is a stream of `webdataset` shards) holds the stream's position:
//! every stream's counters, shard, byte offset and shuffle buffer as (shard, offset) pairs
//! ([`allgrad_data::webdataset::StreamState`]), gathered from every rank and written by rank 0,
//! so that a resume on any number of ranks seeks there instead of reading the epoch again.
//!
//! `buffers.safetensors` holds the objective's non-trainable state
//! ([`allgrad_models::Objective::buffers`]: batch-norm running statistics). Rank 0 writes
//! it. With SyncBatchNorm the running statistics are identical on every rank by construction
//! (they are updated from the global batch statistics), so rank 0's are everyone's; with plain
//! per-rank BatchNorm they are rank 0's own (statistics of its slices of the batches), which
//! every rank loads on resume; evaluation runs on rank 0, so its figures resume exactly.
//!
//! With sharded parameters (a class-sharded head), every rank also writes its shard into the
//! same step directory ([`shards`]: `shard_<r>.safetensors` with the parameters'
//! rows and their optimizer slots, `shard_<r>.json` with the global row ranges), and
//! `model.safetensors` / `optimizer.safetensors` hold the replicated parameters only.
//!
//! Writes are atomic: everything goes to a temporary directory, each file and the directory
//! are fsynced, the directory is renamed into place, and only then is `latest` replaced (by
//! writing a temporary file and renaming it). A process killed at any point leaves `latest`
//! naming a complete checkpoint. Only the last `keep_last` checkpoints are kept.

pub mod shards;

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::path::{Path, PathBuf};

use allgrad_data::webdataset::StreamState;
use allgrad_models::Objective;
use candle_core::{DType, Device, Tensor, Var};
use serde::{Deserialize, Serialize};

pub use crate::config::CheckpointConfig;
use crate::error::{TrainError, TrainResult};
use crate::optim::Optimizer;
use crate::settings::FaultStage;

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
    /// The objective's buffers by name (empty when the checkpoint has none).
    pub buffers: HashMap<String, Tensor>,
    /// Position and random state.
    pub state: TrainState,
    /// The training stream's position (`stream.json`), when the run read a stream.
    pub stream: Option<StreamState>,
    /// Where it was read from.
    pub path: PathBuf,
}

/// Test hook (`ALLGRAD_FAULT=checkpoint:<stage>`, see [`crate::settings`]): aborts the
/// process at that stage of a save, to prove that a crash never corrupts `latest`.
fn fault(armed: Option<FaultStage>, stage: FaultStage) {
    if armed == Some(stage) {
        eprintln!("ALLGRAD_FAULT: aborting during checkpoint save at stage {}", stage.name());
        std::process::abort();
    }
}

pub(crate) fn io_err<'a>(path: &'a Path, action: &str) -> impl FnOnce(std::io::Error) -> TrainError + 'a {
    let action = action.to_string();
    move |e| TrainError::checkpoint(path, action, e)
}

pub(crate) fn fsync(p: &Path) -> TrainResult<()> {
    File::open(p).and_then(|f| f.sync_all()).map_err(io_err(p, "fsync"))
}

pub(crate) fn save_tensors<'a>(
    dir: &Path,
    file: &str,
    tensors: impl Iterator<Item = (&'a String, &'a Tensor)>,
) -> TrainResult<()> {
    let path = dir.join(file);
    let map: HashMap<String, Tensor> = tensors.map(|(k, v)| (k.clone(), v.clone())).collect();
    allgrad_models::save_safetensors(&map, &path).map_err(|e| TrainError::checkpoint(&path, format!("writing {file}"), e))?;
    fsync(&path)
}

/// What one checkpoint holds.
pub struct Contents<'a> {
    /// Parameters by name.
    pub model: &'a HashMap<String, Tensor>,
    /// Optimizer state by `<param>/<slot>`.
    pub optimizer: &'a BTreeMap<String, Tensor>,
    /// The objective's buffers by name.
    pub buffers: &'a [(String, Tensor)],
    /// Position and random state.
    pub state: &'a TrainState,
    /// The training stream's position, every rank's streams (a stream's runs only).
    pub stream: Option<&'a StreamState>,
}

/// Writes a checkpoint of `state.step` under `run_dir/checkpoints` and prunes old ones;
/// `fault` is the test hook of [`crate::settings::Settings`].
pub fn save(run_dir: &Path, c: &Contents, keep_last: usize, fault_at: Option<FaultStage>) -> TrainResult<PathBuf> {
    let staged = Staged::begin(run_dir, c.state.step, &format!("tmp-{}", std::process::id()))?;
    staged.write(c, fault_at)?;
    staged.commit(keep_last)
}

/// A checkpoint being written: `root/.step_<N>.<suffix>`, renamed to `root/step_<N>` by
/// [`Staged::commit`].
pub(crate) struct Staged {
    pub(crate) root: PathBuf,
    pub(crate) name: String,
    pub(crate) tmp: PathBuf,
}

impl Staged {
    /// The paths of step `step`'s temporary directory (nothing is created).
    pub(crate) fn paths(run_dir: &Path, step: usize, suffix: &str) -> Staged {
        let root = run_dir.join("checkpoints");
        let name = format!("step_{step}");
        let tmp = root.join(format!(".{name}.{suffix}"));
        Staged { root, name, tmp }
    }

    /// Creates the (empty) temporary directory, removing a leftover of an interrupted save.
    pub(crate) fn begin(run_dir: &Path, step: usize, suffix: &str) -> TrainResult<Staged> {
        let s = Staged::paths(run_dir, step, suffix);
        fs::create_dir_all(&s.root).map_err(io_err(&s.root, "creating the directory"))?;
        if s.tmp.exists() {
            fs::remove_dir_all(&s.tmp).map_err(io_err(&s.tmp, "removing a leftover"))?;
        }
        fs::create_dir(&s.tmp).map_err(io_err(&s.tmp, "creating the directory"))?;
        Ok(s)
    }

    /// Writes the model, optimizer state, buffers and `state.json`.
    pub(crate) fn write(&self, c: &Contents, fault_at: Option<FaultStage>) -> TrainResult<()> {
        let tmp = &self.tmp;
        save_tensors(tmp, "model.safetensors", c.model.iter())?;
        fault(fault_at, FaultStage::Model);
        save_tensors(tmp, "optimizer.safetensors", c.optimizer.iter())?;
        fault(fault_at, FaultStage::Optimizer);
        if !c.buffers.is_empty() {
            save_tensors(tmp, "buffers.safetensors", c.buffers.iter().map(|(k, v)| (k, v)))?;
        }
        fault(fault_at, FaultStage::Buffers);
        let state_path = tmp.join("state.json");
        let json = serde_json::to_vec_pretty(c.state).map_err(|e| TrainError::checkpoint(&state_path, "encoding", e))?;
        fs::write(&state_path, json).map_err(io_err(&state_path, "writing"))?;
        fsync(&state_path)?;
        if let Some(stream) = c.stream {
            let path = tmp.join("stream.json");
            let json = serde_json::to_vec(stream).map_err(|e| TrainError::checkpoint(&path, "encoding", e))?;
            fs::write(&path, json).map_err(io_err(&path, "writing"))?;
            fsync(&path)?;
        }
        fsync(tmp)?;
        fault(fault_at, FaultStage::Rename);
        Ok(())
    }

    /// Renames the directory into place, points `latest` at it and prunes old checkpoints.
    pub(crate) fn commit(&self, keep_last: usize) -> TrainResult<PathBuf> {
        let (root, name) = (&self.root, &self.name);
        let dest = root.join(name);
        if dest.exists() {
            fs::remove_dir_all(&dest).map_err(io_err(&dest, "replacing"))?;
        }
        fs::rename(&self.tmp, &dest).map_err(io_err(&dest, "renaming the temporary directory"))?;
        fsync(root)?;
        let latest_tmp = root.join(format!(".latest.tmp-{}", std::process::id()));
        fs::write(&latest_tmp, format!("{name}\n")).map_err(io_err(&latest_tmp, "writing"))?;
        fsync(&latest_tmp)?;
        fs::rename(&latest_tmp, root.join("latest")).map_err(io_err(root, "updating latest"))?;
        fsync(root)?;
        prune(root, keep_last.max(1), name);
        Ok(dest)
    }
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
pub fn load_latest(run_dir: &Path, device: &Device) -> TrainResult<Option<Checkpoint>> {
    let root = run_dir.join("checkpoints");
    let latest = root.join("latest");
    let name = match fs::read_to_string(&latest) {
        Ok(s) => s.trim().to_string(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(TrainError::checkpoint(&latest, "reading", e)),
    };
    if !name.starts_with("step_") || name.contains('/') {
        return Err(TrainError::checkpoint(
            &latest,
            "reading",
            format!("it names {name:?}, which is not a checkpoint directory"),
        ));
    }
    let dir = root.join(&name);
    let load = |file: &str| {
        let path = dir.join(file);
        candle_core::safetensors::load(&path, device).map_err(|e| TrainError::checkpoint(&path, format!("reading {file}"), e))
    };
    let model = load("model.safetensors")?;
    let optimizer = load("optimizer.safetensors")?.into_iter().collect();
    let buffers = if dir.join("buffers.safetensors").exists() { load("buffers.safetensors")? } else { HashMap::new() };
    let state_path = dir.join("state.json");
    let raw = fs::read(&state_path).map_err(io_err(&state_path, "reading"))?;
    let state: TrainState = serde_json::from_slice(&raw).map_err(|e| TrainError::checkpoint(&state_path, "parsing", e))?;
    let stream_path = dir.join("stream.json");
    let stream = match fs::read(&stream_path) {
        Ok(raw) => Some(serde_json::from_slice(&raw).map_err(|e| TrainError::checkpoint(&stream_path, "parsing", e))?),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(TrainError::checkpoint(&stream_path, "reading", e)),
    };
    Ok(Some(Checkpoint { model, optimizer, buffers, state, stream, path: dir }))
}

/// Where a run is put back: its parameters, which of them are sharded, its optimizer and
/// objective, and what the checkpoint must agree with.
pub struct RestoreTarget<'a> {
    /// Parameters by name.
    pub params: &'a [(String, Var)],
    /// Whether each parameter is sharded.
    pub sharded: &'a [bool],
    /// The optimizer, which gets the saved state.
    pub optimizer: &'a mut Optimizer,
    /// The objective, which gets the saved buffers.
    pub objective: &'a mut dyn Objective,
    /// This run's world size.
    pub world_size: usize,
    /// This run's seed.
    pub seed: u64,
    /// This run's parameter precision.
    pub dtype: DType,
}

/// Puts `ck` back into `to` and returns the step to continue from. Every parameter must be in
/// the checkpoint with its shape; the seed must match (it is the run's whole random state).
pub fn restore(ck: Checkpoint, to: RestoreTarget) -> TrainResult<usize> {
    let mismatch = |reason: String| TrainError::CheckpointMismatch { path: ck.path.clone(), reason };
    // Sharded parameters were put into `ck.model` for this rank's rows by
    // `shards::load_into` (which refuses a world-size change it cannot re-shard);
    // their shapes are checked below like every other parameter's.
    if ck.state.seed != to.seed {
        return Err(mismatch(format!(
            "it was written with seed {}, the config says {} (set seed: {} to resume it)",
            ck.state.seed, to.seed, ck.state.seed
        )));
    }
    for (name, v) in to.params {
        let t = ck.model.get(name).ok_or_else(|| mismatch(format!("it has no parameter {name}: was the model changed?")))?;
        if t.dims() != v.dims() {
            return Err(mismatch(format!("parameter {name} has shape {:?} there, {:?} in the model", t.dims(), v.dims())));
        }
        // bf16 storage (face centres, `head.storage: bf16`) keeps its optimizer state in bf16
        // too: a checkpoint resumes only with the storage it was written with.
        if (t.dtype() == DType::BF16) != (v.dtype() == DType::BF16) {
            return Err(mismatch(format!(
                "parameter {name} is stored in {:?} there and in {:?} in this run (for a face head's centres, \
                 head.storage must be the one the checkpoint was written with)",
                t.dtype(),
                v.dtype()
            )));
        }
        // In the parameter's own dtype (the run's, or bf16 face centres).
        v.set(&t.to_dtype(v.dtype())?)?;
    }
    to.objective.load_buffers(&ck.buffers).map_err(|e| mismatch(format!("its buffers do not fit the model: {e}")))?;
    to.optimizer.load_state(ck.optimizer, ck.state.optimizer_steps);
    Ok(ck.state.step)
}
