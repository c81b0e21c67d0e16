//! Peak memory of one SimCLR training step on the CPU, allgrad's side: the step of
//! `bench_simclr_step` (`allgrad_bench::simclr_step`: ResNet-18 or -50 with the CIFAR stem, projector
//! (features)-2048-128, NT-Xent, SGD) on `2 * batch` random 3x32x32 views, in a process of its
//! own. `scripts/bench/bench_step_memory.sh` runs it and PyTorch's side
//! (`scripts/bench/bench_simclr_step.py --memory`), each in its own process, and prints the table.
//!
//! It prints one line, `MEM side=allgrad ...` with, in MiB:
//! - `setup`: the resident set (VmRSS) once the model, optimizer and input exist (after one
//!   step of a separate model at `--warmup-batch`, so that the code the step runs is resident:
//!   the program's pages are not the step's memory; what that step freed is returned to the
//!   system with `malloc_trim`);
//! - `fwd`: the resident set at the end of the first step's forward (what the graph keeps);
//! - `peak`: the peak resident set (VmHWM, reset after the setup through
//!   `/proc/self/clear_refs`) over `--steps` steps;
//! - `heap_setup`, `heap_fwd`, `heap_peak`: the same three figures as bytes held by the Rust
//!   allocator (a counting wrapper around the system allocator: live bytes, without the
//!   allocator's own retention or fragmentation; PyTorch has no such counter on the CPU), and
//!   `heap_fwd_peak`, `heap_bwd_peak`: its peak within the forwards and within the backwards.
//!
//! The allocator is tuned as the train binary tunes it (`allgrad::tune_allocator`), so freed
//! memory stays in the process and the resident peak includes what the allocator keeps.
//!
//! ```text
//! cargo run --release -p allgrad-bench --bin bench_step_memory -- --depth 18 --batch 64
//! ```

use allgrad_bench::machine;
use allgrad_bench::simclr_step::AllgradStep;
use clap::Parser;

#[global_allocator]
static ALLOC: machine::Peak = machine::Peak;

/// Peak memory of allgrad's SimCLR step.
#[derive(Parser)]
struct Args {
    /// Samples per step (a step sees two views of each).
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// ResNet depth: 18 or 50.
    #[arg(long, default_value_t = 18)]
    depth: usize,
    /// Channels of the first ResNet stage.
    #[arg(long, default_value_t = 64)]
    width: usize,
    /// Steps measured (the peak is over all of them).
    #[arg(long, default_value_t = 2)]
    steps: usize,
    /// Threads (rayon's and Candle's pools).
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Before the setup, one step of a separate model at this batch (0: none), so that the
    /// code the step runs is resident before the figures are taken.
    #[arg(long, default_value_t = 2)]
    warmup_batch: usize,
    /// `full` (f32) or `bf16` (the forward under bf16 autocast, as `precision: bf16`).
    #[arg(long, default_value = "full")]
    precision: String,
}

/// A `kB` field of `/proc/self/status` in MiB.
fn status_mib(field: &str) -> anyhow::Result<f64> {
    let s = std::fs::read_to_string("/proc/self/status")?;
    let line = s.lines().find(|l| l.starts_with(field)).ok_or_else(|| anyhow::anyhow!("no {field} in /proc/self/status"))?;
    let kb: f64 = line[field.len()..].trim().trim_end_matches("kB").trim().parse()?;
    Ok(kb / 1024.0)
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn main() -> anyhow::Result<()> {
    allgrad::tune_allocator();
    let args = Args::parse();
    anyhow::ensure!(args.threads > 0 && args.steps > 0 && args.batch > 0, "--threads, --steps and --batch must be positive");
    anyhow::ensure!(matches!(args.depth, 18 | 50), "--depth must be 18 or 50, not {}", args.depth);
    anyhow::ensure!(
        matches!(args.precision.as_str(), "full" | "bf16"),
        "--precision must be full or bf16, not {}",
        args.precision
    );
    let bf16 = args.precision == "bf16";
    for var in ["RAYON_NUM_THREADS", "CANDLE_NUM_THREADS"] {
        std::env::set_var(var, args.threads.to_string());
    }
    if args.warmup_batch > 0 {
        // Faults in the program's code and first allocations, which are not the step's.
        AllgradStep::new(args.warmup_batch, args.width, args.depth, &candle_core::Device::Cpu)?.bf16(bf16).run()?;
        // What the warm-up freed goes back to the system, so that the step cannot reuse it
        // unseen (the tuned allocator keeps freed memory).
        // SAFETY: malloc_trim only returns free memory of the allocator's arenas to the system.
        unsafe { libc::malloc_trim(0) };
    }
    let mut step = AllgradStep::new(args.batch, args.width, args.depth, &candle_core::Device::Cpu)?.bf16(bf16);
    let (setup, heap_setup) = (status_mib("VmRSS:")?, machine::heap_live());
    // Writing 5 resets the peak resident set to the current one (Linux 4.0 and later).
    std::fs::write("/proc/self/clear_refs", "5")?;
    machine::reset_heap_peak(heap_setup);
    let mut at_fwd = None;
    // The allocator's peak within each phase, over the steps.
    let (mut fwd_peak, mut bwd_peak) = (0usize, 0usize);
    for _ in 0..args.steps {
        step.run_probed(&mut |phase| {
            if phase == "fwd" && at_fwd.is_none() {
                at_fwd = Some((status_mib("VmRSS:").unwrap_or(f64::NAN), machine::heap_live()));
            }
            let peak = machine::reset_heap_peak(machine::heap_live());
            match phase {
                "fwd" => fwd_peak = fwd_peak.max(peak),
                "bwd" => bwd_peak = bwd_peak.max(peak),
                _ => {}
            }
        })?;
    }
    let heap_peak = fwd_peak.max(bwd_peak).max(machine::heap_peak());
    let (fwd, heap_fwd) = at_fwd.unwrap_or((f64::NAN, 0));
    println!(
        "MEM side=allgrad depth={} batch={} precision={} threads={} steps={} warmup_batch={} setup={setup:.0} fwd={fwd:.0} peak={:.0} \
         heap_setup={:.0} heap_fwd={:.0} heap_peak={:.0} heap_fwd_peak={:.0} heap_bwd_peak={:.0}",
        args.depth,
        args.batch,
        args.precision,
        args.threads,
        args.steps,
        args.warmup_batch,
        status_mib("VmHWM:")?,
        mib(heap_setup),
        mib(heap_fwd),
        mib(heap_peak),
        mib(fwd_peak),
        mib(bwd_peak),
    );
    Ok(())
}
