//! One CLIP training step on the CPU, allgrad against OpenCLIP (open-clip-torch 3.3.0 on
//! PyTorch) in ONE invocation: the same towers (a ViT image tower and CLIP's causal text
//! transformer, sizes from the options), freshly initialised, in f32; `batch` fixed random
//! images and captions of the full context length made once (no data loading in the timed
//! part); forward of both towers, the symmetric InfoNCE over the batch, backward, AdamW with
//! OpenCLIP's parameter groups (weight decay 0.2 on the parameters of two or more dimensions)
//! and the logit scale's clamp. PyTorch runs as a child process
//! (`scripts/bench/bench_clip_step.py --worker`, interpreter from `PYTHON`, default `python3`),
//! OpenCLIP's `CLIP` model and its `ClipLoss`; the two alternate step by step (A B A B ...) so
//! that both see the same machine, each on `--threads` threads (rayon's and Candle's pools
//! here; torch.set_num_threads, set_num_interop_threads and OMP/MKL there). For each batch
//! size it prints min / median / max of the step time and its forward / backward / optimizer
//! phases, CPU seconds and minor page faults per step, the backward's allocations and copies,
//! the CPU time other processes used meanwhile, and the ratio of medians. `--profile-steps N`
//! then profiles N more steps of each side: allgrad's time by op kind (allgrad-nn's op timer)
//! and torch.profiler's operators. The load average and the processor are printed first; a busy
//! machine gets a warning.
//!
//! ```text
//! scripts/bench/bench_clip_step.sh                                   # batches 64 and 128, 5 rounds
//! scripts/bench/bench_clip_step.sh --rounds 3 --threads 2 64
//! scripts/bench/bench_clip_step.sh --rounds 1 --profile-steps 2 64   # with the profiles
//! ```

mod step;

use allgrad_bench::machine;
use allgrad_bench::peer::Peer;
use allgrad_bench::report::{alternate, session};
use clap::Parser;

use step::{AllgradStep, Towers};

/// Counts the allocations of the backward (`machine::Usage`).
#[global_allocator]
static ALLOCATOR: machine::Counting = machine::Counting;

/// Alternating allgrad / OpenCLIP CLIP step benchmark.
#[derive(Parser)]
struct Args {
    /// Batch sizes (image-caption pairs).
    #[arg(default_values_t = [64, 128])]
    batches: Vec<usize>,
    /// Timed steps of each implementation, alternating (after one warm-up step each).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Threads of each implementation.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Image side (pixels).
    #[arg(long, default_value_t = 224)]
    image_size: usize,
    /// Patch side (pixels); it must divide the image side.
    #[arg(long, default_value_t = 32)]
    patch: usize,
    /// Width of the image tower.
    #[arg(long, default_value_t = 384)]
    vision_width: usize,
    /// Blocks of the image tower.
    #[arg(long, default_value_t = 6)]
    vision_layers: usize,
    /// Width of the text tower.
    #[arg(long, default_value_t = 256)]
    text_width: usize,
    /// Blocks of the text tower.
    #[arg(long, default_value_t = 6)]
    text_layers: usize,
    /// Context length: every caption has this many tokens.
    #[arg(long, default_value_t = 77)]
    context: usize,
    /// Vocabulary size (OpenAI's tokenizer: 49408).
    #[arg(long, default_value_t = 49408)]
    vocab: usize,
    /// Width of the shared embedding space.
    #[arg(long, default_value_t = 256)]
    embed_dim: usize,
    /// Width of an attention head (heads = width / head width in both towers).
    #[arg(long, default_value_t = 64)]
    head_width: usize,
    /// allgrad only.
    #[arg(long)]
    no_torch: bool,
    /// 1-minute load average above which the machine counts as busy.
    #[arg(long, default_value_t = 0.5)]
    busy_load: f64,
    /// After the timed steps, this many more steps of each side profiled (0: none).
    #[arg(long, default_value_t = 0)]
    profile_steps: usize,
    /// The profiles alone, without the timed steps.
    #[arg(long)]
    profile_only: bool,
}

impl Args {
    fn towers(&self) -> Towers {
        Towers {
            image_size: self.image_size,
            patch: self.patch,
            vision_width: self.vision_width,
            vision_layers: self.vision_layers,
            text_width: self.text_width,
            text_layers: self.text_layers,
            context: self.context,
            vocab: self.vocab,
            embed_dim: self.embed_dim,
            head_width: self.head_width,
        }
    }
}

fn main() -> anyhow::Result<()> {
    // As the train binary does (ALLGRAD_MALLOC_TUNE=0 measures without it).
    allgrad::tune_allocator();
    let args = Args::parse();
    anyhow::ensure!(args.threads > 0 && args.rounds > 0, "--threads and --rounds must be positive");
    anyhow::ensure!(!args.batches.contains(&0), "batch sizes must be at least 1");
    anyhow::ensure!(args.context >= 2, "--context must be at least 2 (a token and the end-of-text token)");
    anyhow::ensure!(args.vocab >= 3, "--vocab must be at least 3");
    anyhow::ensure!(!args.profile_only || args.profile_steps > 0, "--profile-only needs --profile-steps above 0");
    for (name, width) in [("--vision-width", args.vision_width), ("--text-width", args.text_width)] {
        anyhow::ensure!(
            args.head_width > 0 && width % args.head_width == 0,
            "{name} {width} is not a multiple of --head-width {}",
            args.head_width
        );
    }
    // The towers' sizes are checked once, before any worker starts.
    args.towers().config()?;
    session(args.threads, args.busy_load, |python| {
        for &batch in &args.batches {
            run_batch(&args, batch, python)?;
        }
        Ok(())
    })
}

