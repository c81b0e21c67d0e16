//! `launch`: start the ranks of one node, torchrun-style.
//!
//! ```text
//! launch --nproc-per-node 2 target/release/train --config configs/simclr.yaml
//! launch --nproc-per-node 2 --max-restarts 3 target/release/train --config configs/simclr.yaml
//! launch --nnodes 2 --node-rank 0 --master-addr node0 --master-port 29500 --nproc-per-node 8 PROGRAM ...
//! ```
//!
//! Exit code: the first failing rank's (128 + signal for a rank killed by a signal), 128 +
//! signal when the launcher itself was interrupted, 2 when it could not start the job.

use std::time::Duration;

use allgrad::launch::{launch, LaunchConfig};
use clap::Parser;

/// Examples shown by `launch --help`.
const EXAMPLES: &str = "\
Examples:
  launch --nproc-per-node 2 train --config configs/simclr.yaml
  launch --nproc-per-node 2 --max-restarts 3 train --config configs/simclr.yaml
  launch --nproc-per-node 4 --ranks-filter 0 train --config configs/vectors.yaml
  # two hosts, 8 ranks each (the same command on both, --node-rank 0 and 1):
  ALLGRAD_JOB_TOKEN=$SECRET launch --nnodes 2 --node-rank 0 --master-addr host0 --master-port 29500 \\
      --nproc-per-node 8 train --config configs/simclr.yaml

A program without a `/` is looked up on PATH, then beside launch itself (so `train` works
right after `cargo build`).";

/// Start PROGRAM on N ranks with the torchrun environment (RANK, LOCAL_RANK, WORLD_SIZE,
/// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and a job token. Output lines are prefixed
/// with the rank; if a rank fails, the others are stopped and its exit code is returned.
#[derive(Parser, Debug)]
#[command(version, about, after_help = EXAMPLES)]
struct Args {
    /// Ranks to start on this node.
    #[arg(long, default_value_t = 1)]
    nproc_per_node: usize,
    /// Number of nodes in the job.
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// This node's index in 0..nnodes.
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Address of the node running rank 0.
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of rank 0's rendezvous store (default: a free port on a single node; required with several nodes).
    #[arg(long, default_value_t = 0)]
    master_port: u16,
    /// Show the output of these local ranks only, e.g. `0` or `0,1`.
    #[arg(long, value_delimiter = ',')]
    ranks_filter: Option<Vec<usize>>,
    /// Do not prefix output lines with the rank.
    #[arg(long)]
    no_prefix: bool,
    /// Seconds between SIGTERM and SIGKILL when stopping ranks.
    #[arg(long, default_value_t = 5.0)]
    grace_s: f64,
    /// Start every rank again, up to this many times, when one fails; the ranks get
    /// torchrun's TORCHELASTIC_RUN_ID / _RESTART_COUNT / _MAX_RESTARTS, so `train` resumes
    /// from its newest checkpoint.
    #[arg(long, default_value_t = 0)]
    max_restarts: usize,
    /// The job's run id (TORCHELASTIC_RUN_ID; default with --max-restarts: the UTC time).
    /// `train` without --output-dir then writes to runs/CONFIG/RUN_ID.
    #[arg(long)]
    run_id: Option<String>,
    /// The program to run, and its arguments.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    program: Vec<String>,
}

fn main() {
    let a = Args::parse();
    let cfg = LaunchConfig {
        nproc_per_node: a.nproc_per_node,
        nnodes: a.nnodes,
        node_rank: a.node_rank,
        master_addr: a.master_addr,
        master_port: a.master_port,
        ranks_filter: a.ranks_filter,
        prefix: !a.no_prefix,
        grace: Duration::from_secs_f64(a.grace_s.max(0.0)),
        max_restarts: a.max_restarts,
        run_id: a.run_id,
        program: a.program,
    };
    match launch(&cfg) {
        Ok(outcome) => std::process::exit(outcome.exit_code()),
        Err(e) => {
            eprintln!("launch: error: {e}");
            std::process::exit(2);
        }
    }
}
