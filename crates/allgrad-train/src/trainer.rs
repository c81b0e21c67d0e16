//! The training loop.
//!
//! One step on rank r: take its slice of the global batch, compute its loss `L_r` (in
//! `accumulate` micro-batches), backpropagate `L_r / (W * accumulate)`, sum replicated
//! gradients across ranks, check for non-finite values, clip, and apply the optimizer.
//! With the sum-rule collectives inside the loss, this makes a run on W ranks equal a run
//! on one rank at the same global batch (docs/gradient-convention.md; ARCHITECTURE.md, "Why W ranks equal one").
//!
//! On a device (and on the CPU with `ALLGRAD_DEVICE_PATH=1`, [`allgrad_nn::transfer`]) the step
//! never waits for the device before the optimizer's launches: the loss is accumulated and
//! averaged over ranks as a tensor, the gradient norm, clipping and the non-finite check
//! (a "found-inf" flag, as PyTorch's GradScaler keeps) are tensor ops, the optimizer skips its
//! update where the flag says so, and the host reads the loss and the norm in ONE batched read
//! after the update's launches. (A row-sparse or row-masked update cannot be skipped on the
//! device: there the flag is read before it.) The regions of every step are timed and their
//! host traffic counted ([`crate::profile`]).

use std::path::{Path, PathBuf};
use std::time::Instant;

use allgrad_data::webdataset::StreamState;
use allgrad_data::DistributedSampler;
use allgrad_dist::{ProcessGroup, ReduceOp};
use allgrad_models::{Batch, Objective};
use candle_core::{DType, Device, Result, Tensor, Var};

use crate::checkpoint::{self, shards, Contents, RestoreTarget, TrainState};
use crate::config::{CheckpointConfig, ComputePrecision, LogConfig, NonFinite, OptimConfig, ScheduleConfig, TrainSection};
use crate::ddp::{sync_gradients, DEFAULT_BUCKET_BYTES};
use crate::error::{TrainError, TrainResult};
use crate::metrics::{plot, MetricsLog, ProgressView, Record, StepTraffic};
use crate::optim::{Optimizer, RowUpdate};
use crate::params::ParamStore;
use crate::profile::{StepProfile, StepProfiler};
use crate::settings::Settings;
use crate::step_grads::StepGrads;
use crate::tensorboard::EventsWriter;

/// The objective's buffers by name, as kept before a step that may be skipped.
type Buffers = std::collections::HashMap<String, Tensor>;

/// What the trainer needs besides the objective.
#[derive(Clone, Debug)]
pub struct TrainerConfig {
    /// Seed of every random stream.
    pub seed: u64,
    /// The parameters' dtype.
    pub dtype: DType,
    /// Compute precision of the training step (bf16 autocast needs f32 parameters).
    pub precision: ComputePrecision,
    /// Device of parameters.
    pub device: Device,
    /// Batch and length.
    pub train: TrainSection,
    /// Optimizer.
    pub optim: OptimConfig,
    /// Learning-rate schedule.
    pub schedule: ScheduleConfig,
    /// Checkpointing.
    pub checkpoint: CheckpointConfig,
    /// Logging.
    pub log: LogConfig,
    /// What the environment says (read once at start-up).
    pub settings: Settings,
}

/// How a run ended.
#[derive(Clone, Debug)]
pub struct Summary {
    /// Steps completed (in total, including before a resume).
    pub steps: usize,
    /// Loss of the last step.
    pub last_loss: f64,
    /// Steps skipped for non-finite values.
    pub skipped: usize,
    /// Evaluation metrics at the end.
    pub eval: Vec<(String, f64)>,
    /// Wall time of this process's run.
    pub seconds: f64,
}

/// A data-parallel trainer for one [`Objective`].
pub struct Trainer {
    cfg: TrainerConfig,
    pg: ProcessGroup,
    objective: Box<dyn Objective>,
    params: Vec<(String, Var)>,
    sharded: Vec<bool>,
    optimizer: Optimizer,
    sampler: DistributedSampler,
    step: usize,
    total_steps: usize,
    out_dir: Option<PathBuf>,
    metrics: Option<MetricsLog>,
    /// Rank 0's TensorBoard events file (`log.tensorboard`).
    tensorboard: Option<EventsWriter>,
    profiler: StepProfiler,
}

