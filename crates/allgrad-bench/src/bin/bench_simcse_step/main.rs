//! One unsupervised SimCSE training step of a BERT encoder (all-MiniLM-L6-v2 by default) on
//! the CPU or a GPU (`--device cuda`, in f32, TF32 or bf16 autocast: `--precision`), allgrad
//! against PyTorch in ONE invocation: `batch` sentences encoded twice (two
//! dropout masks, dropout on), mean pooling, MLP head, InfoNCE (temperature 0.05), backward,
//! AdamW. PyTorch runs as a child process (`scripts/bench/bench_simcse_step.py --worker`,
//! interpreter from `PYTHON`, default `python3`); the two alternate step by step (A B A B ...)
//! so that both see the same machine, each on `--threads` threads (rayon's and Candle's pools
//! here; torch.set_num_threads, set_num_interop_threads and OMP/MKL there). Both take the
//! first `batch` sentences of the same file. For each batch size it prints min / median / max
//! of the step time and its forward / backward / optimizer phases, CPU seconds and minor page
//! faults per step, the backward's page faults, allocations and copies, the CPU time other
//! processes used meanwhile, and the ratio of medians; then a breakdown by op kind (dense layers,
//! attention, layer norm, GELU, softmax, dropout, loss: `layers.rs`), each op timed alone on
//! both sides, alternating. The load average and the processor (SIMD level, caches) are printed
//! first; a busy machine gets a warning.
//!
//! ```text
//! scripts/bench/bench_simcse_step.sh                      # batches 64 and 256, 5 rounds
//! cargo run --release -p allgrad-bench --bin bench_simcse_step -- --rounds 3 --threads 2 64
//! # the breakdown alone, two kinds, allgrad only (e.g. under valgrind --tool=callgrind):
//! bench_simcse_step --breakdown-only --no-torch --breakdown-rounds 1 --kinds layer_norm,gelu 64
//! ```

mod layers;
mod step;

use std::path::PathBuf;

use allgrad::models::simcse::read_sentences;
use allgrad_bench::machine;
use allgrad_bench::peer::Peer;
use allgrad_bench::report::{self, alternate, breakdown, print_layers, session};
use clap::Parser;

use step::AllgradStep;

/// Counts the allocations of the backward (`machine::Usage`).
#[global_allocator]
static ALLOCATOR: machine::Counting = machine::Counting;

/// Alternating allgrad / PyTorch SimCSE step benchmark.
#[derive(Parser)]
struct Args {
    /// Batch sizes (sentences; a step encodes 2B sequences).
    #[arg(default_values_t = [64, 256])]
    batches: Vec<usize>,
    /// Timed steps of each implementation, alternating (after one warm-up step each).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Threads of each implementation.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// A Hugging Face BERT folder (config.json, model.safetensors, tokenizer.json).
    #[arg(long, default_value = "data/models/all-MiniLM-L6-v2")]
    model: PathBuf,
    /// One sentence a line; each step takes the first B.
    #[arg(long, default_value = "data/wordnet/sentences.txt")]
    sentences: PathBuf,
    /// Sequences are truncated to this many tokens.
    #[arg(long, default_value_t = 32)]
    max_len: usize,
    /// allgrad only.
    #[arg(long)]
    no_torch: bool,
    /// Where both implementations run: `cpu`, or `cuda` (GPU 0; allgrad built with
    /// `--features cuda`, PyTorch with CUDA).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// `full` (f32), `tf32` (f32 with TF32 GEMMs, CUDA only) or `bf16` (the forward under bf16
    /// autocast on both sides; allgrad's `precision: bf16`).
    #[arg(long, default_value = "full")]
    precision: String,
    /// 1-minute load average above which the machine counts as busy.
    #[arg(long, default_value_t = 0.5)]
    busy_load: f64,
    /// Op-kind breakdowns of each implementation, alternating, after one warm-up (0: none;
    /// CPU and full precision only).
    #[arg(long, default_value_t = 2)]
    breakdown_rounds: usize,
    /// The breakdown's op kinds, comma-separated (default: all of linear, attention,
    /// layer_norm, gelu, softmax, dropout, loss).
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
    anyhow::ensure!(args.threads > 0 && args.rounds > 0, "--threads and --rounds must be positive");
    report::device_and_precision(&args.device, &args.precision)?;
    anyhow::ensure!(args.max_len >= 2, "--max-len must be at least 2 ([CLS] and [SEP])");
    anyhow::ensure!(
        args.model.join("model.safetensors").is_file(),
        "{} has no model.safetensors: scripts/data/get_minilm.sh fetches all-MiniLM-L6-v2",
        args.model.display()
    );
    anyhow::ensure!(
        args.breakdown_rounds == 0 || (args.device == "cpu" && args.precision == "full"),
        "the op breakdown times f32 ops on the CPU: pass --breakdown-rounds 0 with --device cuda or --precision bf16"
    );
    anyhow::ensure!(!args.breakdown_only || args.breakdown_rounds > 0, "--breakdown-only needs --breakdown-rounds above 0");
    for k in &args.kinds {
        anyhow::ensure!(layers::KINDS.contains(&k.as_str()), "--kinds: no op kind {k:?} (kinds: {})", layers::KINDS.join(", "));
    }
    let sentences = read_sentences(&args.sentences)?;
    let most = args.batches.iter().copied().max().unwrap_or(0);
    anyhow::ensure!(
        most <= sentences.len() && !args.batches.contains(&0),
        "batches must be between 1 and the {} sentences of {}",
        sentences.len(),
        args.sentences.display()
    );
    session(args.threads, args.busy_load, |python| {
        for &batch in &args.batches {
            run_batch(&args, &sentences[..batch], python)?;
        }
        Ok(())
    })
}

