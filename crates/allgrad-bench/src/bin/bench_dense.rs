//! The dense layers of the CLIP step (`bench_clip_step`'s towers), one product at a time,
//! allgrad against PyTorch in ONE invocation: for each layer shape `(rows, in, out)` the forward
//! `x·Wᵀ + b`, the input gradient `∂x = ∂Y·W`, the weight gradient `∂W = ∂Yᵀ·x` and the bias
//! gradient `∂b = Σ_rows ∂Y`, in f32 on the CPU. allgrad's side runs the kernels
//! `allgrad_nn::linear` runs (`allgrad_nn::dense_product`); PyTorch's
//! (`scripts/bench/bench_dense.py --worker`, interpreter from `PYTHON`) runs `addmm`, `mm`,
//! `mm` and `sum`, as its autograd does for `nn.Linear`. For every product the two alternate,
//! `--reps` timed calls of one side then of the other, `--rounds` times, each side on
//! `--threads` threads (rayon's pool here; torch.set_num_threads and OMP/MKL there). It prints
//! min / median of each side and the ratio of medians per product, then the products summed
//! over the step's layers (each shape times its count in the two towers; the patch embedding's
//! input gradient left out: neither side computes it, its input being pixels).
//!
//! ```text
//! scripts/bench/bench_dense.sh                                 # batch 128, 5 rounds of 3 calls
//! scripts/bench/bench_dense.sh --batch 64 --only "vision fc"   # some layers
//! scripts/bench/bench_dense.sh --batch 2 --rounds 1 --reps 1   # a quick check
//! ```
//!
//! The shapes are those of `bench_clip_step`'s default towers at `--batch` image-caption pairs:
//! the image tower (224 px, patch 32: 49 patches and the class token, width 384, MLP 1536,
//! 6 blocks) and the text tower (context 77, width 256, MLP 1024, 6 blocks); the two
//! projections to the embedding (one row per pair) are left out (under 1% of the products).

use std::time::Instant;

use allgrad_bench::machine::summary;
use allgrad_bench::peer::Peer;
use allgrad_bench::report::session;
use clap::Parser;

/// Alternating allgrad / PyTorch benchmark of the CLIP step's dense-layer products.
#[derive(Parser)]
struct Args {
    /// Image-caption pairs of the step whose layers are timed.
    #[arg(long, default_value_t = 128)]
    batch: usize,
    /// Alternations per product (each side's `--reps` calls, then the other's).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Timed calls of one side per round (after one untimed call per side and product).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Threads of each side.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Only the layers whose name contains this text (e.g. "text", "fc1").
    #[arg(long)]
    only: Option<String>,
    /// Products, comma-separated, of fwd, dx, dw, db.
    #[arg(long, default_value = "fwd,dx,dw,db")]
    products: String,
    /// allgrad only.
    #[arg(long)]
    no_torch: bool,
    /// 1-minute load average above which the machine counts as busy.
    #[arg(long, default_value_t = 0.5)]
    busy_load: f64,
}

/// One dense layer of the step: `rows` input rows of `inp` features to `out`, `count` of them.
struct Layer {
    name: &'static str,
    rows: usize,
    inp: usize,
    out: usize,
    count: usize,
    /// Whether the step computes its input gradient (not for the patch embedding's pixels).
    input_grad: bool,
}

fn layers(batch: usize) -> Vec<Layer> {
    let (image, text) = (batch * 50, batch * 77);
    let layer = |name, rows, inp, out, count| Layer { name, rows, inp, out, count, input_grad: true };
    vec![
        Layer { name: "vision patch", rows: batch * 49, inp: 3 * 32 * 32, out: 384, count: 1, input_grad: false },
        layer("vision qkv", image, 384, 3 * 384, 6),
        layer("vision out", image, 384, 384, 6),
        layer("vision fc1", image, 384, 1536, 6),
        layer("vision fc2", image, 1536, 384, 6),
        layer("text qkv", text, 256, 3 * 256, 6),
        layer("text out", text, 256, 256, 6),
        layer("text fc1", text, 256, 1024, 6),
        layer("text fc2", text, 1024, 256, 6),
    ]
}