impl Trainer {
    /// Builds the objective's parameters (seeded by name, then broadcast from rank 0), and
    /// with `resume`, restores the newest checkpoint of `out_dir`. Rank 0 writes metrics and
    /// checkpoints under `out_dir` when one is given.
    pub fn new(
        cfg: TrainerConfig,
        mut objective: Box<dyn Objective>,
        pg: ProcessGroup,
        out_dir: Option<PathBuf>,
        resume: bool,
    ) -> TrainResult<Self> {
        cfg.precision.check_dtype(cfg.dtype).map_err(TrainError::Setup)?;
        cfg.precision.check_device(&cfg.device).map_err(TrainError::Setup)?;
        cfg.precision.apply_tf32();
        let store = ParamStore::new(cfg.seed);
        objective.bind(&pg)?;
        objective.build(store.var_builder(cfg.dtype, &cfg.device))?;
        let params = store.vars();
        if params.is_empty() {
            return Err(TrainError::Setup("the objective created no parameters in build()".into()));
        }
        let sharded: Vec<bool> = params.iter().map(|(n, _)| objective.is_sharded(n)).collect();
        // Replicated parameters start identical everywhere: broadcast from rank 0 in name order.
        for ((_, v), sh) in params.iter().zip(&sharded) {
            if !sh {
                v.set(&pg.broadcast(v.as_tensor(), 0)?)?;
            }
        }
        let w = pg.world_size();
        let t = &cfg.train;
        t.micro_batch(w).map_err(TrainError::Setup)?;
        // Before any buffer is loaded: a saved queue of past keys is checked against it.
        objective.expect_batch(t.global_batch / t.accumulate)?;
        crate::grad_cache::check_setup(t, w, objective.as_mut(), &params)?;
        // A stream (Objective::sequential) takes its positions in order; it shuffles itself.
        let sampler =
            DistributedSampler::new(objective.num_samples(), t.global_batch, cfg.seed, t.shuffle && !objective.sequential());
        let per_epoch = sampler.steps_per_epoch();
        if per_epoch == 0 {
            return Err(TrainError::Setup(format!(
                "the data set has {} samples, fewer than one global batch (train.global_batch = {})",
                objective.num_samples(),
                t.global_batch
            )));
        }
        let total_steps = match t.max_steps {
            Some(m) if t.epochs == 0 => m,
            Some(m) => m.min(t.epochs * per_epoch),
            None => t.epochs * per_epoch,
        };
        let mut optimizer = Optimizer::new(cfg.optim.clone());
        let mut step = 0;
        if resume {
            let dir = out_dir.as_ref().ok_or_else(|| TrainError::Setup("resuming needs an output directory".into()))?;
            match checkpoint::load_latest(dir, &cfg.device)? {
                None => {
                    tracing::warn!(target: allgrad_dist::JOB_LOG, "--resume: no checkpoint in {}; starting from step 0", dir.display())
                }
                Some(mut ck) => {
                    let wants: Vec<(String, Option<allgrad_models::RowRange>)> = params
                        .iter()
                        .zip(&sharded)
                        .filter(|(_, sh)| **sh)
                        .map(|((n, _), _)| (n.clone(), objective.shard_rows(n)))
                        .collect();
                    shards::load_into(&mut ck, &wants, pg.rank(), w, &cfg.device)?;
                    let path = ck.path.clone();
                    let written_by = ck.state.world_size;
                    let stream = ck.stream.take();
                    let to = RestoreTarget {
                        params: &params,
                        sharded: &sharded,
                        optimizer: &mut optimizer,
                        objective: objective.as_mut(),
                        world_size: w,
                        seed: cfg.seed,
                        dtype: cfg.dtype,
                    };
                    step = checkpoint::restore(ck, to)?;
                    if let Some(s) = stream {
                        // Each rank takes the saved position of the streams it reads now (any
                        // world size: the streams are fixed, their ranks are not).
                        if pg.rank() == 0 {
                            tracing::info!(
                                "the stream resumes at its saved position ({} streams, stream.json)",
                                s.lanes().count()
                            );
                        }
                        objective.resume_stream(s).map_err(|e| TrainError::CheckpointMismatch {
                            path: path.join("stream.json"),
                            reason: e.to_string(),
                        })?;
                    }
                    if pg.rank() == 0 {
                        tracing::info!("resumed from {} at step {step}", path.display());
                        if written_by != w {
                            tracing::info!(
                                "the checkpoint was written by {written_by} rank(s), this run has {w}: parameters, optimizer \
                                 state and buffers carry over exactly; each rank now takes 1/{w} of the same global batch"
                            );
                        }
                    }
                }
            }
        }
        let metrics = match (&out_dir, pg.rank()) {
            (Some(dir), 0) => {
                let io = |action| move |source| TrainError::Io { action, path: dir.clone(), source };
                std::fs::create_dir_all(dir).map_err(io("creating the run directory"))?;
                Some(MetricsLog::open(dir, resume.then_some(step)).map_err(io("opening metrics.jsonl in"))?)
            }
            _ => None,
        };
        let tensorboard = match (&out_dir, pg.rank(), cfg.log.tensorboard) {
            (Some(dir), 0, true) => {
                Some(EventsWriter::create(dir, resume.then_some(step)).map_err(|(path, source)| TrainError::Io {
                    action: "creating the TensorBoard events file",
                    path,
                    source,
                })?)
            }
            _ => None,
        };
        let profiler = StepProfiler::new(&cfg.device, cfg.settings.profile);
        Ok(Trainer {
            cfg,
            pg,
            objective,
            params,
            sharded,
            optimizer,
            sampler,
            step,
            total_steps,
            out_dir,
            metrics,
            tensorboard,
            profiler,
        })
    }

