//! What allgrad's step benchmarks (`bench_simclr_step`, `bench_simcse_step`, `bench_clip_step`,
//! `bench_step_memory`) share, from the bottom up: the machine's state and this process's
//! resource usage (`machine`), the figures of one measured step (`sample`), the PyTorch peer
//! run as a worker process (`peer`), the alternation of both sides and its tables (`report`),
//! and allgrad's SimCLR step (`simclr_step`). The binaries are in `src/bin/`, each driven by
//! its script in `scripts/bench/`.

pub mod machine;
pub mod peer;
pub mod report;
pub mod sample;
pub mod simclr_step;