/// `n` values uniform in [-1, 1) from a fixed xorshift sequence.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.threads > 0 && args.rounds > 0 && args.reps > 0, "--threads, --rounds and --reps must be positive");
    anyhow::ensure!(args.batch > 0, "--batch must be at least 1");
    let products: Vec<&str> = args.products.split(',').map(str::trim).collect();
    for p in &products {
        anyhow::ensure!(["fwd", "dx", "dw", "db"].contains(p), "--products: {p:?} is not one of fwd, dx, dw, db");
    }
    let layers: Vec<Layer> =
        layers(args.batch).into_iter().filter(|l| args.only.as_deref().is_none_or(|o| l.name.contains(o))).collect();
    anyhow::ensure!(!layers.is_empty(), "--only {:?} matches no layer", args.only.unwrap_or_default());
    session(args.threads, args.busy_load, |python| {
        let mut peer = if args.no_torch {
            None
        } else {
            Peer::spawn(python, "scripts/bench/bench_dense.py", args.batch, &[("threads", args.threads.to_string())])?
        };
        if let Some(p) = &peer {
            println!("PyTorch worker: {} ({python})", p.banner);
        }
        println!(
            "\n== batch {}, f32, {} rounds of {} calls per side; seconds per call, min / median\n{:<13} {:<4} {:>19} {:>19} {:>7}",
            args.batch, args.rounds, args.reps, "layer", "op", "allgrad", "PyTorch", "ratio"
        );
        // Per product: (allgrad, PyTorch) medians times the layers' counts.
        let mut totals = vec![(0.0, 0.0); products.len()];
        for l in &layers {
            let d = (l.rows, l.inp, l.out);
            let x = values(l.rows * l.inp, 1);
            let w = values(l.out * l.inp, 2);
            let b = values(l.out, 3);
            let g = values(l.rows * l.out, 4);
            for (pi, &product) in products.iter().enumerate() {
                if product == "dx" && !l.input_grad {
                    continue;
                }
                let run = || {
                    let t = Instant::now();
                    let y = allgrad_nn::dense_product(product, [&x, &w, &b, &g], d).expect("a checked product");
                    std::hint::black_box(y);
                    t.elapsed().as_secs_f64()
                };
                run();
                let (mut ours, mut theirs) = (Vec::new(), Vec::new());
                let cmd = format!("time {product} {} {} {} {}", l.rows, l.inp, l.out, args.reps);
                for _ in 0..args.rounds {
                    ours.extend((0..args.reps).map(|_| run()));
                    if let Some(p) = peer.as_mut() {
                        for line in p.lines(&cmd)? {
                            let rest = line
                                .strip_prefix("TIMES ")
                                .ok_or_else(|| anyhow::anyhow!("the PyTorch worker answered {line:?} to {cmd:?}"))?;
                            for t in rest.split_whitespace() {
                                theirs.push(t.parse::<f64>().map_err(|e| anyhow::anyhow!("the PyTorch worker's {t:?}: {e}"))?);
                            }
                        }
                    }
                }
                let (a, t) = (summary(&ours), summary(&theirs));
                let cell =
                    |s: Option<(f64, f64, f64)>| s.map_or(format!("{:>19}", "-"), |(lo, med, _)| format!("{lo:>9.4} {med:>9.4}"));
                let ratio = match (a, t) {
                    (Some((_, x, _)), Some((_, y, _))) if y > 0.0 => format!("{:.2}x", x / y),
                    _ => "-".into(),
                };
                println!("{:<13} {:<4} {} {} {ratio:>7}", l.name, product, cell(a), cell(t));
                let count = l.count as f64;
                totals[pi].0 += a.map_or(0.0, |s| s.1) * count;
                totals[pi].1 += t.map_or(0.0, |s| s.1) * count;
            }
        }
        println!("\nsummed over the step's layers (median x count), seconds:");
        let (mut all_a, mut all_t) = (0.0, 0.0);
        for (p, (a, t)) in products.iter().zip(&totals) {
            let ratio = if *t > 0.0 { format!("{:.2}x", a / t) } else { "-".into() };
            println!("{p:<4} allgrad {a:>8.3}  PyTorch {t:>8.3}  {ratio:>7}");
            (all_a, all_t) = (all_a + a, all_t + t);
        }
        let ratio = if all_t > 0.0 { format!("{:.2}x", all_a / all_t) } else { "-".into() };
        println!("all  allgrad {all_a:>8.3}  PyTorch {all_t:>8.3}  {ratio:>7}");
        Ok(())
    })
}
