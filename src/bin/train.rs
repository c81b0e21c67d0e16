//! `train`: one rank of a training run.
//!
//! ```text
//! train --config configs/vectors.yaml [--set optim.lr=0.1 ...] [--output-dir DIR] [--resume]
//! launch --nproc-per-node 2 train --config configs/vectors.yaml
//! ```
//!
//! Without launcher variables it is a world of one rank; under `launch`, torchrun or srun it
//! joins the job they describe.

use std::path::PathBuf;

use allgrad::dist::ProcessGroup;
use allgrad_train::{run, RunConfig};
use clap::Parser;

/// Train the method a config describes, on this rank.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// The run's YAML config.
    #[arg(long)]
    config: PathBuf,
    /// Override a config value: `--set optim.lr=0.1` (repeatable; the value is parsed as YAML).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Run directory (default: runs/<config name>).
    #[arg(long)]
    output_dir: Option<PathBuf>,
    /// Continue from the newest checkpoint in the run directory.
    #[arg(long)]
    resume: bool,
    /// Stop (with a checkpoint) once this many steps are done; `--resume` continues later.
    #[arg(long, value_name = "STEPS")]
    stop_after: Option<usize>,
}

fn main() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("ALLGRAD_LOG").unwrap_or_else(|_| "info".into());
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(false).init();
    let args = Args::parse();
    std::process::exit(match main_inner(&args) {
        Ok(()) => 0,
        Err((code, msg)) => {
            eprintln!("train: error: {msg}");
            code
        }
    });
}

fn main_inner(args: &Args) -> Result<(), (i32, String)> {
    let cfg = RunConfig::load(&args.config, &args.set).map_err(|e| (2, e.to_string()))?;
    let pg = ProcessGroup::from_env().map_err(|e| (1, e.to_string()))?;
    cfg.validate(pg.world_size(), &args.config).map_err(|e| (2, e.to_string()))?;
    let out_dir = args.output_dir.clone().unwrap_or_else(|| {
        let stem = args.config.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "run".into());
        PathBuf::from("runs").join(stem)
    });
    if !args.resume && out_dir.join("checkpoints").join("latest").exists() {
        return Err((
            2,
            format!(
                "{} already holds checkpoints of a run: pass --resume to continue it, or choose another --output-dir",
                out_dir.display()
            ),
        ));
    }
    let result = run::build(&cfg, pg.clone(), Some(out_dir.clone()), args.resume)
        .and_then(|mut t| t.train_until(args.stop_after.unwrap_or(usize::MAX)).map(|s| (s, t.total_steps())));
    match result {
        Ok((s, total)) => {
            if pg.rank() == 0 {
                let eval: Vec<String> = s.eval.iter().map(|(k, v)| format!("{k} {v:.4}")).collect();
                println!(
                    "trained {} of {total} steps on {} rank(s) in {:.1} s; last loss {:.4}{}{}; run directory {}",
                    s.steps,
                    pg.world_size(),
                    s.seconds,
                    s.last_loss,
                    if s.skipped > 0 { format!(" ({} non-finite steps skipped)", s.skipped) } else { String::new() },
                    if eval.is_empty() { String::new() } else { format!("; {}", eval.join(", ")) },
                    out_dir.display()
                );
            }
            Ok(())
        }
        Err(e) => {
            // Tell the other ranks why, so they stop at once and name this rank's reason.
            pg.abort(&e.to_string());
            Err((1, format!("rank {}: {e}", pg.rank())))
        }
    }
}