    /// Parameters by name (sorted).
    pub fn params(&self) -> &[(String, Var)] {
        &self.params
    }

    /// The objective's buffers (non-trainable state such as batch-norm running statistics).
    pub fn buffers(&self) -> TrainResult<Vec<(String, Tensor)>> {
        Ok(self.objective.buffers()?)
    }

    /// Steps completed.
    pub fn step(&self) -> usize {
        self.step
    }

    /// Steps the run will take in total.
    pub fn total_steps(&self) -> usize {
        self.total_steps
    }

    /// The regions of the last step: their times and host traffic ([`crate::profile`]).
    pub fn last_step_profile(&self) -> &StepProfile {
        self.profiler.last()
    }

    /// The ops' times of the last step, by kind and pass (empty unless profiling:
    /// `train --profile`, `ALLGRAD_PROFILE=1`).
    pub fn last_op_times(&self) -> &[allgrad_nn::OpTime] {
        self.profiler.last_ops()
    }

    /// The regions' totals over the steps so far, as a table (what `train --profile` prints).
    pub fn profile_table(&self) -> String {
        self.profiler.table()
    }

    /// Trains to the end; see the module docs.
    pub fn train(&mut self) -> TrainResult<Summary> {
        self.train_until(self.total_steps)
    }

    /// Trains until `stop` steps are done (or the end), then checkpoints: a job with a time
    /// limit can run part of the schedule and `--resume` later, ending exactly where an
    /// uninterrupted run would.
    pub fn train_until(&mut self, stop: usize) -> TrainResult<Summary> {
        // ALLGRAD_DEVICE_PATH=1: this thread's CPU tensors take the device path for the run.
        let was = self.cfg.settings.device_path.then(|| allgrad_nn::transfer::set_device_path(true));
        // Profiling: the ops' passes of this thread are timed too.
        if self.cfg.settings.profile {
            allgrad_nn::set_op_timing(true);
        }
        let out = self.train_until_inner(stop);
        if self.cfg.settings.profile {
            allgrad_nn::set_op_timing(false);
        }
        if let Some(was) = was {
            allgrad_nn::transfer::set_device_path(was);
        }
        if self.cfg.settings.profile && self.pg.rank() == 0 {
            println!("{}", self.profiler.table());
        }
        out
    }

