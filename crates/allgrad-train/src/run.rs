//! From a [`RunConfig`] to a running [`Trainer`]: what the `train` binary does.

use std::path::PathBuf;

use allgrad_dist::ProcessGroup;
use allgrad_models::Objective;
use candle_core::{Device, Result};

use crate::config::{DeviceKind, RunConfig};
use crate::method::Registry;
use crate::trainer::{Trainer, TrainerConfig};

/// The device of this rank: the CPU, or the GPU of its LOCAL_RANK.
pub fn device(cfg: &RunConfig, pg: &ProcessGroup) -> Result<Device> {
    match cfg.device {
        DeviceKind::Cpu => Ok(Device::Cpu),
        DeviceKind::Cuda => Device::new_cuda(pg.world_info().local_rank),
    }
}

/// The objective of a config whose method is built in ([`Registry::objective`] for others).
pub fn objective(cfg: &RunConfig, device: &Device) -> Result<Box<dyn Objective>> {
    Registry::builtin().objective(cfg, device)
}

/// The trainer's part of a run config.
pub fn trainer_config(cfg: &RunConfig, device: Device) -> TrainerConfig {
    TrainerConfig {
        seed: cfg.seed,
        dtype: cfg.candle_dtype(),
        device,
        train: cfg.train.clone(),
        optim: cfg.optim.clone(),
        schedule: cfg.schedule.clone(),
        checkpoint: cfg.checkpoint.clone(),
        log: cfg.log.clone(),
    }
}

/// Builds the trainer for a (validated) config of a built-in method; rank 0 writes
/// `config.yaml` to `out_dir`.
pub fn build(cfg: &RunConfig, pg: ProcessGroup, out_dir: Option<PathBuf>, resume: bool) -> Result<Trainer> {
    build_with(&Registry::builtin(), cfg, pg, out_dir, resume)
}

/// As [`build`], with the method taken from `registry`.
pub fn build_with(
    registry: &Registry,
    cfg: &RunConfig,
    pg: ProcessGroup,
    out_dir: Option<PathBuf>,
    resume: bool,
) -> Result<Trainer> {
    let device = device(cfg, &pg)?;
    if let (Some(dir), 0) = (&out_dir, pg.rank()) {
        std::fs::create_dir_all(dir).map_err(|e| candle_core::Error::Msg(format!("creating {}: {e}", dir.display())))?;
        let path = dir.join("config.yaml");
        std::fs::write(&path, cfg.to_yaml()).map_err(|e| candle_core::Error::Msg(format!("writing {}: {e}", path.display())))?;
    }
    let objective = registry.objective(cfg, &device)?;
    Trainer::new(trainer_config(cfg, device), objective, pg, out_dir, resume)
}
