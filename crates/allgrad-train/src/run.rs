//! From a [`RunConfig`] to a running [`Trainer`]: what the `train` binary does.

use std::path::PathBuf;

use allgrad_dist::ProcessGroup;
use allgrad_models::barlow_twins::BarlowTwins;
use allgrad_models::losses::LossConfig;
use allgrad_models::simclr::SimClr;
use allgrad_models::vectors::VectorContrastive;
use allgrad_models::Objective;
use candle_core::{DType, Device, Result};

use crate::config::{DataConfig, DeviceKind, ModelConfig, Precision, RunConfig};
use crate::trainer::{Trainer, TrainerConfig};

/// The device of this rank: the CPU, or the GPU of its LOCAL_RANK.
pub fn device(cfg: &RunConfig, pg: &ProcessGroup) -> Result<Device> {
    match cfg.device {
        DeviceKind::Cpu => Ok(Device::Cpu),
        DeviceKind::Cuda => Device::new_cuda(pg.world_info().local_rank),
    }
}

/// The built-in objective a config names.
pub fn objective(cfg: &RunConfig, device: &Device) -> Result<Box<dyn Objective>> {
    let dtype = dtype(cfg);
    match (&cfg.data, &cfg.model) {
        (DataConfig::Vectors(d), ModelConfig::Mlp(m)) => {
            Ok(Box::new(VectorContrastive::new(d.clone(), m.clone(), cfg.loss.clone(), cfg.seed, device.clone(), dtype)?))
        }
        (DataConfig::Images(d), ModelConfig::Resnet(m)) => match cfg.loss {
            LossConfig::NtXent { temperature } => Ok(Box::new(SimClr::new(d, m.clone(), temperature, device.clone(), dtype)?)),
            LossConfig::CrossCorrelation { lambda, scale } => {
                Ok(Box::new(BarlowTwins::new(d, m.clone(), lambda, scale, device.clone(), dtype)?))
            }
        },
        (d, m) => candle_core::bail!("data {d:?} cannot feed model {m:?}"),
    }
}

fn dtype(cfg: &RunConfig) -> DType {
    match cfg.dtype {
        Precision::F32 => DType::F32,
        Precision::F64 => DType::F64,
    }
}

/// The trainer's part of a run config.
pub fn trainer_config(cfg: &RunConfig, device: Device) -> TrainerConfig {
    TrainerConfig {
        seed: cfg.seed,
        dtype: dtype(cfg),
        device,
        train: cfg.train.clone(),
        optim: cfg.optim.clone(),
        schedule: cfg.schedule.clone(),
        checkpoint: cfg.checkpoint.clone(),
        log: cfg.log.clone(),
    }
}

/// Builds the trainer for a (validated) config; rank 0 writes `config.yaml` to `out_dir`.
pub fn build(cfg: &RunConfig, pg: ProcessGroup, out_dir: Option<PathBuf>, resume: bool) -> Result<Trainer> {
    let device = device(cfg, &pg)?;
    if let (Some(dir), 0) = (&out_dir, pg.rank()) {
        std::fs::create_dir_all(dir).map_err(|e| candle_core::Error::Msg(format!("creating {}: {e}", dir.display())))?;
        let path = dir.join("config.yaml");
        std::fs::write(&path, cfg.to_yaml()).map_err(|e| candle_core::Error::Msg(format!("writing {}: {e}", path.display())))?;
    }
    let objective = objective(cfg, &device)?;
    Trainer::new(trainer_config(cfg, device), objective, pg, out_dir, resume)
}
