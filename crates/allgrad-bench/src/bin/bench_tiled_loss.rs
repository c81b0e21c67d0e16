//! One rank of the tiled-loss benchmark (`scripts/bench/bench_tiled_loss.sh` runs it through
//! `launch` for every global batch and mode): one or more training steps of the `vectors`
//! method (an MLP on seeded synthetic vectors, NT-Xent over the global batch) or of SimCLR
//! with a small ResNet at low resolution on the bundled Fashion-MNIST, untiled or with
//! `loss.tile`, with or without `train.cache_chunk`, through the real trainer; or, with
//! `--loss-only`, the NT-Xent loss and its backward alone on fixed embeddings.
//!
//! ```text
//! cargo build --release -p allgrad -p allgrad-bench --bin launch --bin bench_tiled_loss
//! target/release/launch --nproc-per-node 2 target/release/bench_tiled_loss \
//!     --global-batch 65536 --tile 4096 --cache-chunk 4096
//! ```
//!
//! It takes one step (timed: `first_s`), then `--steps` more (their mean: `step_s`), and
//! prints one line per rank: `bench_tiled_loss: rank R/W method M global_batch N tile T
//! cache_chunk C first_s F step_s S rss_start_mib X peak_rss_mib Y`, where `peak_rss_mib` is
//! getrusage's `ru_maxrss` (the peak resident memory of this rank's process) and
//! `rss_start_mib` the resident memory after the model was built. `--tile 0` is the untiled
//! loss, `--cache-chunk 0` the plain step. With `--loss-only` the line has `loss_s` (mean
//! forward + backward time of the loss on this rank's `[b, d]` embeddings of both views over
//! `--steps` repetitions after one untimed one) instead of the step times.

use std::path::Path;
use std::time::Instant;

use allgrad::dist::ProcessGroup;
use allgrad::models::losses::{nt_xent, nt_xent_tiled};
use allgrad::train::{run, RunConfig};
use anyhow::{Context, Result};
use candle_core::{Device, Var};
use clap::Parser;

/// Tiled and untiled NT-Xent steps; one rank.
#[derive(Parser)]
struct Args {
    /// Samples per step over all ranks (each with two views: 2N embeddings).
    #[arg(long)]
    global_batch: usize,
    /// `loss.tile`; 0: the untiled loss.
    #[arg(long, default_value_t = 0)]
    tile: usize,
    /// Samples per chunk on each rank (`train.cache_chunk`); 0: the plain step.
    #[arg(long, default_value_t = 0)]
    cache_chunk: usize,
    /// Steps (or loss repetitions) after the first; their mean time is printed.
    #[arg(long, default_value_t = 0)]
    steps: usize,
    /// `vectors` or `resnet`.
    #[arg(long, default_value = "vectors")]
    method: String,
    /// Embedding width (the MLP's or the projector's output).
    #[arg(long, default_value_t = 16)]
    dim: usize,
    /// Time the loss and its backward alone on fixed embeddings, no model.
    #[arg(long)]
    loss_only: bool,
}