    fn train_until_inner(&mut self, stop: usize) -> TrainResult<Summary> {
        let stop = stop.min(self.total_steps);
        let started = Instant::now();
        let started_at = self.step;
        let rank0 = self.pg.rank() == 0;
        let progress = rank0.then(|| ProgressView::new(self.cfg.log.progress, self.total_steps, self.step));
        let per_epoch = self.sampler.steps_per_epoch();
        let (mut last_loss, mut skipped) = (f64::NAN, 0);
        let mut window = (Instant::now(), 0usize);
        let mut eval = Vec::new();
        if self.cfg.train.eval && self.step == 0 && stop > 0 {
            // The untrained model's figures, so the gain of training is visible.
            self.evaluate(0, &progress)?;
        }
        while self.step < stop {
            let epoch = self.step / per_epoch;
            if self.step == started_at || self.step.is_multiple_of(per_epoch) {
                self.plan(epoch, stop)?;
            }
            let lr = self.cfg.schedule.lr(self.cfg.optim.lr(), self.step, self.total_steps, self.cfg.train.global_batch);
            let outcome = self.train_step(epoch, lr)?;
            window.1 += 1;
            match outcome {
                StepOutcome::Applied { loss, grad_norm } => {
                    last_loss = loss;
                    self.step += 1;
                    let log_line = self.step.is_multiple_of(self.cfg.log.every) || self.step == stop;
                    let sps = (window.1 * self.cfg.train.global_batch) as f64 / window.0.elapsed().as_secs_f64().max(1e-9);
                    if let Some(p) = &progress {
                        p.update(self.step, self.total_steps, loss, lr, sps, log_line);
                    }
                    if log_line {
                        self.record(Record {
                            step: self.step,
                            epoch,
                            loss: Some(loss),
                            lr: Some(lr),
                            samples_per_s: Some(sps),
                            grad_norm: Some(grad_norm),
                            host_traffic: self.step_traffic(),
                            data_skipped: self.data_skipped()?,
                            eval: Default::default(),
                        })?;
                        window = (Instant::now(), 0);
                    }
                }
                StepOutcome::Skipped(why) => {
                    skipped += 1;
                    self.step += 1;
                    if let Some(p) = &progress {
                        p.println(&format!("step {}: {why}; update skipped (train.on_nonfinite: skip)", self.step));
                    }
                }
            }
            let epoch_done = self.step.is_multiple_of(per_epoch);
            if self.cfg.train.eval && (epoch_done || self.step == self.total_steps) {
                eval = self.evaluate(epoch, &progress)?;
            }
            let every = self.cfg.checkpoint.every;
            if self.out_dir.is_some() && ((every > 0 && self.step.is_multiple_of(every)) || self.step == stop) {
                self.save_checkpoint()?;
            }
        }
        // Every row up to date: parameters read after this call are the dense update's.
        self.optimizer.flush(&self.params)?;
        if let Some(p) = &progress {
            p.finish();
        }
        if let (Some(m), Some(dir), true) = (&self.metrics, &self.out_dir, self.cfg.log.plot) {
            if let Err(e) = plot(&m.history, &dir.join("loss.png"), self.cfg.settings.font.as_deref()) {
                tracing::warn!("could not draw loss.png: {e}");
            }
        }
        Ok(Summary { steps: self.step, last_loss, skipped, eval, seconds: started.elapsed().as_secs_f64() })
    }

    fn evaluate(&mut self, epoch: usize, progress: &Option<ProgressView>) -> TrainResult<Vec<(String, f64)>> {
        self.optimizer.flush(&self.params)?;
        let eval = self.objective.evaluate(&self.pg)?;
        if !eval.is_empty() {
            if let Some(p) = progress {
                let text: Vec<String> = eval.iter().map(|(k, v)| format!("{k} {v:.4}")).collect();
                p.println(&format!("step {} (epoch {epoch}): {}", self.step, text.join(", ")));
            }
            let r = Record {
                step: self.step,
                epoch,
                loss: None,
                lr: None,
                samples_per_s: None,
                grad_norm: None,
                host_traffic: None,
                data_skipped: None,
                eval: eval.iter().cloned().collect(),
            };
            self.record(r)?;
        }
        Ok(eval)
    }

    fn record(&mut self, r: Record) -> TrainResult<()> {
        if let Some(t) = &mut self.tensorboard {
            let path = t.path().to_path_buf();
            t.scalars(r.step, &r.scalars()).map_err(|source| TrainError::Io { action: "writing", path, source })?;
        }
        if let Some(m) = &mut self.metrics {
            let path = m.path().to_path_buf();
            m.write(r).map_err(|source| TrainError::Io { action: "writing", path, source })?;
        }
        Ok(())
    }

    /// Tells the objective which micro-batches it will see from this step to the end of
    /// `epoch` (or `stop`), so it can build them ahead.
    fn plan(&mut self, epoch: usize, stop: usize) -> Result<()> {
        let (w, rank) = (self.pg.world_size(), self.pg.rank());
        let per_epoch = self.sampler.steps_per_epoch();
        let end = ((epoch + 1) * per_epoch).min(stop);
        let mut batches = Vec::new();
        for step in self.step..end {
            let global = self.sampler.global_batch(epoch, step % per_epoch).to_vec();
            batches.extend(self.cfg.train.micro_batches(&global, rank, w).map(<[usize]>::to_vec));
        }
        self.objective.plan(epoch, self.cfg.seed, &batches)
    }

