//! `bench_collectives`: benchmarks of allgrad's CPU collectives backend.
//!
//! ```text
//! cargo run --release -p allgrad-bench --bin bench_collectives -- --nproc 2 \
//!     [--min-bytes 1K] [--max-bytes 256M] [--ops all_reduce,all_gather,reduce_scatter] \
//!     [--iters N] [--warmup N] [--dtype f32] [--json rows.jsonl]
//! ```
//!
//! Ranks are processes. Run without RANK in the environment, the binary is its own launcher:
//! it picks a free loopback port and a random job token, starts itself `--nproc` times with
//! the torchrun variables set, and waits for every rank (if one fails, it kills the others and
//! exits non-zero). Run with RANK set (by torchrun, srun, or the launcher), it is one rank.
//!
//! Sizes follow nccl-tests: powers of two from `--min-bytes` to `--max-bytes`; for all_gather
//! the size is the output (each rank contributes size/W), for reduce_scatter the input (each
//! rank keeps size/W). Times are per call, the maximum over ranks of the mean over the timed
//! iterations. algbw = size / time; busbw = algbw * 2(W-1)/W for all_reduce and algbw * (W-1)/W
//! for all_gather and reduce_scatter, so busbw is comparable across world sizes and against
//! the link bandwidth. `scripts/bench/bench_gloo.py` measures the same table with PyTorch's gloo.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use allgrad_dist::{Elem, ProcessGroup, ReduceOp};
use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, Parser};

/// Auto iteration count: about this many bytes per size, between MIN_ITERS and MAX_ITERS
/// (the same rule as scripts/bench/bench_gloo.py, so both run the same number of calls).
const ITER_BYTES: u64 = 1 << 30;
const MIN_ITERS: u64 = 5;
const MAX_ITERS: u64 = 100;

#[derive(Parser)]
#[command(
    name = "bench_collectives",
    about = "nccl-tests-style sweep of allgrad's CPU all_reduce / all_gather / reduce_scatter over message sizes"
)]
struct Cli {
    #[command(flatten)]
    args: CollArgs,
}

#[derive(Args, Clone, Debug)]
struct CollArgs {
    /// Number of ranks (processes) to launch; ignored when RANK is set (then WORLD_SIZE rules).
    #[arg(long, default_value_t = 2)]
    nproc: usize,
    /// Smallest message size (bytes; K, M, G suffixes are powers of 1024).
    #[arg(long, default_value = "1K", value_parser = parse_bytes)]
    min_bytes: u64,
    /// Largest message size (bytes; K, M, G suffixes are powers of 1024).
    #[arg(long, default_value = "256M", value_parser = parse_bytes)]
    max_bytes: u64,
    /// Comma-separated collectives: all_reduce, all_gather, reduce_scatter.
    #[arg(long, default_value = "all_reduce,all_gather,reduce_scatter", value_parser = parse_ops)]
    ops: OpList,
    /// Timed iterations per size (default: about 1 GiB of messages per size, 5 to 100).
    #[arg(long)]
    iters: Option<u64>,
    /// Warmup iterations per size (default: a fifth of the timed ones, 2 to 10).
    #[arg(long)]
    warmup: Option<u64>,
    /// Element type: f32 or f64.
    #[arg(long, default_value = "f32", value_parser = ["f32", "f64"])]
    dtype: String,
    /// Also write the rows as JSON lines to this file (rank 0 writes it).
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    AllReduce,
    AllGather,
    ReduceScatter,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
        }
    }
    /// nccl-tests' bus bandwidth factor.
    fn bus_factor(self, w: usize) -> f64 {
        let w = w as f64;
        match self {
            Op::AllReduce => 2.0 * (w - 1.0) / w,
            Op::AllGather | Op::ReduceScatter => (w - 1.0) / w,
        }
    }
}

#[derive(Clone, Debug)]
struct OpList(Vec<Op>);

