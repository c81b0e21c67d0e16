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

/// Examples shown by `train --help`.
const TRAIN_EXAMPLES: &str = "\
Examples:
  train --config configs/vectors.yaml                      one rank, seconds
  launch --nproc-per-node 2 train --config configs/simclr.yaml
  train --config configs/simclr.yaml --set optim.lr=0.5 --set train.epochs=1
  train --config configs/simclr.yaml --print-config       the resolved config, with defaults
  train --config configs/simclr.yaml --resume             continue the newest run
  train --list-methods

Relative paths in a config file are taken from the file's folder; those given with --set,
from the current directory. Each run writes runs/CONFIG/TIME/ (config.yaml, metrics.jsonl,
checkpoints/, loss.png).";

/// Train the method a config describes, on this rank.
#[derive(Parser, Debug, Clone)]
#[command(version, about, after_help = TRAIN_EXAMPLES)]
pub struct TrainArgs {
    /// The run's YAML config.
    #[arg(long, required_unless_present = "list_methods")]
    pub config: Option<PathBuf>,
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
    /// Print the resolved config (the file, the --set values and every default of the
    /// trainer's and the method's sections) as YAML, and exit without training.
    #[arg(long)]
    pub print_config: bool,
    /// List the methods this binary can train (the values of `method:`), and exit.
    #[arg(long)]
    pub list_methods: bool,
    /// Time the regions of every step (forward, backward, gradient sync, optimizer, the read
    /// of the figures; with CUDA events on a GPU) and count their host traffic; rank 0 prints
    /// the table at the end (as `ALLGRAD_PROFILE=1`).
    #[arg(long)]
    pub profile: bool,
}

impl TrainArgs {
    /// The config file (`--config`), required unless `--list-methods`.
    fn config_path(&self) -> Result<&Path, CliError> {
        self.config.as_deref().ok_or(CliError::Usage("--config FILE is required"))
    }
}

/// Why `train` stopped without finishing.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The command line lacks something (exit code 2).
    #[error("{0}")]
    Usage(&'static str),
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
            CliError::Usage(_) | CliError::Config(_) | CliError::Settings(_) | CliError::RunDir(_) => 2,
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
            "trained {} of {} steps on {} rank(s) in {:.1} s; last loss {}{}{}; run directory {}",
            s.steps,
            self.total_steps,
            self.world_size,
            s.seconds,
            crate::metrics::significant(s.last_loss),
            if s.skipped > 0 { format!(" ({} non-finite steps skipped)", s.skipped) } else { String::new() },
            if eval.is_empty() { String::new() } else { format!("; {}", eval.join(", ")) },
            self.out_dir.display()
        )
    }
}

/// Logs to stderr, filtered by `ALLGRAD_LOG` (default `info`, also for a bad filter, which
/// [`Settings`] then reports as an error); does nothing when a subscriber
/// is already installed. Colour only when stderr is a terminal (never in a log file or a
/// pipe, nor with `NO_COLOR` set). Messages with the target [`allgrad_dist::JOB_LOG`] (the
/// same on every rank) are shown by rank 0 only.
pub fn init_logging() {
    use std::io::IsTerminal;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    let filter = tracing_subscriber::EnvFilter::try_from_env("ALLGRAD_LOG").unwrap_or_else(|_| "info".into());
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let rank0 = rank_from_env() == 0;
    let job_wide_once = tracing_subscriber::filter::filter_fn(move |meta| rank0 || meta.target() != allgrad_dist::JOB_LOG);
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_target(false).with_ansi(colour);
    let _ = tracing_subscriber::registry().with(fmt.with_filter(filter).with_filter(job_wide_once)).try_init();
}

/// This process's rank as its launcher set it (`RANK`, torchrun's and `launch`'s; `SLURM_PROCID`
/// under srun), before any process group exists; 0 without a launcher.
fn rank_from_env() -> usize {
    ["RANK", "SLURM_PROCID"].iter().find_map(|v| std::env::var(v).ok()?.trim().parse().ok()).unwrap_or(0)
}

