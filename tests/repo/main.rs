//! The `allgrad` package's integration tests in one binary (one to compile and link instead of
//! one per file): the programs (`train`, `launch`, `export-hf`, `write-shards`) run as processes,
//! alone, under `launch`, across two network namespaces and under torchrun; the documents and
//! scripts checked against the repository; the crates' imports against their floors; and every
//! Rust file compiled by some target, every child helper marked as one (`sources`). Each module
//! is one former file's tests. `cargo test --test repo torchrun::` runs one module's tests.
//!
//! The modules share a process, and their tests run on parallel threads. That is safe here: what
//! they change they change in the processes they start (environment, current directory,
//! signals), each in folders of its own, and `launch` starts this binary again as its ranks, each
//! running one test by its full name (`launch::child_rank`). A test file that changes
//! process-wide state (an environment variable, the current directory, a signal disposition)
//! needs a binary of its own.
//!
//! `common` (`tests/common/`) is shared with `gpu_equivalence.rs`, so it stays beside this folder.
//!
//! Binaries of their own (`tests/*.rs`): `gpu_equivalence.rs` and `gpu_faults.rs`, the GPU tests
//! with `gpu_common`, which the GPU scripts build and run by name (`build_cuda_bins.sh`,
//! `gpu_ci.sh`) and CI runs by name on the CPU (`ALLGRAD_GPU_TEST_DEVICE=cpu`, `.ci/run`).

#[path = "../common/mod.rs"]
mod common;

mod clip_launch;
mod clip_recipe_parity;
mod device_reads;
mod docs;
mod export;
mod first_run;
mod floors;
mod launch;
mod launch_restarts;
mod outside_crate;
mod scripts;
mod sources;
mod tensorboard;
mod torchrun;
mod train_cli;
mod two_hosts;