    /// The last step's host traffic for its metrics line, on the device path.
    fn step_traffic(&self) -> Option<StepTraffic> {
        if !allgrad_nn::transfer::takes_device_path(&self.cfg.device) {
            return None;
        }
        let p = self.profiler.last();
        let mut step = allgrad_nn::HostTraffic::default();
        for r in ["forward", "backward", "gradient sync", "optimizer"].iter().filter_map(|r| p.region(r)) {
            step += r.traffic;
        }
        let t = p.process;
        Some(StepTraffic {
            step_reads: step.reads + step.syncs,
            step_uploads: step.uploads,
            reads: t.reads,
            uploads: t.uploads,
            syncs: t.syncs,
        })
    }

    fn train_step(&mut self, epoch: usize, lr: f64) -> TrainResult<StepOutcome> {
        let out = self.step_regions(epoch, lr);
        match out {
            Ok(_) => self.profiler.finish_step(),
            Err(_) => self.profiler.abandon_step(),
        }
        out
    }

    fn step_regions(&mut self, epoch: usize, lr: f64) -> TrainResult<StepOutcome> {
        let (w, rank) = (self.pg.world_size(), self.pg.rank());
        let on_device = allgrad_nn::transfer::takes_device_path(&self.cfg.device);
        let acc = self.cfg.train.accumulate;
        let pos = self.step % self.sampler.steps_per_epoch();
        let global = self.sampler.global_batch(epoch, pos).to_vec();
        let micro_batches: Vec<Vec<usize>> = self.cfg.train.micro_batches(&global, rank, w).map(<[usize]>::to_vec).collect();

        // A skipped step leaves no trace: the objective's buffers (a queue of past keys, which
        // the loss has already pushed this step's keys into; batch-norm statistics) are copied
        // here and put back when the step is skipped.
        let kept = match self.cfg.train.on_nonfinite {
            NonFinite::Skip => {
                Some(self.objective.buffers()?.into_iter().map(|(n, t)| Ok((n, t.copy()?))).collect::<Result<Buffers>>()?)
            }
            NonFinite::Error => None,
        };
        let mut step_grads = StepGrads::new(self.params.len());
        let mut loss_sum = 0f64;
        // The device path's loss: the micro-batches' losses summed on the device.
        let mut loss_dev: Option<Tensor> = None;
        // The device path's gradient-caching replay checks, verified after the one read.
        let mut replays = Vec::new();
        for indices in &micro_batches {
            let batch = Batch { indices, epoch, step: self.step, seed: self.cfg.seed };
            if let Some(chunk) = self.cfg.train.cache_chunk {
                // Autocast covers both passes' forwards (the backward passes follow the dtypes
                // their forwards recorded).
                let _autocast = self.cfg.precision.autocast();
                let mut grads = step_grads.take_dense(&self.params)?;
                let (objective, pg, divisor) = (self.objective.as_mut(), &self.pg, (w * acc) as f64);
                let m = self.profiler.mark();
                if on_device {
                    let cached = crate::grad_cache::cached_step(objective, &batch, pg, chunk, divisor, &self.params, &mut grads)?;
                    loss_dev = Some(match loss_dev {
                        None => cached.loss,
                        Some(sum) => (sum + cached.loss)?,
                    });
                    replays.extend(cached.replays);
                } else {
                    loss_sum +=
                        crate::grad_cache::cached_gradients(objective, &batch, pg, chunk, divisor, &self.params, &mut grads)?;
                }
                self.profiler.record("forward", m);
                // Refused when the trainer was built (Objective::has_sparse_rows); an objective
                // whose sparse_rows answers without saying so would lose that row's gradient.
                if let Some((name, _)) = self.params.iter().find(|(n, _)| self.objective.sparse_rows(n).is_some()) {
                    return Err(TrainError::Setup(format!(
                        "the objective read {name} row by row (Objective::sparse_rows) in a cached step, but its \
                         Objective::has_sparse_rows({name:?}) is false: implement has_sparse_rows beside sparse_rows"
                    )));
                }
                step_grads.put_dense(grads);
                continue;
            }
            // Rows the loss will read that row-sparse updates left behind are brought up to date.
            for (i, (name, v)) in self.params.iter().enumerate() {
                if self.sharded[i] {
                    if let Some(rows) = self.objective.rows_to_read(name, &batch, &self.pg)? {
                        self.optimizer.catch_up(name, v, &rows)?;
                    }
                }
            }
            let m = self.profiler.mark();
            let loss = {
                let _autocast = self.cfg.precision.autocast();
                self.objective.loss(&batch, &self.pg)?
            };
            if loss.rank() != 0 {
                return Err(TrainError::Setup(format!("the objective's loss must be a scalar, got shape {:?}", loss.dims())));
            }
            if on_device {
                let l = loss.detach().to_dtype(DType::F64)?;
                loss_dev = Some(match loss_dev {
                    None => l,
                    Some(sum) => (sum + l)?,
                });
            } else {
                loss_sum += loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            }
            self.profiler.record("forward", m);
            let m = self.profiler.mark();
            // The scaled loss takes the graph over: the backward frees each activation once its
            // gradient has been passed on, as PyTorch's does.
            let g = (loss / (w * acc) as f64)?.backward_release()?;
            step_grads.add(&self.params, &self.sharded, self.objective.as_ref(), &g)?;
            self.profiler.record("backward", m);
        }
        let (mut grads, row_ids) = step_grads.finish(&self.params)?;
        let m = self.profiler.mark();
        sync_gradients(&self.pg, &mut grads, &self.sharded, DEFAULT_BUCKET_BYTES)?;
        self.profiler.record("gradient sync", m);
        if let Some(loss_dev) = loss_dev {
            return self.finish_on_device(loss_dev, grads, row_ids, lr, kept, replays);
        }
        let m = self.profiler.mark();
        // The objective J = mean over ranks of the per-rank (micro-batch mean) losses.
        let mut loss = [loss_sum / acc as f64];
        self.pg.all_reduce_slice(&mut loss, ReduceOp::Avg)?;
        let loss = loss[0];
        let grad_norm = self.global_grad_norm(&grads)?;
        if !loss.is_finite() || !grad_norm.is_finite() {
            return self.non_finite(loss, grad_norm, &grads, kept);
        }
        if let Some(max) = self.cfg.train.clip_grad_norm {
            if grad_norm > max {
                let scale = max / (grad_norm + 1e-6);
                for g in grads.iter_mut() {
                    *g = (&*g * scale)?;
                }
            }
        }
        // Row-sparse gradients (Partial FC's sampled centres) update their rows, the other rows
        // lazily as a dense step would; rows the objective marks as not updated keep value
        // and state.
        let rows: Vec<RowUpdate> = self
            .params
            .iter()
            .zip(row_ids)
            .map(|((n, _), ids)| match (ids, self.objective.updated_rows(n, self.step)) {
                (Some(ids), keep) => RowUpdate::Sparse { rows: ids, keep_others: keep.is_some() },
                (None, Some(mask)) => RowUpdate::Only(mask),
                (None, None) => RowUpdate::All,
            })
            .collect();
        self.optimizer.step_grads(&self.params, &grads, &self.sharded, &rows, lr, &self.pg)?;
        self.profiler.record("optimizer", m);
        Ok(StepOutcome::Applied { loss, grad_norm })
    }