/// The `train` binary: logging, arguments from the command line, [`run_with`], the summary
/// line on rank 0 or the error on stderr. Returns the process exit code.
///
/// An error in the command line or the config is the same on every rank, so only rank 0
/// prints it (the others exit with the same code); a failure while training is printed by
/// the rank it happened on.
pub fn main_with(registry: Registry) -> i32 {
    init_logging();
    let args = TrainArgs::parse();
    if args.list_methods {
        for name in registry.names() {
            println!("{name}");
        }
        return 0;
    }
    if args.print_config {
        return match args.config_path().and_then(|path| Ok(registry.resolved_yaml(path, &args.set)?)) {
            Ok(yaml) => {
                print!("{yaml}");
                0
            }
            Err(e) => {
                eprintln!("train: error: {e}");
                e.exit_code()
            }
        };
    }
    match run_with(&registry, &args) {
        Ok(outcome) => {
            if outcome.rank == 0 {
                println!("{}", outcome.line());
            }
            0
        }
        Err(e) => {
            let same_on_every_rank = matches!(e, CliError::Usage(_) | CliError::Config(_) | CliError::Settings(_));
            if !same_on_every_rank || rank_from_env() == 0 {
                eprintln!("train: error: {e}");
            }
            e.exit_code()
        }
    }
}

/// Loads and validates the config against `registry`, joins the process group, picks the run
/// directory and trains. A failing rank tells the others why before returning.
pub fn run_with(registry: &Registry, args: &TrainArgs) -> Result<Outcome, CliError> {
    let config = args.config_path()?;
    let mut settings = Settings::from_env().map_err(CliError::Settings)?;
    settings.profile |= args.profile;
    // ALLGRAD_DEVICE_PATH=1: every thread of the process (the loader's and the kernels' pools
    // too) runs CPU tensors through the device path and counts their traffic, from before the
    // objective and the trainer are built.
    if settings.device_path {
        allgrad_nn::transfer::set_device_path_for_process(true);
    }
    let cfg = registry.load(config, &args.set)?;
    let pg = ProcessGroup::from_env()?;
    registry.validate(&cfg, pg.world_size(), config)?;
    // A worker that torchrun restarted resumes its run without being told (same directory).
    let elastic = pg.world_info().elastic.clone();
    let resume = args.resume || elastic.as_ref().is_some_and(|e| e.is_restart());
    let root = Path::new("runs");
    let out_dir = match (&args.output_dir, &elastic) {
        (None, Some(e)) if e.by_launch => run_dir::launch_run_dir(root, config, &e.run_id, resume, run_dir::now_secs())?,
        (None, Some(e)) => run_dir::torchrun_run_dir(root, config, &e.run_id, resume, run_dir::now_secs())?,
        (explicit, _) => run_dir::choose(explicit.as_deref(), root, config, resume, run_dir::now_secs())?,
    };
    let new_dir = !out_dir.exists();
    let result = run::build_with(registry, &cfg, pg.clone(), Some(out_dir.clone()), resume, settings)
        .and_then(|mut t| t.train_until(args.stop_after.unwrap_or(usize::MAX)).map(|s| (s, t.total_steps())));
    match result {
        Ok((summary, total_steps)) => Ok(Outcome { summary, total_steps, rank: pg.rank(), world_size: pg.world_size(), out_dir }),
        Err(e) => {
            // Tell the other ranks why, so they stop at once and name this rank's reason.
            pg.abort(&e.to_string());
            // A run that failed before it recorded anything leaves no folder behind for
            // `--resume` or a reader to mistake for a run.
            if new_dir && pg.rank() == 0 {
                run_dir::remove_if_unused(&out_dir);
            }
            Err(CliError::Train { rank: pg.rank(), source: e })
        }
    }
}
