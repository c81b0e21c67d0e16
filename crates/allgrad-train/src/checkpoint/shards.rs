//! Sharded checkpoints: parameters split by rows across ranks (a class-sharded head).
//!
//! Every rank writes its rows, and their optimizer slots, into the SAME step directory:
//! `shard_<r>.safetensors` (keys `<param>` and `<param>/<slot>`) and `shard_<r>.json`
//! ([`ShardMeta`]: the world size and each parameter's global row range). Rank 0 writes the
//! replicated parts as in [`crate::checkpoint`]. The sequence: rank 0 creates the temporary
//! directory; barrier; every rank writes and fsyncs its shard; barrier; rank 0 writes the rest,
//! checks that all W shards are there, renames the directory and only then updates `latest`;
//! barrier. A rank killed at any point leaves `latest` naming the previous complete step.
//! The ranks must share the run directory's file system (one host, or a shared mount).
//!
//! On resume each rank reads the shards that overlap its own row range and cuts its rows out
//! of them, so a run written by W ranks resumes on any W' (the rows are re-sharded on load);
//! a parameter without a row range ([`allgrad_models::Objective::shard_rows`]) resumes only
//! at the same W.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::Path;

use allgrad_dist::ProcessGroup;
use allgrad_models::RowRange;
use candle_core::{Device, Tensor, Var};
use serde::{Deserialize, Serialize};

use super::{fsync, io_err, save_tensors, Checkpoint, Contents, Staged};
use crate::error::{TrainError, TrainResult};
use crate::settings::FaultStage;

/// What `shard_<r>.json` says.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ShardMeta {
    /// The rank that wrote it.
    pub rank: usize,
    /// The world size of the run that wrote it.
    pub world_size: usize,
    /// Each sharded parameter's global rows on that rank (None: not re-shardable).
    pub params: BTreeMap<String, Option<RowRange>>,
}

/// One rank's part of a checkpoint: its sharded parameters and their optimizer slots.
pub struct Shard<'a> {
    /// `<param>` and `<param>/<slot>` tensors.
    pub tensors: &'a HashMap<String, Tensor>,
    /// The metadata.
    pub meta: &'a ShardMeta,
}

/// Parameters and optimizer slots (`<param>/<slot>`), split by owner: the replicated
/// parameters and their slots (rank 0's `model` and `optimizer` files) and the sharded ones
/// with their slots (this rank's shard file).
pub type Split = (HashMap<String, Tensor>, BTreeMap<String, Tensor>, HashMap<String, Tensor>);

/// See [`Split`]; `sharded[i]` marks `params[i]`.
pub fn split(params: &[(String, Var)], sharded: &[bool], optimizer: &BTreeMap<String, Tensor>) -> Split {
    let (mut model, mut replicated_slots, mut shard) = (HashMap::new(), BTreeMap::new(), HashMap::new());
    let mut owner_sharded = HashMap::new();
    for ((n, v), sh) in params.iter().zip(sharded) {
        owner_sharded.insert(n.as_str(), *sh);
        if *sh { &mut shard } else { &mut model }.insert(n.clone(), v.as_tensor().clone());
    }
    for (k, t) in optimizer {
        let param = k.rsplit_once('/').map_or(k.as_str(), |(p, _)| p);
        if owner_sharded.get(param).copied().unwrap_or(false) {
            shard.insert(k.clone(), t.clone());
        } else {
            replicated_slots.insert(k.clone(), t.clone());
        }
    }
    (model, replicated_slots, shard)
}

/// Writes one step's checkpoint from every rank (see the module docs); `replicated` is what
/// rank 0 writes (its value on other ranks is not used).
pub fn save(
    pg: &ProcessGroup,
    run_dir: &Path,
    replicated: &Contents,
    shard: &Shard,
    keep_last: usize,
    fault_at: Option<FaultStage>,
) -> TrainResult<()> {
    let (rank, w) = (pg.rank(), pg.world_size());
    let suffix = "tmp-shards";
    let staged = if rank == 0 {
        Staged::begin(run_dir, replicated.state.step, suffix)?
    } else {
        Staged::paths(run_dir, replicated.state.step, suffix)
    };
    pg.barrier()?;
    save_tensors(&staged.tmp, &format!("shard_{rank}.safetensors"), shard.tensors.iter())?;
    let meta_path = staged.tmp.join(format!("shard_{rank}.json"));
    let json = serde_json::to_vec_pretty(shard.meta).map_err(|e| TrainError::checkpoint(&meta_path, "encoding", e))?;
    fs::write(&meta_path, json).map_err(io_err(&meta_path, "writing"))?;
    fsync(&meta_path)?;
    pg.barrier()?;
    let mut outcome = Ok(());
    if rank == 0 {
        outcome = (|| {
            staged.write(replicated, fault_at)?;
            for r in 0..w {
                for file in [format!("shard_{r}.safetensors"), format!("shard_{r}.json")] {
                    if !staged.tmp.join(&file).exists() {
                        return Err(TrainError::checkpoint(&staged.tmp, "collecting the shards", format!("{file} is missing")));
                    }
                }
            }
            staged.commit(keep_last).map(|_| ())
        })();
    }
    // Every rank returns after the step is committed (or rank 0 failed: its error is reported
    // there; the others go on with `latest` at the previous step).
    pg.barrier()?;
    outcome
}