    /// The rest of a step on the device path, from the summed micro-batch losses `loss_dev`
    /// and the synchronised gradients: loss, norm, clipping and the finite check as tensor ops,
    /// the optimizer guarded by the check, then one batched read of the loss and the norm.
    fn finish_on_device(
        &mut self,
        loss_dev: Tensor,
        mut grads: Vec<Tensor>,
        row_ids: Vec<Option<Vec<u32>>>,
        lr: f64,
        kept: Option<Buffers>,
        replays: Vec<crate::grad_cache::ReplayCheck>,
    ) -> TrainResult<StepOutcome> {
        let m = self.profiler.mark();
        let dev = loss_dev.device().clone();
        let (w, acc) = (self.pg.world_size(), self.cfg.train.accumulate);
        // Constants made on the device (a fill, not an upload).
        let full = |v: f64| Tensor::full(v, (), &dev);
        // As the host path: loss_sum / acc, then the mean over ranks (a sum, then / W), and
        // Σ g² in f64 per parameter in name order, the sharded ones summed over ranks.
        let local = loss_dev.div(&full(acc as f64)?)?;
        let (mut rep, mut shard) = (full(0.0)?, full(0.0)?);
        for (g, sh) in grads.iter().zip(&self.sharded) {
            let sq = crate::optim::sq_norm_tensor(g)?;
            if *sh {
                shard = (shard + sq)?;
            } else {
                rep = (rep + sq)?;
            }
        }
        let any_sharded = self.sharded.iter().any(|s| *s);
        let (loss, shard) = if w > 1 || any_sharded {
            let summed = self.pg.all_reduce(&Tensor::stack(&[&local, &shard], 0)?, ReduceOp::Sum)?;
            (summed.get(0)?.div(&full(w as f64)?)?, if any_sharded { summed.get(1)? } else { shard })
        } else {
            (local, shard)
        };
        let grad_norm = (rep + shard)?.sqrt()?;
        // The found-inf flag: 1 where both are finite (x·0 is 0 only for finite x).
        let zero = full(0.0)?;
        let ok = (loss.affine(0.0, 0.0)? + grad_norm.affine(0.0, 0.0)?)?.eq(&zero)?;
        if let Some(max) = self.cfg.train.clip_grad_norm {
            let max_t = full(max)?;
            let scale = grad_norm.gt(&max_t)?.where_cond(&max_t.div(&(&grad_norm + 1e-6)?)?, &full(1.0)?)?;
            for g in grads.iter_mut() {
                *g = g.broadcast_mul(&scale.to_dtype(g.dtype())?)?;
            }
        }
        let rows: Vec<RowUpdate> = self
            .params
            .iter()
            .zip(row_ids)
            .map(|((n, _), ids)| match (ids, self.objective.updated_rows(n, self.step)) {
                (Some(ids), keep) => RowUpdate::Sparse { rows: ids, keep_others: keep.is_some() },
                (None, Some(mask)) => RowUpdate::Only(mask),
                (None, None) => RowUpdate::All,
            })
            .collect();
        let guarded = self.optimizer.step_guarded(&self.params, &grads, &self.sharded, &rows, lr, &self.pg, &ok)?;
        if !guarded {
            // A row-sparse update cannot be skipped on the device: the figures are read first.
            let figures = allgrad_nn::transfer::read_batched(&[&loss, &grad_norm])?;
            if figures.iter().all(|v| v.is_finite()) {
                self.optimizer.step_grads(&self.params, &grads, &self.sharded, &rows, lr, &self.pg)?;
            }
        }
        self.profiler.record("optimizer", m);
        let m = self.profiler.mark();
        // The loss, the norm and the replay checks of gradient caching, in one read.
        let mut read: Vec<&Tensor> = vec![&loss, &grad_norm];
        for r in &replays {
            read.extend([&r.diff, &r.scale]);
        }
        let figures = allgrad_nn::transfer::read_batched(&read)?;
        self.profiler.record("read", m);
        // A chunk embedded differently the second time: the update was made with its gradient,
        // and the run stops here, before anything is written.
        for (r, v) in replays.iter().zip(figures[2..].chunks(2)) {
            r.verify(v[0], v[1])?;
        }
        let (loss, grad_norm) = (figures[0], figures[1]);
        if loss.is_finite() && grad_norm.is_finite() {
            return Ok(StepOutcome::Applied { loss, grad_norm });
        }
        if guarded {
            // The update was skipped on the device; its number is taken back.
            self.optimizer.undo_step();
        }
        self.non_finite(loss, grad_norm, &grads, kept)
    }

