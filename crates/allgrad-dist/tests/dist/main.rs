//! allgrad-dist's integration tests in one binary (one to compile and link instead of one per
//! file): each module is the tests of one family of collectives or failures, with `common`'s
//! keyed inputs and serial f64 references. `cargo test -p allgrad-dist --test dist tree::` runs
//! one module's tests.
//!
//! The modules share a process, and their tests run on parallel threads. That is safe here: ranks
//! are threads of the test (`run_threads`, `ThreadWorld`) with groups of their own, and
//! `shm_processes` and `many_processes` start their ranks as copies of this binary, each running
//! one test by its full name (`shm_processes::child_rank`, `many_processes::child_rank`). A group
//! that forms raises the process's soft limit on open files when it needs more, so the pipes to
//! `many_processes`' 64 children do not take the descriptors the other tests' groups need. A test
//! file that changes process-wide state (an environment variable, the current directory, a signal
//! disposition) needs a binary of its own.
//!
//! Binaries of their own (`tests/*.rs`):
//! - `launch.rs`: it installs SIGINT and SIGTERM handlers and ignores SIGINT for the process,
//!   which the children other tests start meanwhile would inherit (an ignored signal stays
//!   ignored across exec), and it interrupts the whole process with SIGINT;
//! - `nccl_ops.rs`: the GPU test, which the GPU scripts build and run by name
//!   (`build_cuda_bins.sh`, `gpu_ci.sh`).

mod common;

mod all_reduce;
mod differentiable;
mod failures;
mod invariance_check;
mod many_processes;
mod on_demand;
mod redistribution;
mod ring_pass;
mod rooted_and_p2p;
mod shm_processes;
mod store_idle;
mod subgroups;
mod tree;
