//! From a [`RunConfig`] to a running [`Trainer`]: what the `train` binary does.

use std::path::PathBuf;

use allgrad_dist::ProcessGroup;
use allgrad_models::Objective;
use candle_core::Device;

use crate::config::{DeviceKind, RunConfig};
use crate::error::{TrainError, TrainResult};
use crate::method::Registry;
use crate::settings::Settings;
use crate::trainer::{Trainer, TrainerConfig};

/// The device of this rank: the CPU, or (`device: cuda`, in a build with the `cuda` feature)
/// CUDA device `LOCAL_RANK % (visible devices)` of this host, or `dist.device_ids[LOCAL_RANK]`
/// ([`allgrad_dist::gpu::cuda_ordinal`]). A build without the feature rejects `device: cuda`
/// (as [`RunConfig::validate`] does).
pub fn device(cfg: &RunConfig, pg: &ProcessGroup) -> TrainResult<Device> {
    match cfg.device {
        DeviceKind::Cpu => Ok(Device::Cpu),
        #[cfg(feature = "cuda")]
        DeviceKind::Cuda => {
            use candle_core::cuda::cudarc::driver::CudaContext;
            let info = pg.world_info();
            let count = CudaContext::device_count()
                .map_err(|e| TrainError::Setup(format!("device: cuda: cannot count the CUDA devices of this host: {e:?}")))?;
            let ordinal = allgrad_dist::gpu::cuda_ordinal(
                info.local_rank,
                info.local_world_size,
                count.max(0) as usize,
                cfg.dist.device_ids.as_deref(),
            )
            .map_err(TrainError::Setup)?;
            let dev = Device::new_cuda(ordinal).map_err(|e| {
                TrainError::Setup(format!(
                    "device: cuda: cannot open CUDA device {ordinal} (for LOCAL_RANK {}): {e}",
                    info.local_rank
                ))
            })?;
            // Memory stays mapped between steps (the pool's release threshold).
            allgrad_nn::keep_pool_memory(&dev);
            Ok(dev)
        }
        #[cfg(not(feature = "cuda"))]
        DeviceKind::Cuda => {
            let _ = pg;
            Err(TrainError::Setup(crate::config::NO_GPU.into()))
        }
    }
}

/// On a CUDA device, makes the world group choose the path of its CUDA collectives now (a
/// collective: every rank calls it here), under `dist.cuda_collectives` or
/// ALLGRAD_CUDA_COLLECTIVES, so that `nccl` on a shared GPU fails at start naming the ranks and
/// the GPU; rank 0 logs the choice. Nothing on the CPU.
pub fn choose_cuda_path(cfg: &RunConfig, pg: &ProcessGroup, device: &Device) -> TrainResult<()> {
    if !device.is_cuda() {
        return Ok(());
    }
    let mode = cfg.dist.cuda_collectives(pg.settings().cuda_collectives).map_err(TrainError::Setup)?;
    pg.set_cuda_collectives(mode)?;
    pg.cuda_path(device)?;
    Ok(())
}

/// The objective of a config whose method is built in ([`Registry::objective`] for others).
pub fn objective(cfg: &RunConfig, device: &Device) -> TrainResult<Box<dyn Objective>> {
    Ok(Registry::builtin().objective(cfg, device)?)
}

/// The trainer's part of a run config, with `settings` from the environment.
pub fn trainer_config(cfg: &RunConfig, device: Device, settings: Settings) -> TrainerConfig {
    TrainerConfig {
        seed: cfg.seed,
        dtype: cfg.candle_dtype(),
        precision: cfg.precision,
        device,
        train: cfg.train.clone(),
        optim: cfg.optim.clone(),
        param_groups: cfg.param_groups.clone(),
        schedule: cfg.schedule.clone(),
        checkpoint: cfg.checkpoint.clone(),
        log: cfg.log.clone(),
        settings,
    }
}

/// Builds the trainer for a (validated) config of a built-in method, with no environment
/// settings (no font for the plot's labels but the system's, no fault hook); rank 0 writes
/// `config.yaml` to `out_dir`. See [`build_with`].
pub fn build(cfg: &RunConfig, pg: ProcessGroup, out_dir: Option<PathBuf>, resume: bool) -> TrainResult<Trainer> {
    build_with(&Registry::builtin(), cfg, pg, out_dir, resume, Settings::default())
}

/// As [`build`], with the method taken from `registry` and the settings the binary read from
/// the environment at start-up.
pub fn build_with(
    registry: &Registry,
    cfg: &RunConfig,
    pg: ProcessGroup,
    out_dir: Option<PathBuf>,
    resume: bool,
    settings: Settings,
) -> TrainResult<Trainer> {
    let device = device(cfg, &pg)?;
    choose_cuda_path(cfg, &pg, &device)?;
    if let (Some(dir), 0) = (&out_dir, pg.rank()) {
        let io = |action, path: PathBuf| move |source| TrainError::Io { action, path, source };
        std::fs::create_dir_all(dir).map_err(io("creating", dir.clone()))?;
        let path = dir.join("config.yaml");
        std::fs::write(&path, cfg.to_yaml()).map_err(io("writing", path.clone()))?;
    }
    // With `settings.device_path`, the objective and the trainer are built on the device path
    // too (its per-shape constants made as on a device), as the steps then run.
    let was = settings.device_path.then(|| allgrad_nn::transfer::set_device_path(true));
    let built = (|| {
        let objective = registry.objective(cfg, &device)?;
        Trainer::new(trainer_config(cfg, device, settings), objective, pg, out_dir, resume)
    })();
    if let Some(was) = was {
        allgrad_nn::transfer::set_device_path(was);
    }
    built
}