fn run_batch(args: &Args, batch: usize, python: &str) -> anyhow::Result<()> {
    let t = args.towers();
    println!(
        "\n== batch {batch}, f32, {} rounds: image tower ViT {}px patch {} width {} x {} blocks, text tower width {} x {} \
         blocks, context {}, vocab {}, heads of {}, embedding {}",
        args.rounds,
        t.image_size,
        t.patch,
        t.vision_width,
        t.vision_layers,
        t.text_width,
        t.text_layers,
        t.context,
        t.vocab,
        t.head_width,
        t.embed_dim
    );
    let mut peer = if args.no_torch {
        None
    } else {
        Peer::spawn(
            python,
            "scripts/bench/bench_clip_step.py",
            batch,
            &[
                ("threads", args.threads.to_string()),
                ("image-size", t.image_size.to_string()),
                ("patch", t.patch.to_string()),
                ("vision-width", t.vision_width.to_string()),
                ("vision-layers", t.vision_layers.to_string()),
                ("text-width", t.text_width.to_string()),
                ("text-layers", t.text_layers.to_string()),
                ("context", t.context.to_string()),
                ("vocab", t.vocab.to_string()),
                ("embed-dim", t.embed_dim.to_string()),
                ("head-width", t.head_width.to_string()),
            ],
        )?
    };
    let mut ours = AllgradStep::new(t, batch)?;
    println!(
        "parameters: allgrad {}{}",
        ours.parameter_count(),
        peer.as_ref().map_or(String::new(), |p| format!(" ({})", p.banner))
    );
    if !args.profile_only {
        alternate(args.rounds, python, || ours.run(), peer.as_mut())?;
    }
    if args.profile_steps > 0 {
        profile(args.profile_steps, &mut ours, peer.as_mut())?;
    }
    Ok(())
}

/// `steps` allgrad steps with allgrad-nn's op timer on (after one untimed step), then the
/// peer's torch.profiler over as many steps, each printed as a table.
fn profile(steps: usize, ours: &mut AllgradStep, peer: Option<&mut Peer>) -> anyhow::Result<()> {
    use std::collections::BTreeMap;
    ours.run()?;
    allgrad_nn::set_op_timing(true);
    let mut phases: BTreeMap<String, f64> = BTreeMap::new();
    for _ in 0..steps {
        for (k, v) in ours.run()? {
            if matches!(k.as_str(), "wall" | "fwd" | "bwd" | "opt") {
                *phases.entry(k).or_default() += v / steps as f64;
            }
        }
    }
    let times = allgrad_nn::take_op_times();
    allgrad_nn::set_op_timing(false);
    println!("\nallgrad, seconds per step by op kind (allgrad-nn's op timer, mean of {steps} steps)");
    println!("{:<12} {:>9} {:>7} {:>9} {:>7} {:>7}", "kind", "forward", "calls", "backward", "calls", "share");
    let wall = phases.get("wall").copied().unwrap_or(f64::NAN);
    let mut kinds: BTreeMap<&str, [(f64, u64); 2]> = BTreeMap::new();
    for t in &times {
        kinds.entry(t.kind).or_default()[usize::from(t.pass == allgrad_nn::Pass::Backward)] =
            (t.seconds / steps as f64, t.calls / steps as u64);
    }
    let mut timed = [0.0; 2];
    for (kind, [f, b]) in &kinds {
        timed[0] += f.0;
        timed[1] += b.0;
        println!("{kind:<12} {:>9.4} {:>7} {:>9.4} {:>7} {:>6.1}%", f.0, f.1, b.0, b.1, 100.0 * (f.0 + b.0) / wall);
    }
    let phase = |k: &str| phases.get(k).copied().unwrap_or(f64::NAN);
    let (fwd, bwd, opt) = (phase("fwd"), phase("bwd"), phase("opt"));
    println!(
        "{:<12} {:>9.4} {:>7} {:>9.4} {:>7} {:>6.1}%",
        "other ops",
        fwd - timed[0],
        "",
        bwd - timed[1],
        "",
        100.0 * (fwd + bwd - timed[0] - timed[1]) / wall
    );
    println!("{:<12} {:>9} {:>7} {:>9} {:>7} {:>6.1}%", "optimizer", "", "", format!("{opt:.4}"), "", 100.0 * opt / wall);
    println!("phases: forward {fwd:.4} s, backward {bwd:.4} s, optimizer {opt:.4} s, step {wall:.4} s");
    println!(
        "(\"other ops\": Candle's own ops, which the timer does not see: the text tower's causal attention, softmax, \
         the token gather, the patch reshapes, the loss, the gradients' sums)"
    );
    if let Some(p) = peer {
        println!("\nOpenCLIP, torch.profiler over {steps} steps (operators by self CPU time)");
        for line in p.lines(&format!("profile {steps}"))? {
            println!("{line}");
        }
    }
    Ok(())
}
