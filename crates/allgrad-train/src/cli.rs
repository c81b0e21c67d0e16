//! The `train` command as a library: [`main_with`] is the whole binary, with the methods of
//! a [`Registry`], so a user's own method gets the same command from a few lines:
//!
//! ```no_run
//! // In a binary's `main`:
//! let methods = allgrad_train::Registry::builtin(); // plus `methods.register("mine", Mine);`
//! std::process::exit(allgrad_train::cli::main_with(methods));
//! ```
//!
//! ```text
//! train --config configs/vectors.yaml [--set optim.lr=0.1 ...] [--output-dir DIR] [--resume]
//! launch --nproc-per-node 2 train --config configs/vectors.yaml
//! ```
//!
//! Without launcher variables it is a world of one rank; under `launch`, torchrun or srun it
//! joins the job they describe. The run-directory policy is [`crate::run_dir`]; the
//! environment variables are read once, at start, into [`Settings`]. A worker that
//! `torchrun --max-restarts N` or `launch --max-restarts N` restarted resumes from the newest checkpoint of its run
//! directory ([`run_dir::torchrun_run_dir`]).

use std::path::{Path, PathBuf};

use allgrad_dist::ProcessGroup;
use clap::Parser;

use crate::config::ConfigError;
use crate::method::Registry;
use crate::run;
use crate::run_dir;
use crate::settings::Settings;
use crate::trainer::Summary;

/// Train the method a config describes, on this rank.
#[derive(Parser, Debug, Clone)]
#[command(version, about)]
pub struct TrainArgs {
    /// The run's YAML config.
    #[arg(long)]
    pub config: PathBuf,
    /// Override a config value: `--set optim.lr=0.1` (repeatable; the value is parsed as YAML).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Run directory (default: a new runs/CONFIG/TIME, CONFIG the config file's name and TIME
    /// the UTC time; with --resume, the newest run of that config; under torchrun,
    /// runs/CONFIG/torchrun-RUN_ID; under `launch --max-restarts`, runs/CONFIG/RUN_ID).
    #[arg(long)]
    pub output_dir: Option<PathBuf>,
    /// Continue from the newest checkpoint in the run directory.
    #[arg(long)]
    pub resume: bool,
    /// Stop (with a checkpoint) once this many steps are done; `--resume` continues later.
    #[arg(long, value_name = "STEPS")]
    pub stop_after: Option<usize>,
}

/// Why `train` stopped without finishing.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The config cannot be read, parsed or validated (exit code 2).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The process group could not be set up (exit code 1).
    #[error(transparent)]
    Group(#[from] allgrad_dist::DistError),
    /// An environment variable has a value that cannot be used (exit code 2).
    #[error("{0}")]
    Settings(crate::error::TrainError),
    /// No run directory could be chosen (exit code 2).
    #[error(transparent)]
    RunDir(#[from] run_dir::RunDirError),
    /// Training failed on this rank (exit code 1).
    #[error("rank {rank}: {source}")]
    Train {
        /// This rank.
        rank: usize,
        /// What failed.
        source: crate::error::TrainError,
    },
}

impl CliError {
    /// The process exit code: 2 for usage and config errors, 1 for failures while running.
    pub fn exit_code(&self) -> i32 {
        match self {
            CliError::Config(_) | CliError::Settings(_) | CliError::RunDir(_) => 2,
            CliError::Group(_) | CliError::Train { .. } => 1,
        }
    }
}

/// What a finished (or stopped) run did.
#[derive(Debug)]
pub struct Outcome {
    /// The trainer's summary.
    pub summary: Summary,
    /// Steps of the whole run.
    pub total_steps: usize,
    /// This rank.
    pub rank: usize,
    /// Ranks of the run.
    pub world_size: usize,
    /// The run directory.
    pub out_dir: PathBuf,
}

impl Outcome {
    /// The one line `train` prints on rank 0.
    pub fn line(&self) -> String {
        let s = &self.summary;
        let eval: Vec<String> = s.eval.iter().map(|(k, v)| format!("{k} {v:.4}")).collect();
        format!(
            "trained {} of {} steps on {} rank(s) in {:.1} s; last loss {:.4}{}{}; run directory {}",
            s.steps,
            self.total_steps,
            self.world_size,
            s.seconds,
            s.last_loss,
            if s.skipped > 0 { format!(" ({} non-finite steps skipped)", s.skipped) } else { String::new() },
            if eval.is_empty() { String::new() } else { format!("; {}", eval.join(", ")) },
            self.out_dir.display()
        )
    }
}

/// Logs to stderr, filtered by `ALLGRAD_LOG` (default `info`); does nothing when a subscriber
/// is already installed.
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("ALLGRAD_LOG").unwrap_or_else(|_| "info".into());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(false).try_init();
}

/// The `train` binary: logging, arguments from the command line, [`run_with`], the summary
/// line on rank 0 or the error on stderr. Returns the process exit code.
pub fn main_with(registry: Registry) -> i32 {
    init_logging();
    let args = TrainArgs::parse();
    match run_with(&registry, &args) {
        Ok(outcome) => {
            if outcome.rank == 0 {
                println!("{}", outcome.line());
            }
            0
        }
        Err(e) => {
            eprintln!("train: error: {e}");
            e.exit_code()
        }
    }
}

/// Loads and validates the config against `registry`, joins the process group, picks the run
/// directory and trains. A failing rank tells the others why before returning.
pub fn run_with(registry: &Registry, args: &TrainArgs) -> Result<Outcome, CliError> {
    let settings = Settings::from_env().map_err(CliError::Settings)?;
    let cfg = registry.load(&args.config, &args.set)?;
    let pg = ProcessGroup::from_env()?;
    registry.validate(&cfg, pg.world_size(), &args.config)?;
    // A worker that torchrun restarted resumes its run without being told (same directory).
    let elastic = pg.world_info().elastic.clone();
    let resume = args.resume || elastic.as_ref().is_some_and(|e| e.is_restart());
    let root = Path::new("runs");
    let out_dir = match (&args.output_dir, &elastic) {
        (None, Some(e)) if e.by_launch => run_dir::launch_run_dir(root, &args.config, &e.run_id, resume, run_dir::now_secs())?,
        (None, Some(e)) => run_dir::torchrun_run_dir(root, &args.config, &e.run_id, resume, run_dir::now_secs())?,
        (explicit, _) => run_dir::choose(explicit.as_deref(), root, &args.config, resume, run_dir::now_secs())?,
    };
    let result = run::build_with(registry, &cfg, pg.clone(), Some(out_dir.clone()), resume, settings)
        .and_then(|mut t| t.train_until(args.stop_after.unwrap_or(usize::MAX)).map(|s| (s, t.total_steps())));
    match result {
        Ok((summary, total_steps)) => Ok(Outcome { summary, total_steps, rank: pg.rank(), world_size: pg.world_size(), out_dir }),
        Err(e) => {
            // Tell the other ranks why, so they stop at once and name this rank's reason.
            pg.abort(&e.to_string());
            Err(CliError::Train { rank: pg.rank(), source: e })
        }
    }
}
