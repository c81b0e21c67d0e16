//! One rank of the gradient-caching benchmark (`scripts/bench/bench_grad_cache.sh` runs it through
//! `launch` for every batch size, with and without caching): SimCLR with a ResNet-18 (CIFAR
//! stem, SyncBatchNorm) and a 2-layer projector on the bundled Fashion-MNIST, views cropped
//! to `--crop` pixels, trained by the real trainer (LARS, NT-Xent over the global batch).
//!
//! ```text
//! cargo build --release -p allgrad -p allgrad-bench --bin launch --bin bench_grad_cache
//! target/release/launch --nproc-per-node 2 target/release/bench_grad_cache \
//!     --global-batch 1024 --cache-chunk 64 --steps 3
//! ```
//!
//! It takes one untimed step, then `--steps` timed ones, and prints one line per rank:
//! `bench_grad_cache: rank R/W global_batch N cache_chunk C step_s S rss_start_mib X
//! peak_rss_mib Y` where `step_s` is the mean time of the timed steps, `peak_rss_mib`
//! getrusage's `ru_maxrss` (the peak resident memory of this rank's process) and
//! `rss_start_mib` the resident memory after the model and data were loaded. `--cache-chunk
//! 0` is the plain step.

use std::path::Path;
use std::time::Instant;

use allgrad::dist::ProcessGroup;
use allgrad::train::{run, RunConfig};
use anyhow::{Context, Result};
use clap::Parser;

/// SimCLR ResNet-18 steps with or without gradient caching; one rank.
#[derive(Parser)]
struct Args {
    /// Samples per step over all ranks.
    #[arg(long)]
    global_batch: usize,
    /// Samples per chunk on each rank (`train.cache_chunk`); 0: the plain step.
    #[arg(long, default_value_t = 0)]
    cache_chunk: usize,
    /// Timed steps (after one untimed step); their mean time is printed.
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Channels of the first ResNet stage (64: ResNet-18).
    #[arg(long, default_value_t = 64)]
    width: usize,
    /// Side of the square views, in pixels.
    #[arg(long, default_value_t = 32)]
    crop: usize,
    /// Hidden width of the projector.
    #[arg(long, default_value_t = 2048)]
    projector_hidden: usize,
}

fn config(a: &Args) -> Result<RunConfig> {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/fashion-mnist");
    let text = format!(
        "seed: 0\nmethod: simclr\n\
         data: {{kind: images, dir: {}, format: idx, loader: {{workers: 1, prefetch: 2}},\n  \
           augment: {{crop: {{size: {}, scale: [0.2, 1.0], ratio: [0.75, 1.3333]}}, flip: {{p: 0.5}},\n    \
           color_jitter: {{brightness: 0.4, contrast: 0.4, saturation: 0.0, hue: 0.0, p: 0.8}},\n    \
           normalize: {{mean: [0.286], std: [0.353]}}}}}}\n\
         model: {{kind: resnet, encoder: {{depth: 18, width: {}, in_channels: 1, stem: cifar, sync_bn: true}},\n  \
           projector: {{hidden: {}, out: 128, layers: 2}}}}\n\
         loss: {{kind: nt_xent, temperature: 0.2}}\n\
         optim: {{kind: lars, lr: 0.3, momentum: 0.9, weight_decay: 1.0e-6}}\n\
         train: {{global_batch: {}, epochs: 0, max_steps: {}, eval: false}}\n\
         log: {{progress: quiet, plot: false}}\n",
        data.display(),
        a.crop,
        a.width,
        a.projector_hidden,
        a.global_batch,
        a.steps + 1
    );
    let sets: Vec<String> = if a.cache_chunk > 0 { vec![format!("train.cache_chunk={}", a.cache_chunk)] } else { vec![] };
    Ok(RunConfig::parse(&text, Path::new("bench_grad_cache"), &sets)?)
}

/// This process's peak resident memory so far, MiB (getrusage's ru_maxrss, KiB on Linux).
fn peak_rss_mib() -> f64 {
    // SAFETY: getrusage writes one rusage struct, which we own, zero-initialised.
    let mut r: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut r) };
    r.ru_maxrss as f64 / 1024.0
}

/// This process's resident memory now, MiB (VmRSS of /proc/self/status; NaN elsewhere).
fn rss_now_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib =
        status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok());
    kib.map_or(f64::NAN, |k: f64| k / 1024.0)
}

fn main() -> Result<()> {
    allgrad::tune_allocator();
    let args = Args::parse();
    let cfg = config(&args)?;
    let pg = ProcessGroup::from_env().context("joining the process group")?;
    let (rank, world) = (pg.rank(), pg.world_size());
    cfg.validate(world, Path::new("bench_grad_cache"))?;
    let mut trainer = run::build(&cfg, pg, None, false)?;
    let rss_start = rss_now_mib();
    trainer.train_until(1)?;
    // One call for the timed steps, so the loader builds their views ahead as in a run.
    let t = Instant::now();
    trainer.train_until(args.steps + 1)?;
    let step_s = t.elapsed().as_secs_f64() / args.steps.max(1) as f64;
    println!(
        "bench_grad_cache: rank {rank}/{world} global_batch {} cache_chunk {} step_s {step_s:.3} rss_start_mib {rss_start:.0} \
         peak_rss_mib {:.0}",
        args.global_batch,
        args.cache_chunk,
        peak_rss_mib()
    );
    Ok(())
}
