//! What allgrad's benchmark binaries share: the machine's state and this process's resource
//! usage (`machine`), the PyTorch peer run as a worker process (`peer`), the measured step and
//! its tables (`report`), and allgrad's SimCLR step (`simclr_step`), used by
//! `bench_simclr_step`, `bench_simcse_step` and `bench_step_memory`. The binaries are in
//! `src/bin/`, each driven by its script in `scripts/bench/`.

pub mod machine;
pub mod peer;
pub mod report;
pub mod simclr_step;
