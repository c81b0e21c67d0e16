//! From a [`RunConfig`] to a running [`Trainer`]: what the `train` binary does.

use std::path::PathBuf;

use allgrad_dist::ProcessGroup;
use allgrad_models::barlow_twins::BarlowTwins;
use allgrad_models::losses::LossConfig;
use allgrad_models::simclr::SimClr;
use allgrad_models::vectors::VectorContrastive;
use allgrad_models::Objective;
use candle_core::{DType, Device};

use crate::config::{DataConfig, DeviceKind, ModelConfig, Precision, RunConfig};
use crate::error::{TrainError, TrainResult};
use crate::settings::Settings;
use crate::trainer::{Trainer, TrainerConfig};

/// The device of this rank. Only the CPU exists in this build: `device: cuda` is rejected
/// (by [`RunConfig::validate`] too) until the GPU backend lands.
pub fn device(cfg: &RunConfig, _pg: &ProcessGroup) -> TrainResult<Device> {
    match cfg.device {
        DeviceKind::Cpu => Ok(Device::Cpu),
        DeviceKind::Cuda => Err(TrainError::Setup(crate::config::NO_GPU.into())),
    }
}

/// The built-in objective a config names.
pub fn objective(cfg: &RunConfig, device: &Device) -> TrainResult<Box<dyn Objective>> {
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
        (d, m) => Err(TrainError::Setup(format!("data {d:?} cannot feed model {m:?}"))),
    }
}

fn dtype(cfg: &RunConfig) -> DType {
    match cfg.dtype {
        Precision::F32 => DType::F32,
        Precision::F64 => DType::F64,
    }
}

/// The trainer's part of a run config, with `settings` from the environment.
pub fn trainer_config(cfg: &RunConfig, device: Device, settings: Settings) -> TrainerConfig {
    TrainerConfig {
        seed: cfg.seed,
        dtype: dtype(cfg),
        device,
        train: cfg.train.clone(),
        optim: cfg.optim.clone(),
        schedule: cfg.schedule.clone(),
        checkpoint: cfg.checkpoint.clone(),
        log: cfg.log.clone(),
        settings,
    }
}

/// Builds the trainer for a (validated) config with no environment settings (no font for
/// the plot's labels but the system's, no fault hook); rank 0 writes `config.yaml` to
/// `out_dir`. See [`build_with`].
pub fn build(cfg: &RunConfig, pg: ProcessGroup, out_dir: Option<PathBuf>, resume: bool) -> TrainResult<Trainer> {
    build_with(cfg, pg, out_dir, resume, Settings::default())
}

/// [`build`] with the settings the binary read from the environment at start-up.
pub fn build_with(
    cfg: &RunConfig,
    pg: ProcessGroup,
    out_dir: Option<PathBuf>,
    resume: bool,
    settings: Settings,
) -> TrainResult<Trainer> {
    let device = device(cfg, &pg)?;
    if let (Some(dir), 0) = (&out_dir, pg.rank()) {
        let io = |action, path: PathBuf| move |source| TrainError::Io { action, path, source };
        std::fs::create_dir_all(dir).map_err(io("creating", dir.clone()))?;
        let path = dir.join("config.yaml");
        std::fs::write(&path, cfg.to_yaml()).map_err(io("writing", path.clone()))?;
    }
    let objective = objective(cfg, &device)?;
    Trainer::new(trainer_config(cfg, device, settings), objective, pg, out_dir, resume)
}
