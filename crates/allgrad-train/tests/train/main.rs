//! allgrad-train's integration tests in one binary (one to compile and link instead of one per
//! file): each module is the tests of one method, trainer feature or part of the configuration,
//! with `common` (image configs, runs on thread-ranks, parameter comparisons), `cache_support`
//! (gradient caching's harness and test objectives) and `face_support` (face runs to a list of
//! steps, their comparisons). `cargo test -p allgrad-train --test train simclr::` runs one
//! module's tests.
//!
//! The modules share a process, and their tests run on parallel threads. That is safe here: ranks
//! are threads of the test (`run_threads`) with groups of their own, the path counters the tests
//! read (`allgrad_train::optim_paths`, `allgrad_nn::host_traffic`), autocast and
//! `transfer::set_device_path` are per thread, and runs write to temporary folders of their own.
//! Every trainer sets the process-wide TF32 switch from its precision, which on the CPU changes
//! no result and none of these tests reads. A test file that changes or reads process-wide state
//! (an environment variable, the current directory, the TF32 switch) needs a binary of its own.
//!
//! The fixtures stay beside this folder, in `tests/data/`.
//!
//! Binaries of their own (`tests/*.rs`):
//! - `tf32.rs`: it checks that building a trainer turns the process-wide TF32 switch on and
//!   off, which any other test building a trainer at the same time would flip;
//! - `optim_cuda.rs`: the GPU test, which the GPU scripts build and run by name
//!   (`build_cuda_bins.sh`, `gpu_ci.sh`).

mod cache_support;
mod common;
mod face_support;

mod barlow_twins;
mod bf16;
mod clip;
mod clip_img2dataset;
mod config_paths;
mod config_reference;
mod configs;
mod device_path;
mod face;
mod face_bf16;
mod face_insightface;
mod face_recordio;
mod face_sparse;
mod grad_cache;
mod grad_cache_images;
mod grad_cache_simcse;
mod lazy_update;
mod loss_trace;
mod param_groups;
mod registry;
mod resume_images;
mod simclr;
mod simcse;
mod simcse_method;
mod tiled_loss;
mod trainer;
mod webdataset_config;