fn config(a: &Args) -> Result<RunConfig> {
    let loss = if a.tile > 0 {
        format!("{{kind: nt_xent, temperature: 0.2, tile: {}}}", a.tile)
    } else {
        "{kind: nt_xent, temperature: 0.2}".into()
    };
    let steps = a.steps + 1;
    let text = match a.method.as_str() {
        "vectors" => format!(
            "seed: 0\nmethod: vectors\n\
             data: {{kind: vectors, samples: {n}, dim: 32, clusters: 64, view_noise: 0.3}}\n\
             model: {{kind: mlp, hidden: 64, out: {d}}}\nloss: {loss}\n\
             optim: {{kind: lars, lr: 0.3, weight_decay: 1.0e-6}}\n\
             train: {{global_batch: {n}, epochs: 0, max_steps: {steps}, eval: false, shuffle: false}}\n\
             log: {{progress: quiet, plot: false}}\n",
            n = a.global_batch,
            d = a.dim
        ),
        "resnet" => format!(
            "seed: 0\nmethod: simclr\n\
             data: {{kind: images, dir: {dir}, format: idx, loader: {{workers: 1, prefetch: 2}},\n  \
               augment: {{crop: {{size: 12, scale: [0.2, 1.0], ratio: [0.75, 1.3333]}}, flip: {{p: 0.5}},\n    \
               color_jitter: {{brightness: 0.4, contrast: 0.4, saturation: 0.0, hue: 0.0, p: 0.8}},\n    \
               normalize: {{mean: [0.286], std: [0.353]}}}}}}\n\
             model: {{kind: resnet, encoder: {{depth: 18, width: 8, in_channels: 1, stem: cifar, sync_bn: true}},\n  \
               projector: {{hidden: 128, out: {d}, layers: 2}}}}\n\
             loss: {loss}\n\
             optim: {{kind: lars, lr: 0.3, momentum: 0.9, weight_decay: 1.0e-6}}\n\
             train: {{global_batch: {n}, epochs: 0, max_steps: {steps}, eval: false}}\n\
             log: {{progress: quiet, plot: false}}\n",
            dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/fashion-mnist").display(),
            n = a.global_batch,
            d = a.dim
        ),
        other => anyhow::bail!("--method must be vectors or resnet, got {other}"),
    };
    let sets: Vec<String> = if a.cache_chunk > 0 { vec![format!("train.cache_chunk={}", a.cache_chunk)] } else { vec![] };
    Ok(RunConfig::parse(&text, Path::new("bench_tiled_loss"), &sets)?)
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

/// The loss and its backward on this rank's share of `2 x global_batch` fixed embeddings.
fn loss_only(a: &Args, pg: &ProcessGroup) -> Result<(f64, f64, f64)> {
    let b = a.global_batch / pg.world_size();
    let start = pg.rank() * b;
    let view = |v: usize| -> Result<Var> {
        let data: Vec<f32> =
            (0..b * a.dim).map(|j| (((start * a.dim + j) as f64 * 0.61 + v as f64 * 1.7).sin() as f32) + 0.1).collect();
        Ok(Var::from_vec(data, (b, a.dim), &Device::Cpu)?)
    };
    let (z1, z2) = (view(1)?, view(2)?);
    let rss_start = rss_now_mib();
    let once = || -> Result<f64> {
        let t = Instant::now();
        let l = if a.tile > 0 { nt_xent_tiled(&z1, &z2, 0.2, a.tile, pg)? } else { nt_xent(&z1, &z2, 0.2, pg)? };
        let g = (l / pg.world_size() as f64)?.backward()?;
        let _ = g.get(&z1).context("no gradient")?.sum_all()?.to_scalar::<f32>()?;
        Ok(t.elapsed().as_secs_f64())
    };
    let first = once()?;
    let mut total = 0.0;
    for _ in 0..a.steps {
        total += once()?;
    }
    Ok((first, total / a.steps.max(1) as f64, rss_start))
}

fn main() -> Result<()> {
    allgrad::tune_allocator();
    let args = Args::parse();
    let pg = ProcessGroup::from_env().context("joining the process group")?;
    let (rank, world) = (pg.rank(), pg.world_size());
    let head = format!(
        "bench_tiled_loss: rank {rank}/{world} method {} global_batch {} tile {} cache_chunk {}",
        if args.loss_only { "loss_only" } else { &args.method },
        args.global_batch,
        args.tile,
        args.cache_chunk
    );
    if args.loss_only {
        let (first, mean, rss_start) = loss_only(&args, &pg)?;
        println!("{head} first_s {first:.3} loss_s {mean:.3} rss_start_mib {rss_start:.0} peak_rss_mib {:.0}", peak_rss_mib());
        return Ok(());
    }
    let cfg = config(&args)?;
    cfg.validate(world, Path::new("bench_tiled_loss"))?;
    let mut trainer = run::build(&cfg, pg, None, false)?;
    let rss_start = rss_now_mib();
    let t = Instant::now();
    trainer.train_until(1)?;
    let first = t.elapsed().as_secs_f64();
    let t = Instant::now();
    trainer.train_until(args.steps + 1)?;
    let step_s = t.elapsed().as_secs_f64() / args.steps.max(1) as f64;
    println!(
        "{head} first_s {first:.3} step_s {} rss_start_mib {rss_start:.0} peak_rss_mib {:.0}",
        if args.steps > 0 { format!("{step_s:.3}") } else { "-".into() },
        peak_rss_mib()
    );
    Ok(())
}
