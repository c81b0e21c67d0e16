//! `train`: one rank of a training run, with the built-in methods (the logic is
//! `allgrad_train::cli`; see there for the arguments).
//!
//! ```text
//! train --config configs/vectors.yaml [--set optim.lr=0.1 ...] [--output-dir DIR] [--resume]
//! launch --nproc-per-node 2 train --config configs/vectors.yaml
//! ```

use allgrad_train::{cli, Registry};

fn main() {
    let tuned = allgrad::tune_allocator();
    cli::init_logging();
    tracing::debug!("allocator tuned for training: {tuned}");
    std::process::exit(cli::main_with(Registry::builtin()));
}