    /// A step whose loss or gradient norm is not finite: the error, or the skip of
    /// `train.on_nonfinite: skip` (the update has not been applied; the objective's buffers
    /// `kept` before the step are put back).
    fn non_finite(&mut self, loss: f64, grad_norm: f64, grads: &[Tensor], kept: Option<Buffers>) -> TrainResult<StepOutcome> {
        let what = if loss.is_finite() { "gradient" } else { "loss" };
        if self.cfg.train.on_nonfinite == NonFinite::Skip {
            if let Some(kept) = kept {
                self.objective.load_buffers(&kept)?;
            }
            return Ok(StepOutcome::Skipped(format!("non-finite {what} at step {} (loss {loss})", self.step + 1)));
        }
        // The run stops: the first parameter whose gradient is not finite is named.
        let mut parameter = None;
        for ((name, _), g) in self.params.iter().zip(grads) {
            if !allgrad_nn::transfer::read_scalar(&g.to_dtype(DType::F64)?.sum_all()?)?.is_finite() {
                parameter = Some(name.clone());
                break;
            }
        }
        Err(TrainError::NonFinite { what, step: self.step + 1, loss, grad_norm, parameter })
    }

    /// L2 norm of all gradients: replicated ones are identical on every rank after the
    /// sync; sharded ones are summed over ranks.
    fn global_grad_norm(&self, grads: &[Tensor]) -> Result<f64> {
        let mut sums = [0f64, 0f64];
        for (g, sh) in grads.iter().zip(&self.sharded) {
            sums[*sh as usize] += g.to_dtype(DType::F64)?.sqr()?.sum_all()?.to_scalar::<f64>()?;
        }
        if self.sharded.iter().any(|s| *s) {
            let mut s = [sums[1]];
            self.pg.all_reduce_slice(&mut s, ReduceOp::Sum)?;
            sums[1] = s[0];
        }
        Ok((sums[0] + sums[1]).sqrt())
    }

