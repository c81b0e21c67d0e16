//! `train`: one rank of a training run.
//!
//! ```text
//! train --config configs/vectors.yaml [--set optim.lr=0.1 ...] [--output-dir DIR] [--resume]
//! launch --nproc-per-node 2 train --config configs/vectors.yaml
//! ```
//!
//! Without launcher variables it is a world of one rank; under `launch`, torchrun or srun it
//! joins the job they describe. A worker that `torchrun --max-restarts N` restarted resumes
//! from the newest checkpoint of its run directory (see `elastic_run_dir`).

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
    let cfg = RunConfig::load(&args.config, &args.set).map_err(|e| (2, e.to_string()))?;
    let pg = ProcessGroup::from_env().map_err(|e| (1, e.to_string()))?;
    cfg.validate(pg.world_size(), &args.config).map_err(|e| (2, e.to_string()))?;
    // A worker that torchrun restarted resumes its run without being told (same directory).
    let elastic = pg.world_info().elastic.clone();
    let resume = args.resume || elastic.as_ref().is_some_and(|e| e.is_restart());
    let out_dir = match (&args.output_dir, &elastic) {
        (Some(d), _) => d.clone(),
        (None, Some(e)) => elastic_run_dir(&args.config, e, resume),
        (None, None) => default_run_dir(&args.config, resume).map_err(|e| (2, e))?,
    };
    if !resume && out_dir.join("checkpoints").join("latest").exists() {
        return Err((
            2,
            format!(
                "{} already holds checkpoints of a run: pass --resume to continue it, or choose another --output-dir",
                out_dir.display()
            ),
        ));
    }
    let result = run::build(&cfg, pg.clone(), Some(out_dir.clone()), resume)
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

/// `runs/<config name>/<UTC time>` for a new run; the newest such directory for a resume.
/// Only rank 0 writes into it, so ranks that pick a different second do no harm.
fn default_run_dir(config: &std::path::Path, resume: bool) -> Result<PathBuf, String> {
    let stem = config.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "run".into());
    let parent = PathBuf::from("runs").join(stem);
    if resume {
        let mut runs: Vec<PathBuf> = std::fs::read_dir(&parent)
            .map_err(|e| format!("--resume without --output-dir: cannot list {}: {e}", parent.display()))?
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.join("checkpoints").join("latest").exists())
            .collect();
        runs.sort();
        return runs.pop().ok_or_else(|| format!("--resume: no run with checkpoints under {}", parent.display()));
    }
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    Ok(parent.join(utc_stamp(secs)))
}

/// The run directory of a torchrun job, the same across its restarts:
/// `runs/<config name>/torchrun-<TORCHELASTIC_RUN_ID>`. torchrun's default run id `none`
/// names no job, so then a first start gets a new directory and a restart the newest one
/// with checkpoints (pass `--rdzv-id`, `--standalone` or `--output-dir` to be exact).
fn elastic_run_dir(config: &std::path::Path, e: &allgrad::dist::Elastic, resume: bool) -> PathBuf {
    if e.run_id == "none" {
        let fresh = || default_run_dir(config, false).unwrap_or_else(|_| PathBuf::from("runs"));
        return if resume { default_run_dir(config, true).unwrap_or_else(|_| fresh()) } else { fresh() };
    }
    let id: String = e.run_id.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect();
    let stem = config.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "run".into());
    PathBuf::from("runs").join(stem).join(format!("torchrun-{id}"))
}

/// `YYYYmmdd-HHMMSS` in UTC (days to civil date after Howard Hinnant's algorithm).
fn utc_stamp(secs: u64) -> String {
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}{month:02}{day:02}-{:02}{:02}{:02}", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
mod tests {
    #[test]
    fn utc_stamps() {
        assert_eq!(super::utc_stamp(0), "19700101-000000");
        assert_eq!(super::utc_stamp(951_782_400 + 3_723), "20000229-010203");
    }
}