fn run_batch(args: &Args, sentences: &[String], python: &str) -> anyhow::Result<()> {
    let batch = sentences.len();
    println!(
        "\n== batch {batch} ({} sequences of at most {} tokens), {}, dropout on, {} rounds, on {}, precision {}",
        2 * batch,
        args.max_len,
        args.model.display(),
        args.rounds,
        args.device,
        args.precision
    );
    let device = if args.device == "cuda" { candle_core::Device::new_cuda(0)? } else { candle_core::Device::Cpu };
    // As `train` opens its device: the memory pool keeps its memory between steps.
    #[cfg(feature = "cuda")]
    allgrad_nn::keep_pool_memory(&device);
    // The worker gets absolute paths: it may resolve relative ones from another folder.
    let abs = |p: &PathBuf| std::fs::canonicalize(p).map(|p| p.display().to_string());
    let mut peer = if args.no_torch {
        None
    } else {
        Peer::spawn(
            python,
            "scripts/bench/bench_simcse_step.py",
            batch,
            &[
                ("threads", args.threads.to_string()),
                ("model", abs(&args.model)?),
                ("sentences", abs(&args.sentences)?),
                ("max-len", args.max_len.to_string()),
                ("device", args.device.clone()),
                ("precision", args.precision.clone()),
            ],
        )?
    };
    let (a, b) = if args.breakdown_only {
        (Vec::new(), Vec::new())
    } else {
        let mut ours = AllgradStep::new(&args.model, sentences.to_vec(), args.max_len, &device, args.precision == "bf16")?;
        alternate(args.rounds, python, || ours.run(), peer.as_mut())?
    };
    if args.breakdown_rounds > 0 {
        let cfg = allgrad::models::bert::BertConfig::from_file(&args.model.join("config.json"))?;
        let shapes = layers::Shapes::new(&cfg, batch, args.max_len);
        let kinds: Vec<&str> =
            if args.kinds.is_empty() { layers::KINDS.to_vec() } else { args.kinds.iter().map(String::as_str).collect() };
        let (la, lb) = breakdown(args.breakdown_rounds, || layers::layer_times(shapes, &kinds), peer.as_mut())?;
        print_layers(&kinds, &[], &la, &lb, &a, &b);
        println!(
            " shapes: {} sequences x {} tokens (max_len: the step pads to its longest, at most this), hidden {}, {} heads,",
            shapes.n, shapes.len, shapes.hidden, shapes.heads
        );
        println!(
            " intermediate {}, {} layers; see crates/allgrad-bench/src/bin/bench_simcse_step/layers.rs for each kind (count: allgrad's)",
            shapes.inter, shapes.layers
        );
    }
    Ok(())
}
