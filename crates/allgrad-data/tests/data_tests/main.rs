//! allgrad-data's integration tests in one binary (one to compile and link instead of one per
//! file): each module is the tests of one data source or stage. `cargo test -p allgrad-data
//! --test data_tests webdataset::` runs one module's tests. (Not `data`: `tests/data/` holds the
//! fixtures.)
//!
//! The modules share a process, and their tests run on parallel threads. That is safe here: they
//! read fixtures and write only temporary folders of their own. A test file that changes
//! process-wide state (an environment variable, the current directory) needs a binary of its
//! own.
//!
//! A binary of its own (`tests/*.rs`): `loader_cuda.rs`, the GPU test, which the GPU scripts
//! build and run by name (`build_cuda_bins.sh`, `gpu_ci.sh`); it also reads the process-wide
//! count of pinned uploads (`allgrad_data::pinned_uploads`) and asserts exact differences.

mod captions;
mod fashion_mnist;
mod recordio;
mod resize_pil;
mod scaled_decode;
mod views_pinned;
mod webdataset;
mod webdataset_resume;
mod webp;
