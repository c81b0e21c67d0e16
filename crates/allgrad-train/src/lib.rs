//! # allgrad-train
//!
//! The trainer as a library: a [`RunConfig`] (YAML), a [`Trainer`] that runs any
//! [`allgrad_models::Objective`] data-parallel with exact gradient semantics, optimizers
//! (SGD, LARS, AdamW), warmup + cosine schedules, atomic checkpoints with bitwise resume,
//! `metrics.jsonl`, a progress bar and `loss.png`. The `method:` of a config names an entry of
//! a [`Registry`] ([`method`]); [`cli::main_with`] is the `train` binary for any registry.
//!
//! Errors are [`TrainError`]s; the environment variables it reads are in [`settings`]. A
//! run directory ([`run_dir`]) holds `config.yaml`, `metrics.jsonl`, `checkpoints/step_<N>/`
//! (`model.safetensors`, `optimizer.safetensors`, `buffers.safetensors`, `state.json`),
//! `checkpoints/latest`, `loss.png` (loss, learning rate and evaluation metrics against
//! steps) and TensorBoard's `events.out.tfevents.*` ([`tensorboard`]).

#![warn(missing_docs)]

pub mod checkpoint;
pub mod cli;
pub mod config;
pub mod ddp;
pub mod error;
pub mod grad_cache;
pub mod method;
pub mod metrics;
pub mod optim;
pub mod params;
pub mod profile;
pub mod run;
pub mod run_dir;
pub mod settings;
mod step_grads;
pub mod tensorboard;
mod trace;
pub mod trainer;

pub use checkpoint::shards;
pub use config::{precision, schedule};
pub use config::{NonFinite, RunConfig, TrainSection};
pub use error::{TrainError, TrainResult};
pub use method::{Method, Registry};
pub use settings::Settings;
#[doc(hidden)]
pub use trace::{optim_paths, OptimPaths};
pub use trainer::{Summary, Trainer, TrainerConfig};
