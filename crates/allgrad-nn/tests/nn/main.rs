//! allgrad-nn's integration tests in one binary (one to compile and link instead of one per
//! file): each module is the tests of one kernel or concern, with `common`'s seeded data,
//! comparisons and finite differences. `cargo test -p allgrad-nn --test nn conv::` runs one
//! module's tests.
//!
//! The modules share a process, and their tests run on parallel threads. That is safe here: the
//! path counters the tests read (`kernel_paths`, `simd_paths`, `host_traffic`), the forced SIMD
//! level, autocast and `transfer::set_device_path` are per thread, and the tests that need other
//! values of allgrad-nn's variables (read once per process) run them in a child process, which
//! runs this binary again on one test by its full name (`simd::...`, `conv::...`). A test file
//! that changes process-wide state (an environment variable, the current directory, the TF32
//! switch, a signal disposition) needs a binary of its own.
//!
//! Binaries of their own (`tests/*.rs`): `conv_cuda.rs` and `fused_cuda.rs`, the GPU tests, which
//! the GPU scripts build and run by name (`build_cuda_bins.sh`, `gpu_ci.sh`); `conv_cuda.rs`
//! also turns the process-wide TF32 switch (`allgrad_nn::set_tf32`) on and off.

mod common;

mod activation;
mod attention;
mod autocast;
mod batch_norm;
mod batch_norm_device;
mod channel;
mod conv;
mod dropout;
mod from_vb;
mod gradient_store;
mod host_traffic;
mod linear;
mod loss;
mod norm;
mod pool;
mod simd;
mod softmax;
