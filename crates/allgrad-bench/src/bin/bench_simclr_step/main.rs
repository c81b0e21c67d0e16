//! One SimCLR training step on the CPU, allgrad against PyTorch in ONE invocation: ResNet-18
//! (CIFAR stem, width 64) on 2B random 3x32x32 views, projector 512-2048-128, NT-Xent, SGD.
//! PyTorch runs as a child process (`scripts/bench/bench_simclr_step.py --worker`, interpreter from
//! `PYTHON`, default `python3`); the two alternate step by step (A B A B ...) so that both see
//! the same machine, each pinned to `--threads` threads (rayon's and Candle's pools here,
//! torch.set_num_threads and OMP/MKL there). For each batch size it prints min / median / max
//! of the step time, user and system CPU seconds and minor page faults per step (getrusage),
//! the forward / backward / optimizer phases, the CPU time other processes used meanwhile, the
//! ratio of medians, and a per-layer-type breakdown (each layer of the model timed alone).
//! The load average is printed before and after; a busy machine gets a warning.
//!
//! ```text
//! scripts/bench/bench_simclr_step.sh                      # batches 64 and 256, 5 rounds
//! cargo run --release -p allgrad-bench --bin bench_simclr_step -- --rounds 3 --threads 2 64
//! # the breakdown alone, batch norm only (PyTorch's side still times every layer type):
//! bench_simclr_step --breakdown-only --breakdown-rounds 3 --kinds bn 64
//! ```

mod layers;

use allgrad_bench::machine;
use allgrad_bench::peer::Peer;
use allgrad_bench::report::{self, alternate, breakdown, print_layers, session};
use allgrad_bench::simclr_step::AllgradStep;
use clap::Parser;

/// Counts the allocations of the backward (`machine::Usage`).
#[global_allocator]
static ALLOCATOR: machine::Counting = machine::Counting;

/// Alternating allgrad / PyTorch SimCLR step benchmark.
#[derive(Parser)]
struct Args {
    /// Batch sizes (samples; a step sees two views of each).
    #[arg(default_values_t = [64, 256])]
    batches: Vec<usize>,
    /// Timed steps of each implementation, alternating (after one warm-up step each).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Threads of each implementation.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Layer breakdowns of each implementation, alternating, after one warm-up (0: none).
    #[arg(long, default_value_t = 2)]
    breakdown_rounds: usize,
    /// Channels of the first ResNet stage.
    #[arg(long, default_value_t = 64)]
    width: usize,
    /// allgrad only.
    #[arg(long)]
    no_torch: bool,
    /// Where both implementations run: `cpu`, or `cuda` (GPU 0; allgrad built with
    /// `--features cuda`, PyTorch with CUDA). The layer breakdown is CPU only.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// ResNet depth: 18 or 50.
    #[arg(long, default_value_t = 18)]
    depth: usize,
    /// `full` (f32), `tf32` (f32 with TF32 GEMMs and convolutions, CUDA only) or `bf16` (the
    /// forward under bf16 autocast on both sides, the loss in f32; allgrad's `precision: bf16`).
    #[arg(long, default_value = "full")]
    precision: String,
    /// 1-minute load average above which the machine counts as busy.
    #[arg(long, default_value_t = 0.5)]
    busy_load: f64,
    /// On the CPU, run allgrad's step through the code path a GPU takes (statistics kept in
    /// tensors; `allgrad_nn::transfer::set_device_path`), so that its host traffic is counted
    /// as a GPU's would be.
    #[arg(long)]
    device_path: bool,
    /// The breakdown's layer types, comma-separated (default: all of conv_dx, conv_dw, bn,
    /// relu, add, pool, linear, loss).
    #[arg(long, value_delimiter = ',')]
    kinds: Vec<String>,
    /// The breakdown alone, without the steps.
    #[arg(long)]
    breakdown_only: bool,
}

fn main() -> anyhow::Result<()> {
    // As the train binary does (ALLGRAD_MALLOC_TUNE=0 measures without it).
    allgrad::tune_allocator();
    let args = Args::parse();
    if args.device_path {
        allgrad_nn::transfer::set_device_path(true);
    }
    anyhow::ensure!(args.threads > 0 && args.rounds > 0 && args.width > 0, "--threads, --rounds and --width must be positive");
    anyhow::ensure!(matches!(args.depth, 18 | 50), "--depth must be 18 or 50, not {}", args.depth);
    report::device_and_precision(&args.device, &args.precision)?;
    anyhow::ensure!(!args.breakdown_only || args.breakdown_rounds > 0, "--breakdown-only needs --breakdown-rounds above 0");
    for k in &args.kinds {
        anyhow::ensure!(
            layers::KINDS.contains(&k.as_str()),
            "--kinds: no layer type {k:?} (types: {})",
            layers::KINDS.join(", ")
        );
    }
    anyhow::ensure!(
        args.precision != "bf16" || args.breakdown_rounds == 0,
        "the layer breakdown times f32 layers: pass --breakdown-rounds 0 with --precision bf16"
    );
    anyhow::ensure!(
        args.device == "cpu" || args.breakdown_rounds == 0,
        "the layer breakdown runs on the CPU only: pass --breakdown-rounds 0"
    );
    session(args.threads, args.busy_load, |python| {
        for &batch in &args.batches {
            run_batch(&args, batch, python)?;
        }
        Ok(())
    })
}

fn run_batch(args: &Args, batch: usize, python: &str) -> anyhow::Result<()> {
    println!(
        "\n== batch {batch} ({} views), ResNet-{}, width {}, {} rounds, on {}, precision {}",
        2 * batch,
        args.depth,
        args.width,
        args.rounds,
        args.device,
        args.precision
    );
    let device = if args.device == "cuda" { candle_core::Device::new_cuda(0)? } else { candle_core::Device::Cpu };
    // As `train` opens its device: the memory pool keeps its memory between steps.
    #[cfg(feature = "cuda")]
    allgrad_nn::keep_pool_memory(&device);
    let mut options = vec![
        ("width", args.width.to_string()),
        ("depth", args.depth.to_string()),
        ("threads", args.threads.to_string()),
        ("device", args.device.clone()),
    ];
    match args.precision.as_str() {
        "tf32" => options.push(("tf32", String::new())),
        "bf16" => options.push(("autocast", String::new())),
        _ => {}
    }
    let mut peer = if args.no_torch { None } else { Peer::spawn(python, "scripts/bench/bench_simclr_step.py", batch, &options)? };
    let (a, b) = if args.breakdown_only {
        (Vec::new(), Vec::new())
    } else {
        let mut ours = AllgradStep::new(batch, args.width, args.depth, &device)?.bf16(args.precision == "bf16");
        alternate(args.rounds, python, || ours.run(), peer.as_mut())?
    };
    if args.breakdown_rounds > 0 {
        let kinds: Vec<&str> =
            if args.kinds.is_empty() { layers::KINDS.to_vec() } else { args.kinds.iter().map(String::as_str).collect() };
        let (la, lb) = breakdown(args.breakdown_rounds, || layers::layer_times(batch, args.width, &kinds), peer.as_mut())?;
        print_layers(&kinds, &["conv_dw"], &la, &lb, &a, &b);
        println!(" conv_dx / conv_dw: each convolution with only its input's / only its weight's gradient; the forward is");
        println!(" timed in both, and the sum counts conv_dx's.");
    }
    Ok(())
}