    /// A stream's samples left out so far in this epoch, over all ranks (each rank reads its
    /// own streams); `None` when the data is not a stream. Every rank calls it.
    fn data_skipped(&self) -> TrainResult<Option<u64>> {
        if !self.objective.sequential() {
            return Ok(None);
        }
        let own = self.objective.stream_state()?.map_or(0, |s| s.skipped());
        let mut n = [own as i64];
        self.pg.all_reduce_slice(&mut n, ReduceOp::Sum)?;
        Ok(Some(n[0] as u64))
    }

    /// The position of the training stream (every rank's streams, merged), for a checkpoint;
    /// `None` when the data is not a stream. Every rank calls it.
    fn stream_state(&self) -> TrainResult<Option<StreamState>> {
        if !self.objective.sequential() {
            return Ok(None);
        }
        let own = self.objective.stream_state()?.unwrap_or_default();
        let bytes = serde_json::to_vec(&own).map_err(|e| TrainError::Setup(format!("encoding the stream position: {e}")))?;
        let (all, counts) = self.pg.all_gather_v_slice(&bytes, &[])?;
        let mut merged = StreamState::default();
        let mut at = 0;
        for (r, n) in counts.into_iter().enumerate() {
            let part: StreamState = serde_json::from_slice(&all[at..at + n])
                .map_err(|e| TrainError::Setup(format!("rank {r}'s stream position does not parse: {e}")))?;
            merged.merge(part).map_err(|e| TrainError::Setup(format!("rank {r}'s stream position: {e}")))?;
            at += n;
        }
        Ok((!merged.is_empty()).then_some(merged))
    }

    fn save_checkpoint(&mut self) -> TrainResult<()> {
        let Some(dir) = self.out_dir.clone() else { return Ok(()) };
        let stream = self.stream_state()?;
        // Rows behind (row-sparse updates) are brought up to date: the checkpoint holds the
        // dense update's values and state.
        self.optimizer.flush(&self.params)?;
        // Never write a checkpoint of broken weights.
        for (name, v) in &self.params {
            let bad = v.as_tensor().to_dtype(DType::F64)?.abs()?.max_all()?.to_scalar::<f64>()?;
            if !bad.is_finite() {
                return Err(TrainError::NonFiniteParameter { step: self.step, parameter: name.clone() });
            }
        }
        let any_sharded = self.sharded.iter().any(|s| *s);
        if self.pg.rank() != 0 && !any_sharded {
            return Ok(());
        }
        let (model, optimizer, shard) = shards::split(&self.params, &self.sharded, self.optimizer.state());
        let per_epoch = self.sampler.steps_per_epoch();
        let state = TrainState {
            step: self.step,
            epoch: self.step / per_epoch,
            batch_in_epoch: self.step % per_epoch,
            optimizer_steps: self.optimizer.steps,
            seed: self.cfg.seed,
            world_size: self.pg.world_size(),
        };
        let buffers = self.objective.buffers()?;
        let (keep, fault) = (self.cfg.checkpoint.keep_last, self.cfg.settings.fault);
        let contents =
            Contents { model: &model, optimizer: &optimizer, buffers: &buffers, state: &state, stream: stream.as_ref() };
        if !any_sharded {
            checkpoint::save(&dir, &contents, keep, fault)?;
            return Ok(());
        }
        let (rank, world_size) = (self.pg.rank(), self.pg.world_size());
        let mut meta = shards::ShardMeta { rank, world_size, params: Default::default() };
        for ((n, _), _) in self.params.iter().zip(&self.sharded).filter(|(_, sh)| **sh) {
            meta.params.insert(n.clone(), self.objective.shard_rows(n));
        }
        let shard = shards::Shard { tensors: &shard, meta: &meta };
        shards::save(&self.pg, &dir, &contents, &shard, keep, fault)
    }

    /// The run directory, if any.
    pub fn out_dir(&self) -> Option<&Path> {
        self.out_dir.as_deref()
    }
}

enum StepOutcome {
    Applied { loss: f64, grad_norm: f64 },
    Skipped(String),
}