fn parse_ops(s: &str) -> Result<OpList, String> {
    let mut ops = Vec::new();
    for name in s.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        let op = match name.to_ascii_lowercase().replace('-', "_").as_str() {
            "all_reduce" | "allreduce" => Op::AllReduce,
            "all_gather" | "allgather" => Op::AllGather,
            "reduce_scatter" | "reducescatter" => Op::ReduceScatter,
            _ => return Err(format!("unknown collective {name:?} (expected all_reduce, all_gather, reduce_scatter)")),
        };
        if !ops.contains(&op) {
            ops.push(op);
        }
    }
    if ops.is_empty() {
        return Err("no collective given".into());
    }
    Ok(OpList(ops))
}

/// "4096", "1K", "256M", "1G", "2KiB", "8MB" (all suffixes are powers of 1024).
fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("{s:?} is not a size (e.g. 4096, 1K, 256M, 1G)"))?;
    let mult: u64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "K" | "KB" | "KIB" => 1 << 10,
        "M" | "MB" | "MIB" => 1 << 20,
        "G" | "GB" | "GIB" => 1 << 30,
        _ => return Err(format!("{s:?}: unknown unit {unit:?} (use K, M or G)")),
    };
    let v = n.checked_mul(mult).ok_or_else(|| format!("{s:?} is too large"))?;
    if v == 0 {
        return Err(format!("{s:?}: the size must be positive"));
    }
    Ok(v)
}

fn main() {
    let cli = Cli::parse();
    let args = cli.args;
    let code = match run(args) {
        Ok(code) => code,
        Err(e) => {
            let who = std::env::var("RANK").map(|r| format!("[rank {r}] ")).unwrap_or_default();
            eprintln!("{who}error: {e:#}");
            1
        }
    };
    std::process::exit(code);
}

fn run(args: CollArgs) -> Result<i32> {
    if args.min_bytes > args.max_bytes {
        bail!("--min-bytes ({}) is larger than --max-bytes ({})", args.min_bytes, args.max_bytes);
    }
    if args.iters == Some(0) {
        bail!("--iters must be at least 1");
    }
    if std::env::var_os("RANK").is_some() {
        run_rank(&args)?;
        Ok(0)
    } else {
        launch(&args)
    }
}

/// Starts `--nproc` ranks of this same program through allgrad's launcher.
fn launch(args: &CollArgs) -> Result<i32> {
    if args.nproc == 0 {
        bail!("--nproc must be at least 1");
    }
    if let Some(p) = &args.json {
        // Fail here, before starting ranks, when the output cannot be written (rank 0 rewrites it).
        std::fs::File::create(p).with_context(|| format!("creating the JSON output {}", p.display()))?;
    }
    let exe = std::env::current_exe().context("finding this executable to start the ranks")?;
    let mut program = vec![exe.to_string_lossy().into_owned()];
    program.extend(std::env::args().skip(1));
    let cfg = allgrad::launch::LaunchConfig {
        prefix: false,
        grace: Duration::from_secs(2),
        ..allgrad::launch::LaunchConfig::new(args.nproc, program)
    };
    Ok(allgrad::launch::launch(&cfg)?.exit_code())
}

// ------------------------------------------------------------------------------ rank

struct Row {
    op: Op,
    bytes: u64,
    count: u64,
    iters: u64,
    warmup: u64,
    time_us: f64,
    algbw: f64,
    busbw: f64,
}

fn run_rank(args: &CollArgs) -> Result<()> {
    let pg = ProcessGroup::from_env().context("joining the job (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")?;
    let out = match args.dtype.as_str() {
        "f32" => sweep::<f32>(&pg, args),
        "f64" => sweep::<f64>(&pg, args),
        d => Err(anyhow!("unsupported --dtype {d:?} (f32 or f64)")),
    };
    if let Err(e) = &out {
        // Tell the peers why, so they fail at once naming this rank.
        pg.abort(&format!("{e:#}"));
    }
    out
}

fn sizes(min: u64, max: u64) -> Vec<u64> {
    let mut v = Vec::new();
    let mut s = min;
    while s <= max {
        v.push(s);
        match s.checked_mul(2) {
            Some(n) => s = n,
            None => break,
        }
    }
    v
}

