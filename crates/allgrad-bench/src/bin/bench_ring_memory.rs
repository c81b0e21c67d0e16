//! One rank of the ring-loss benchmark (`scripts/bench/bench_ring_memory.sh` runs it through
//! `launch` for every world size and form): the CLIP or SigLIP loss and its backward on this
//! rank's fixed `[b, d]` image and text embeddings (f32, seeded, different on every rank), in
//! the gather form or the ring form, nothing else (no model).
//!
//! ```text
//! cargo build --release --workspace --bin launch --bin bench_ring_memory
//! target/release/launch --nproc-per-node 4 target/release/bench_ring_memory \
//!     --loss siglip --form ring --local-batch 1024 --dim 512
//! ```
//!
//! It runs one untimed step (forward and backward), then `--steps` timed ones, and prints one
//! line per rank:
//! `bench_ring_memory: rank R/W loss L form F local_batch B dim D tile T step_s S
//! heap_step_mib H peak_rss_step_mib P`, where `heap_step_mib` is the peak of the bytes held by
//! the Rust allocator during the timed steps minus what it held before them (the loss step's
//! own memory: embeddings, gathered or received blocks, logits, gradients), and
//! `peak_rss_step_mib` the peak resident set over the timed steps (VmHWM, reset through
//! `/proc/self/clear_refs` before them) minus the resident set before them. `step_s` is the
//! mean time of a timed step, the largest over ranks (one barrier before each step).

use std::time::Instant;

use allgrad::dist::ProcessGroup;
use allgrad::models::clip::{clip_loss, clip_loss_ring, clip_loss_tiled, siglip_loss, siglip_loss_ring, RingOptions};
use allgrad_bench::machine;
use anyhow::Result;
use candle_core::{Device, Tensor, Var};
use clap::Parser;

#[global_allocator]
static ALLOC: machine::Peak = machine::Peak;

/// The CLIP or SigLIP loss alone, gather or ring; one rank.
#[derive(Parser)]
struct Args {
    /// `clip` or `siglip`.
    #[arg(long, default_value = "siglip")]
    loss: String,
    /// `gather` (all_gather of the embeddings) or `ring` (the memory-flat ring).
    #[arg(long, default_value = "ring")]
    form: String,
    /// Pairs on this rank.
    #[arg(long, default_value_t = 256)]
    local_batch: usize,
    /// Embedding width.
    #[arg(long, default_value_t = 512)]
    dim: usize,
    /// `loss.tile` (0: none; the gather form of CLIP then holds its whole logits, SigLIP's
    /// gather form has no tiles).
    #[arg(long, default_value_t = 0)]
    tile: usize,
    /// The ring one way (default: both ways).
    #[arg(long)]
    one_way: bool,
    /// Rows of a block per ring message (0: as many as fit in 256 KiB, the default).
    #[arg(long, default_value_t = 0)]
    chunk: usize,
    /// Timed steps after the untimed one.
    #[arg(long, default_value_t = 3)]
    steps: usize,
}

/// A `kB` field of `/proc/self/status` in MiB.
fn status_mib(field: &str) -> Result<f64> {
    let s = std::fs::read_to_string("/proc/self/status")?;
    let line = s.lines().find(|l| l.starts_with(field)).ok_or_else(|| anyhow::anyhow!("no {field} in /proc/self/status"))?;
    let kb: f64 = line[field.len()..].trim().trim_end_matches("kB").trim().parse()?;
    Ok(kb / 1024.0)
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// Seeded values in [-1, 1), different for every rank and tower.
fn embeddings(rank: usize, tower: u64, b: usize, d: usize) -> Result<Tensor> {
    let mut x = (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ tower;
    let v: Vec<f32> = (0..b * d)
        .map(|_| {
            // xorshift64*: a fixed, seeded stream; the values only need to be spread.
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            ((x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 23) as f32) - 1.0
        })
        .collect();
    Ok(Tensor::from_vec(v, (b, d), &Device::Cpu)?)
}

fn main() -> Result<()> {
    allgrad::tune_allocator();
    let args = Args::parse();
    anyhow::ensure!(matches!(args.loss.as_str(), "clip" | "siglip"), "--loss is clip or siglip, not {}", args.loss);
    anyhow::ensure!(matches!(args.form.as_str(), "gather" | "ring"), "--form is gather or ring, not {}", args.form);
    anyhow::ensure!(args.steps > 0 && args.local_batch > 0 && args.dim > 0, "--steps, --local-batch and --dim must be positive");
    let pg = ProcessGroup::from_env()?;
    let (r, w) = (pg.rank(), pg.world_size());
    let img = Var::from_tensor(&embeddings(r, 1, args.local_batch, args.dim)?)?;
    let txt = Var::from_tensor(&embeddings(r, 2, args.local_batch, args.dim)?)?;
    let scale = Var::from_tensor(&Tensor::new(10f32.ln(), &Device::Cpu)?)?;
    let bias = Var::from_tensor(&Tensor::new(-10f32, &Device::Cpu)?)?;
    let tile = (args.tile > 0).then_some(args.tile);
    let opts = RingOptions { bidirectional: !args.one_way, tile, chunk: (args.chunk > 0).then_some(args.chunk) };
    let step = || -> Result<()> {
        let (i, t, s, b) = (img.as_tensor(), txt.as_tensor(), scale.as_tensor(), bias.as_tensor());
        let loss = match (args.loss.as_str(), args.form.as_str(), tile) {
            ("clip", "gather", None) => clip_loss(i, t, s, &pg)?,
            ("clip", "gather", Some(tile)) => clip_loss_tiled(i, t, s, tile, &pg)?,
            ("clip", _, _) => clip_loss_ring(i, t, s, opts, &pg)?,
            ("siglip", "gather", _) => siglip_loss(i, t, s, b, &pg)?,
            _ => siglip_loss_ring(i, t, s, b, opts, &pg)?,
        };
        let grads = (loss / w as f64)?.backward()?;
        anyhow::ensure!(grads.get(&img).is_some() && grads.get(&txt).is_some(), "the embeddings got no gradient");
        Ok(())
    };
    step()?;
    pg.barrier()?;
    // SAFETY: malloc_trim only returns free memory of the allocator's arenas to the system.
    unsafe { libc::malloc_trim(0) };
    let (rss0, heap0) = (status_mib("VmRSS:")?, machine::heap_live());
    std::fs::write("/proc/self/clear_refs", "5")?;
    machine::reset_heap_peak(heap0);
    let mut total = 0f64;
    for _ in 0..args.steps {
        pg.barrier()?;
        let t0 = Instant::now();
        step()?;
        total += t0.elapsed().as_secs_f64();
    }
    let mut worst = [total / args.steps as f64];
    pg.all_reduce_slice(&mut worst, allgrad::dist::ReduceOp::Max)?;
    println!(
        "bench_ring_memory: rank {r}/{w} loss {} form {} local_batch {} dim {} tile {} step_s {:.6} heap_step_mib {:.1} \
         peak_rss_step_mib {:.1}",
        args.loss,
        args.form,
        args.local_batch,
        args.dim,
        args.tile,
        worst[0],
        mib(machine::heap_peak().saturating_sub(heap0)),
        status_mib("VmHWM:")? - rss0,
    );
    Ok(())
}
