//! How the step benchmarks (`bench_simclr_step`, `bench_simcse_step`, `bench_clip_step`)
//! alternate allgrad's step with the PyTorch peer's and print the step table and the layer breakdown.

use crate::machine::summary;
use crate::peer::Peer;
use crate::sample::{measured, stat, Sample};

/// The step table: min / median / max of each figure for allgrad (`a`) and PyTorch (`b`),
/// the ratio of medians, and a warning when other processes took CPU time meanwhile.
pub fn print_steps(a: &[Sample], b: &[Sample]) {
    let cell = |s: Option<(f64, f64, f64)>, scale: f64| match s {
        Some((lo, med, hi)) => format!("{:>9.3} {:>9.3} {:>9.3}", lo * scale, med * scale, hi * scale),
        None => format!("{:>29}", "-"),
    };
    println!("{:<28} {:>29}   {:>29}   {:>7}", "per step", "allgrad min / median / max", "PyTorch min / median / max", "ratio");
    let rows = [
        ("wall s", "wall", 1.0),
        ("  forward s", "fwd", 1.0),
        ("  backward s", "bwd", 1.0),
        ("  optimizer s", "opt", 1.0),
        ("user CPU s", "user", 1.0),
        ("system CPU s", "sys", 1.0),
        ("minor page faults (x1000)", "minflt", 1e-3),
        ("  in the backward (x1000)", "bwd_minflt", 1e-3),
        ("backward allocations (x1000)", "bwd_allocs", 1e-3),
        ("backward allocated MiB", "bwd_alloc_mib", 1.0),
        ("backward strided copies", "bwd_copies", 1.0),
        ("backward copied MiB", "bwd_copy_mib", 1.0),
        ("others' CPU s meanwhile", "others", 1.0),
        ("peak device memory MiB", "gpu_peak", 1.0),
        ("device memory reserved MiB", "gpu_reserved", 1.0),
        ("device reads, forward", "reads_fwd", 1.0),
        ("device reads, backward", "reads_bwd", 1.0),
        ("device reads, optimizer", "reads_opt", 1.0),
        ("host uploads", "uploads", 1.0),
        ("cuDNN heuristic queries", "cudnn_queries", 1.0),
    ];
    for (label, key, scale) in rows {
        let (sa, sb) = (stat(a, key), stat(b, key));
        if sa.is_none() && sb.is_none() {
            // A figure neither side measured (device memory on the CPU).
            continue;
        }
        let ratio = match (sa, sb) {
            (Some((_, x, _)), Some((_, y, _))) if y > 0.0 => format!("{:.2}x", x / y),
            _ => "-".into(),
        };
        println!("{label:<28} {}   {}   {ratio:>7}", cell(sa, scale), cell(sb, scale));
    }
    println!(
        "(ratio: allgrad median / PyTorch median; others' CPU: busy CPU seconds of the machine minus the stepping process's own; \
         peak device memory: allgrad's memory-pool high watermark, PyTorch's max_memory_allocated, over each step;"
    );
    println!(
        " backward allocations: allgrad's, through a counting allocator (PyTorch's are not counted); strided copies: \
         allgrad-nn's kernels' copies of strided inputs (Candle's own contiguous copies are not among them); \
         reads, uploads, cuDNN queries: allgrad's host traffic per step, each read a wait for the device)"
    );
    let others: f64 = [a, b].iter().filter_map(|s| Some(stat(s, "others")?.1 / stat(s, "wall")?.1)).fold(0.0, f64::max);
    if others > OTHERS_BUSY {
        println!(
            "WARNING: other processes used {:.0}% of a CPU during the steps (median): these timings are not figures",
            100.0 * others
        );
    }
}

/// Share of one CPU that other processes may take during the steps before the run counts as
/// disturbed.
const OTHERS_BUSY: f64 = 0.05;