fn iters_for(bytes: u64, args: &CollArgs) -> (u64, u64) {
    let iters = args.iters.unwrap_or_else(|| (ITER_BYTES / bytes.max(1)).clamp(MIN_ITERS, MAX_ITERS));
    let warmup = args.warmup.unwrap_or_else(|| (iters / 5).clamp(2, 10));
    (iters, warmup)
}

fn sweep<T: Elem>(pg: &ProcessGroup, args: &CollArgs) -> Result<()> {
    let w = pg.world_size();
    let rank = pg.rank();
    let esz = T::DTYPE.size_in_bytes() as u64;
    let mut json = match (&args.json, rank) {
        (Some(p), 0) => Some(std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("creating the JSON output {}", p.display()))?,
        )),
        _ => None,
    };
    if rank == 0 {
        println!("# bench_collectives: allgrad-dist CPU backend, {w} ranks (processes), dtype {}", args.dtype);
        if pg.shared_memory() {
            println!("# transport: shared memory for messages of 64 KiB and more, loopback TCP below (ALLGRAD_SHM=0: TCP only)");
        } else {
            println!("# transport: TCP");
        }
        println!("# size: all_reduce buffer; all_gather output (size/W per rank); reduce_scatter input (size/W per rank)");
        println!("# time: max over ranks of the mean per call; busbw factor 2(W-1)/W (all_reduce), (W-1)/W (others)");
        println!("#");
        println!(
            "{:>15} {:>13} {:>12} {:>5} {:>6} {:>12} {:>12} {:>12}",
            "op", "size(B)", "count", "type", "iters", "time(us)", "algbw(GB/s)", "busbw(GB/s)"
        );
    }
    for &op in &args.ops.0 {
        for size in sizes(args.min_bytes, args.max_bytes) {
            // Elements per rank's block (all_gather input / reduce_scatter output) or per buffer.
            let (count, bytes) = match op {
                Op::AllReduce => (size / esz, size / esz * esz),
                Op::AllGather | Op::ReduceScatter => {
                    let per = size / esz / w as u64;
                    (per * w as u64, per * w as u64 * esz)
                }
            };
            if count == 0 || (op != Op::AllReduce && count < w as u64) {
                continue;
            }
            let (iters, warmup) = iters_for(bytes, args);
            let secs =
                time_op::<T>(pg, op, count as usize, iters, warmup).with_context(|| format!("{} of {bytes} bytes", op.name()))?;
            if rank != 0 {
                continue;
            }
            let per_call = secs / iters as f64;
            let algbw = bytes as f64 / per_call.max(1e-12) / 1e9;
            let row = Row { op, bytes, count, iters, warmup, time_us: per_call * 1e6, algbw, busbw: algbw * op.bus_factor(w) };
            println!(
                "{:>15} {:>13} {:>12} {:>5} {:>6} {:>12.1} {:>12.3} {:>12.3}",
                op.name(),
                row.bytes,
                row.count,
                args.dtype,
                row.iters,
                row.time_us,
                row.algbw,
                row.busbw
            );
            let _ = std::io::stdout().flush();
            if let Some(f) = json.as_mut() {
                let line = json_line(&row, &args.dtype, w);
                writeln!(f, "{line}")
                    .and_then(|_| f.flush())
                    .with_context(|| format!("writing {}", show(args.json.as_deref())))?;
            }
        }
    }
    pg.barrier().context("final barrier")?;
    Ok(())
}

fn show(p: Option<&Path>) -> String {
    p.map(|p| p.display().to_string()).unwrap_or_default()
}

fn json_line(r: &Row, dtype: &str, w: usize) -> String {
    let mut s = String::new();
    let _ = write!(
        s,
        "{{\"impl\":\"allgrad\",\"op\":\"{}\",\"bytes\":{},\"count\":{},\"dtype\":\"{}\",\"world_size\":{},\"iters\":{},\"warmup\":{},\"time_us\":{:.3},\"algbw_gbps\":{:.6},\"busbw_gbps\":{:.6}}}",
        r.op.name(), r.bytes, r.count, dtype, w, r.iters, r.warmup, r.time_us, r.algbw, r.busbw
    );
    s
}

/// Value of element `i` of rank `r`'s input: small integers, exact in any float type.
fn val(r: usize, i: usize) -> f64 {
    (r + 1) as f64 + (i % 7) as f64
}

