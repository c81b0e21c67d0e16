//! `train`: one rank of a training run.
//!
//! ```text
//! train --config configs/vectors.yaml [--set optim.lr=0.1 ...] [--output-dir DIR] [--resume]
//! launch --nproc-per-node 2 train --config configs/vectors.yaml
//! ```
//!
//! Without launcher variables it is a world of one rank; under `launch`, torchrun or srun it
//! joins the job they describe. The run-directory policy is `allgrad_train::run_dir`; the
//! environment variables are read once, here, into `allgrad_train::Settings`.
//! A worker that `torchrun --max-restarts N` restarted resumes from the newest checkpoint of
//! its run directory (`allgrad_train::run_dir::torchrun_run_dir`).

use std::path::{Path, PathBuf};

use allgrad::dist::ProcessGroup;
use allgrad_train::{run, run_dir, RunConfig, Settings};
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
    /// Run directory (default: a new runs/<config name>/<UTC time>; with --resume, the newest
    /// run of that config).
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
    let tuned = allgrad::tune_allocator();
    let filter = tracing_subscriber::EnvFilter::try_from_env("ALLGRAD_LOG").unwrap_or_else(|_| "info".into());
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(false).init();
    tracing::debug!("allocator tuned for training: {tuned}");
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
    let settings = Settings::from_env().map_err(|e| (2, e.to_string()))?;
    let cfg = RunConfig::load(&args.config, &args.set).map_err(|e| (2, e.to_string()))?;
    let pg = ProcessGroup::from_env().map_err(|e| (1, e.to_string()))?;
    cfg.validate(pg.world_size(), &args.config).map_err(|e| (2, e.to_string()))?;
    // A worker that torchrun restarted resumes its run without being told (same directory).
    let elastic = pg.world_info().elastic.clone();
    let resume = args.resume || elastic.as_ref().is_some_and(|e| e.is_restart());
    let root = Path::new("runs");
    let out_dir = match (&args.output_dir, &elastic) {
        (None, Some(e)) => run_dir::torchrun_run_dir(root, &args.config, &e.run_id, resume, run_dir::now_secs()),
        (explicit, _) => run_dir::choose(explicit.as_deref(), root, &args.config, resume, run_dir::now_secs()),
    }
    .map_err(|e| (2, e.to_string()))?;
    let result = run::build_with(&cfg, pg.clone(), Some(out_dir.clone()), resume, settings)
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