/// Prints the peer's banner, warms both sides up with one step each (the first step allocates
/// and faults in everything), then measures `rounds` steps alternating ours and the peer's,
/// and prints the table; returns both sides' samples.
pub fn alternate(
    rounds: usize,
    python: &str,
    mut ours: impl FnMut() -> anyhow::Result<Sample>,
    mut peer: Option<&mut Peer>,
) -> anyhow::Result<(Vec<Sample>, Vec<Sample>)> {
    if let Some(p) = peer.as_deref() {
        println!("PyTorch worker: {} ({python})", p.banner);
    }
    println!("{}", crate::machine::processor());
    ours()?;
    if let Some(p) = peer.as_deref_mut() {
        p.step()?;
    }
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        a.push(measured(&mut ours)?);
        if let Some(p) = peer.as_deref_mut() {
            b.push(measured(|| p.step())?);
        }
    }
    print_steps(&a, &b);
    Ok((a, b))
}

/// A benchmark's frame: pins rayon's and Candle's thread counts to `threads` (before any pool
/// starts: both read them once), prints the load average (warning above `busy_load`) and the
/// threads, runs `batches` with the interpreter of the PyTorch side (PYTHON, default python3),
/// then prints the load average and the total time.
pub fn session(threads: usize, busy_load: f64, batches: impl FnOnce(&str) -> anyhow::Result<()>) -> anyhow::Result<()> {
    for var in ["RAYON_NUM_THREADS", "CANDLE_NUM_THREADS"] {
        std::env::set_var(var, threads.to_string());
    }
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let started = std::time::Instant::now();
    crate::machine::report_load("before", Some(busy_load));
    println!("{}", crate::machine::processor());
    println!(
        "threads: allgrad {threads} (rayon {}, candle {}); steps alternate allgrad, PyTorch, allgrad, ...",
        rayon::current_num_threads(),
        candle_core::utils::get_num_threads()
    );
    batches(&python)?;
    crate::machine::report_load("after (includes this benchmark's own threads)", None);
    println!("total {:.0} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// Checks the step benchmarks' `--device` (`cpu` or `cuda`) and `--precision` (`full`, `tf32`
/// on CUDA, or `bf16`), and sets the process's TF32 switch from the latter.
pub fn device_and_precision(device: &str, precision: &str) -> anyhow::Result<()> {
    anyhow::ensure!(matches!(device, "cpu" | "cuda"), "--device must be cpu or cuda, not {device:?}");
    anyhow::ensure!(matches!(precision, "full" | "tf32" | "bf16"), "--precision must be full, tf32 or bf16, not {precision:?}");
    anyhow::ensure!(
        precision != "tf32" || device == "cuda",
        "--precision tf32 is a CUDA mode: pass --device cuda (on the CPU it is full)"
    );
    allgrad_nn::set_tf32(precision == "tf32");
    Ok(())
}

/// One layer breakdown: (kind, count, forward s, backward s) per layer type.
pub type LayerTable = Vec<(String, usize, f64, f64)>;

/// `rounds` layer breakdowns of ours and the peer's, alternating, after one warm-up each.
pub fn breakdown(
    rounds: usize,
    mut ours: impl FnMut() -> candle_core::Result<LayerTable>,
    mut peer: Option<&mut Peer>,
) -> anyhow::Result<(Vec<LayerTable>, Vec<LayerTable>)> {
    let (mut la, mut lb) = (Vec::new(), Vec::new());
    for r in 0..=rounds {
        let x = ours()?;
        let y = match peer.as_deref_mut() {
            Some(p) => p.layers()?,
            None => Vec::new(),
        };
        if r > 0 {
            la.push(x);
            lb.push(y);
        }
    }
    Ok((la, lb))
}

/// The breakdown table: per layer type (in `kinds` order) the medians of the forward and
/// min / median / max of the backward on each side and their ratios, the sums (forward sums
/// leave out the kinds in `forward_repeats`, whose forward another kind already timed), and the
/// step's phases beside them.
pub fn print_layers(kinds: &[&str], forward_repeats: &[&str], a: &[LayerTable], b: &[LayerTable], sa: &[Sample], sb: &[Sample]) {
    use std::collections::BTreeMap;
    // kind -> (count, forward seconds per round, backward seconds per round), per side.
    let collect = |rounds: &[LayerTable]| {
        let mut m: BTreeMap<String, (usize, Vec<f64>, Vec<f64>)> = BTreeMap::new();
        for round in rounds {
            for (kind, count, f, b) in round {
                let e = m.entry(kind.clone()).or_default();
                e.0 = *count;
                e.1.push(*f);
                e.2.push(*b);
            }
        }
        m
    };
    let (ma, mb) = (collect(a), collect(b));
    let med = |v: &[f64]| summary(v).map(|s| s.1);
    let fmt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.3}"));
    let range = |v: Option<(f64, f64, f64)>| v.map_or("-".to_string(), |(lo, _, hi)| format!("{lo:.3}-{hi:.3}"));
    let ratio = |x: Option<f64>, y: Option<f64>| match (x, y) {
        (Some(x), Some(y)) if y > 0.0 => format!("{:.2}x", x / y),
        _ => "-".into(),
    };
    println!("\n{}", crate::machine::processor());
    println!(
        "layer type, each layer timed alone (median and min-max over {} round(s), seconds summed over the layers of the type)",
        a.len()
    );
    println!(
        "{:<10} {:>5}   {:>9} {:>9} {:>7}   {:>9} {:>13} {:>9} {:>13} {:>7}",
        "type", "count", "fwd ours", "fwd torch", "ratio", "bwd ours", "(min-max)", "bwd torch", "(min-max)", "ratio"
    );
    let (mut tot_a, mut tot_b) = ([0.0; 2], [0.0; 2]);
    for &kind in kinds {
        let Some((count, fa, ba)) = ma.get(kind) else { continue };
        let (fa, sba) = (med(fa), summary(ba));
        let ba = sba.map(|s| s.1);
        let (fb, sbb) = mb.get(kind).map_or((None, None), |(_, f, b)| (med(f), summary(b)));
        let bb = sbb.map(|s| s.1);
        if !forward_repeats.contains(&kind) {
            tot_a[0] += fa.unwrap_or(0.0);
            tot_b[0] += fb.unwrap_or(0.0);
        }
        tot_a[1] += ba.unwrap_or(0.0);
        tot_b[1] += bb.unwrap_or(0.0);
        println!(
            "{kind:<10} {count:>5}   {:>9} {:>9} {:>7}   {:>9} {:>13} {:>9} {:>13} {:>7}",
            fmt(fa),
            fmt(fb),
            ratio(fa, fb),
            fmt(ba),
            range(sba),
            fmt(bb),
            range(sbb),
            ratio(ba, bb)
        );
    }
    let some = |v: f64, side: &[LayerTable]| (!side.is_empty() && !side[0].is_empty()).then_some(v);
    let (ta, tb) = ([some(tot_a[0], a), some(tot_a[1], a)], [some(tot_b[0], b), some(tot_b[1], b)]);
    let row = |name: &str, f: [Option<f64>; 2], g: [Option<f64>; 2]| {
        println!(
            "{name:<10} {:>5}   {:>9} {:>9} {:>7}   {:>9} {:>13} {:>9} {:>13} {:>7}",
            "",
            fmt(f[0]),
            fmt(g[0]),
            ratio(f[0], g[0]),
            fmt(f[1]),
            "",
            fmt(g[1]),
            "",
            ratio(f[1], g[1])
        )
    };
    row("sum", [ta[0], ta[1]], [tb[0], tb[1]]);
    let phase = |s: &[Sample], k| stat(s, k).map(|x| x.1);
    row("in step", [phase(sa, "fwd"), phase(sa, "bwd")], [phase(sb, "fwd"), phase(sb, "bwd")]);
    println!("(\"in step\": the medians of the step's phases above; the gap to \"sum\" is what isolated layers miss:");
    println!(" graph bookkeeping, gradient accumulation, copies between layers, cache effects. allgrad's backward per");
    println!(" layer is a difference of two timings, see crates/allgrad-bench/src/bin/bench_simclr_step/layers.rs)");
}