/// Checks one call's result, then runs `warmup` and `iters` calls; returns the timed seconds
/// (the maximum over ranks).
fn time_op<T: Elem>(pg: &ProcessGroup, op: Op, count: usize, iters: u64, warmup: u64) -> Result<f64> {
    let w = pg.world_size();
    let r = pg.rank();
    let wsum = (w * (w + 1) / 2) as f64;
    let per = count / w;
    let mut elapsed = [0f64];
    match op {
        Op::AllReduce => {
            let mut buf: Vec<T> = (0..count).map(|i| T::from_f64(val(r, i))).collect();
            pg.all_reduce_slice(&mut buf, ReduceOp::Sum).context("checked call")?;
            check(&buf, |i| wsum + (w * (i % 7)) as f64, "all_reduce")?;
            // Repeated in-place sums would overflow; zeros keep every call's work the same.
            buf.iter_mut().for_each(|x| *x = T::from_f64(0.0));
            for _ in 0..warmup {
                pg.all_reduce_slice(&mut buf, ReduceOp::Sum)?;
            }
            pg.barrier()?;
            let t = Instant::now();
            for _ in 0..iters {
                pg.all_reduce_slice(&mut buf, ReduceOp::Sum)?;
            }
            elapsed[0] = t.elapsed().as_secs_f64();
        }
        Op::AllGather => {
            let own: Vec<T> = (0..per).map(|i| T::from_f64(val(r, i))).collect();
            let out = pg.all_gather_slice(&own).context("checked call")?;
            check(&out, |i| val(i / per, i % per), "all_gather")?;
            drop(out);
            // Timed calls write into a preallocated output, as nccl-tests and gloo's
            // all_gather_into_tensor do.
            let mut out = vec![T::from_f64(0.0); per * w];
            for _ in 0..warmup {
                pg.all_gather_into(&own, &mut out)?;
            }
            pg.barrier()?;
            let t = Instant::now();
            for _ in 0..iters {
                pg.all_gather_into(&own, &mut out)?;
            }
            elapsed[0] = t.elapsed().as_secs_f64();
        }
        Op::ReduceScatter => {
            let input: Vec<T> = (0..count).map(|i| T::from_f64(val(r, i))).collect();
            let counts = vec![per; w];
            let out = pg.reduce_scatter_slice(&input, ReduceOp::Sum, &counts).context("checked call")?;
            check(&out, |i| wsum + (w * ((r * per + i) % 7)) as f64, "reduce_scatter")?;
            drop(out);
            let mut out = vec![T::from_f64(0.0); per];
            for _ in 0..warmup {
                pg.reduce_scatter_into(&input, ReduceOp::Sum, &counts, &mut out)?;
            }
            pg.barrier()?;
            let t = Instant::now();
            for _ in 0..iters {
                pg.reduce_scatter_into(&input, ReduceOp::Sum, &counts, &mut out)?;
            }
            elapsed[0] = t.elapsed().as_secs_f64();
        }
    }
    pg.all_reduce_slice(&mut elapsed, ReduceOp::Max).context("gathering the timings")?;
    Ok(elapsed[0])
}

fn check<T: Elem>(got: &[T], want: impl Fn(usize) -> f64, what: &str) -> Result<()> {
    if let Some((i, g)) = got.iter().enumerate().find(|(i, g)| g.to_f64() != want(*i)) {
        bail!("{what} returned a wrong result: element {i} is {}, expected {}", g.to_f64(), want(i));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_bytes("1K"), Ok(1024));
        assert_eq!(parse_bytes("256M"), Ok(256 << 20));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("2KiB"), Ok(2048));
        assert!(parse_bytes("1T").is_err());
        assert!(parse_bytes("0").is_err());
        assert!(parse_bytes("x").is_err());
        assert_eq!(sizes(1024, 4096), vec![1024, 2048, 4096]);
    }

    #[test]
    fn ops_parse() {
        assert_eq!(parse_ops("all_reduce, allgather").unwrap().0, vec![Op::AllReduce, Op::AllGather]);
        assert!(parse_ops("broadcast").is_err());
    }
}