/// Reads the shards of `ck` and puts this rank's rows of every parameter in `wants` (with
/// their optimizer slots) into `ck.model` and `ck.optimizer`. `wants` names each sharded
/// parameter with this rank's row range (None: only at the same world size `world`).
pub fn load_into(
    ck: &mut Checkpoint,
    wants: &[(String, Option<RowRange>)],
    rank: usize,
    world: usize,
    device: &Device,
) -> TrainResult<()> {
    if wants.is_empty() {
        return Ok(());
    }
    let saved_w = ck.state.world_size;
    let dir = ck.path.clone();
    let mismatch = |reason: String| TrainError::CheckpointMismatch { path: dir.clone(), reason };
    let mut metas = Vec::with_capacity(saved_w);
    for r in 0..saved_w {
        let path = dir.join(format!("shard_{r}.json"));
        let raw = fs::read(&path).map_err(io_err(&path, "reading"))?;
        let meta: ShardMeta = serde_json::from_slice(&raw).map_err(|e| TrainError::checkpoint(&path, "parsing", e))?;
        if meta.rank != r || meta.world_size != saved_w {
            return Err(mismatch(format!("shard_{r}.json says rank {} of {}", meta.rank, meta.world_size)));
        }
        metas.push(meta);
    }
    let mut files: HashMap<usize, HashMap<String, Tensor>> = HashMap::new();
    let mut load = |r: usize| -> TrainResult<HashMap<String, Tensor>> {
        if let Some(f) = files.get(&r) {
            return Ok(f.clone());
        }
        let path = dir.join(format!("shard_{r}.safetensors"));
        let f = candle_core::safetensors::load(&path, device).map_err(|e| TrainError::checkpoint(&path, "reading", e))?;
        files.insert(r, f.clone());
        Ok(f)
    };
    for (name, want) in wants {
        // (saved rank, first row there, rows) of each piece, in row order.
        let pieces: Vec<(usize, usize, usize)> = match want {
            None if saved_w == world => vec![(rank, 0, usize::MAX)],
            None => {
                return Err(mismatch(format!(
                "it was written by {saved_w} ranks and {name} has no row range: it resumes only on {saved_w} ranks, not {world}"
            )))
            }
            Some(want) => {
                let mut pieces = Vec::new();
                for (r, meta) in metas.iter().enumerate() {
                    let have = meta.params.get(name).ok_or_else(|| mismatch(format!("shard_{r} has no parameter {name}")))?;
                    let Some(have) = have else {
                        return Err(mismatch(format!("{name} was saved without a row range and cannot be re-sharded")));
                    };
                    if have.total != want.total {
                        return Err(mismatch(format!(
                            "{name} has {} rows over all shards there and {} in this run: the run's config must give it \
                             the checkpoint's size (head.num_classes = {} for a face head's centres)",
                            have.total, want.total, have.total
                        )));
                    }
                    let (lo, hi) = (want.start.max(have.start), want.end().min(have.end()));
                    if lo < hi {
                        pieces.push((r, lo - have.start, hi - lo));
                    }
                }
                let covered: usize = pieces.iter().map(|p| p.2).sum();
                if covered != want.len {
                    return Err(mismatch(format!("the shards hold {covered} of the {} rows {name} needs here", want.len)));
                }
                pieces
            }
        };
        let prefix = format!("{name}/");
        let mut parts: BTreeMap<String, Vec<Tensor>> = BTreeMap::new();
        for (r, first, rows) in pieces {
            let file = load(r)?;
            for (key, t) in file.iter().filter(|(k, _)| *k == name || k.starts_with(&prefix)) {
                let rows = rows.min(t.dim(0)?);
                parts.entry(key.clone()).or_default().push(t.narrow(0, first, rows)?);
            }
        }
        if !parts.contains_key(name) {
            return Err(mismatch(format!("no shard holds parameter {name}")));
        }
        for (key, ts) in parts {
            let t = Tensor::cat(&ts, 0)?;
            if key == *name {
                ck.model.insert(key, t);
            } else {
                ck.optimizer.insert(key, t);
            }
        }
    }
    Ok(())
}
