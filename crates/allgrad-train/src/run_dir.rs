//! Where a run writes: the run-directory policy of the `train` binary.
//!
//! With `--output-dir DIR` the run uses DIR. Without it a new run gets
//! `runs/<config name>/<UTC time as YYYYmmdd-HHMMSS>`, and `--resume` picks the newest run of
//! that config that holds a checkpoint. Only rank 0 writes into the directory, so ranks that
//! read the clock in different seconds do no harm. A new run never overwrites a directory
//! that holds checkpoints.
//!
//! Under `launch --max-restarts` ([`launch_run_dir`]) it is `runs/<config name>/<run id>`,
//! the run id being the launch's UTC time unless `--run-id` names it.
//!
//! Under torchrun ([`torchrun_run_dir`]) the directory is the same across the job's restarts:
//! `runs/<config name>/torchrun-<TORCHELASTIC_RUN_ID>`, so a restarted worker finds the
//! checkpoints its previous incarnation wrote.

use std::path::{Path, PathBuf};

/// Why no run directory could be chosen.
#[derive(Debug, thiserror::Error)]
pub enum RunDirError {
    /// `--resume` without `--output-dir`, and the config's runs cannot be listed.
    #[error("--resume without --output-dir: cannot list {path}: {source} (pass --output-dir to name the run)")]
    List {
        /// The config's folder of runs.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// `--resume`, but no run of this config has a checkpoint.
    #[error("--resume: no run with checkpoints under {0} (start a run without --resume first, or pass --output-dir)")]
    NothingToResume(PathBuf),
    /// A new run would overwrite one that holds checkpoints.
    #[error("{0} already holds checkpoints of a run: pass --resume to continue it, or choose another --output-dir")]
    Occupied(PathBuf),
}

/// The run directory: `explicit` if given, else the default under `root` (`runs` relative to
/// the working directory in the binary) for `config`, at UNIX time `now_secs`.
pub fn choose(explicit: Option<&Path>, root: &Path, config: &Path, resume: bool, now_secs: u64) -> Result<PathBuf, RunDirError> {
    let dir = match explicit {
        Some(d) => d.to_path_buf(),
        None => default_run_dir(root, config, resume, now_secs)?,
    };
    unoccupied(dir, resume)
}

/// `dir`, unless a new run (`resume` false) would overwrite the checkpoints it holds.
fn unoccupied(dir: PathBuf, resume: bool) -> Result<PathBuf, RunDirError> {
    if !resume && has_checkpoint(&dir) {
        return Err(RunDirError::Occupied(dir));
    }
    Ok(dir)
}

/// The run directory of a torchrun job whose `TORCHELASTIC_RUN_ID` is `run_id`, the same
/// across its restarts: `root/<config name>/torchrun-<run id>` (characters other than ASCII
/// letters, digits, `-`, `_` and `.` become `_`). torchrun's default run id `none` names no
/// job: then a first start gets a new directory as [`choose`] would, and a restart the newest
/// one with checkpoints (pass `--rdzv-id`, `--standalone` or `--output-dir` to be exact).
pub fn torchrun_run_dir(root: &Path, config: &Path, run_id: &str, resume: bool, now_secs: u64) -> Result<PathBuf, RunDirError> {
    elastic_run_dir(root, config, "torchrun-", run_id, resume, now_secs)
}

/// The run directory of a job restarted by `launch --max-restarts` (or given `--run-id`):
/// `root/<config name>/<run id>`, the same across restarts. `launch`'s default run id is its
/// UTC start time, so the directory looks like a plain run's; otherwise as
/// [`torchrun_run_dir`].
pub fn launch_run_dir(root: &Path, config: &Path, run_id: &str, resume: bool, now_secs: u64) -> Result<PathBuf, RunDirError> {
    elastic_run_dir(root, config, "", run_id, resume, now_secs)
}

fn elastic_run_dir(
    root: &Path,
    config: &Path,
    prefix: &str,
    run_id: &str,
    resume: bool,
    now_secs: u64,
) -> Result<PathBuf, RunDirError> {
    if run_id == "none" {
        let dir = if resume {
            default_run_dir(root, config, true, now_secs).or_else(|_| default_run_dir(root, config, false, now_secs))?
        } else {
            default_run_dir(root, config, false, now_secs)?
        };
        return unoccupied(dir, resume);
    }
    let id: String = run_id.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect();
    unoccupied(root.join(config_stem(config)).join(format!("{prefix}{id}")), resume)
}

fn config_stem(config: &Path) -> String {
    config.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "run".into())
}

fn has_checkpoint(dir: &Path) -> bool {
    dir.join("checkpoints").join("latest").exists()
}

/// `root/<config name>/<UTC time>` for a new run; the newest such directory with a
/// checkpoint for a resume.
fn default_run_dir(root: &Path, config: &Path, resume: bool, now_secs: u64) -> Result<PathBuf, RunDirError> {
    let parent = root.join(config_stem(config));
    if resume {
        let entries = std::fs::read_dir(&parent).map_err(|source| RunDirError::List { path: parent.clone(), source })?;
        let mut runs: Vec<PathBuf> = entries.flatten().map(|e| e.path()).filter(|p| has_checkpoint(p)).collect();
        runs.sort();
        return runs.pop().ok_or(RunDirError::NothingToResume(parent));
    }
    Ok(parent.join(utc_stamp(now_secs)))
}

/// Removes `dir` when a run that created it failed before recording anything: it holds
/// nothing but `config.yaml` (and an empty `metrics.jsonl`). A folder with anything else, a
/// checkpoint or a single metric, is the user's to keep. Errors are ignored: this is tidying
/// after a failure that is already being reported.
pub fn remove_if_unused(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let unused = entries.flatten().all(|e| {
        let name = e.file_name();
        name == "config.yaml" || (name == "metrics.jsonl" && e.metadata().is_ok_and(|m| m.is_file() && m.len() == 0))
    });
    if unused {
        let _ = std::fs::remove_dir_all(dir);
    }
}

pub use allgrad_dist::clock::{now_secs, utc_stamp};

#[cfg(test)]
mod tests {
    use super::*;

    fn checkpointed(dir: &Path) {
        std::fs::create_dir_all(dir.join("checkpoints")).unwrap();
        std::fs::write(dir.join("checkpoints/latest"), "step_1\n").unwrap();
    }

    #[test]
    fn new_runs_get_a_stamped_directory_and_resume_picks_the_newest_with_a_checkpoint() {
        let root = tempfile::tempdir().unwrap();
        let cfg = Path::new("configs/simclr.yaml");
        let new = choose(None, root.path(), cfg, false, 0).unwrap();
        assert_eq!(new, root.path().join("simclr/19700101-000000"));
        assert!(matches!(choose(None, root.path(), cfg, true, 0), Err(RunDirError::List { .. })));
        checkpointed(&root.path().join("simclr/20250101-000000"));
        checkpointed(&root.path().join("simclr/20260101-000000"));
        std::fs::create_dir_all(root.path().join("simclr/20270101-000000")).unwrap(); // no checkpoint
        assert_eq!(choose(None, root.path(), cfg, true, 0).unwrap(), root.path().join("simclr/20260101-000000"));
        let other = Path::new("vectors.yaml");
        std::fs::create_dir_all(root.path().join("vectors/x")).unwrap();
        let e = choose(None, root.path(), other, true, 0).unwrap_err();
        assert!(matches!(e, RunDirError::NothingToResume(_)), "{e}");
    }

    #[test]
    fn only_a_folder_with_nothing_but_its_config_is_removed_after_a_failed_start() {
        let root = tempfile::tempdir().unwrap();
        let bare = root.path().join("bare");
        std::fs::create_dir_all(&bare).unwrap();
        std::fs::write(bare.join("config.yaml"), "method: vectors\n").unwrap();
        std::fs::write(bare.join("metrics.jsonl"), "").unwrap();
        remove_if_unused(&bare);
        assert!(!bare.exists());
        // A metric, a checkpoint or any other file keeps the folder.
        for (name, contents) in [("metrics.jsonl", "{\"step\":1}\n"), ("checkpoints", ""), ("notes.txt", "")] {
            let dir = root.path().join(format!("kept-{name}"));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("config.yaml"), "method: vectors\n").unwrap();
            if name == "checkpoints" {
                checkpointed(&dir);
            } else {
                std::fs::write(dir.join(name), contents).unwrap();
            }
            remove_if_unused(&dir);
            assert!(dir.join("config.yaml").exists(), "{name}: the folder must stay");
        }
        remove_if_unused(&root.path().join("absent"));
    }

    #[test]
    fn an_explicit_directory_with_checkpoints_needs_resume() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("r");
        checkpointed(&dir);
        let e = choose(Some(&dir), root.path(), Path::new("a.yaml"), false, 0).unwrap_err().to_string();
        assert!(e.contains("already holds checkpoints") && e.contains("--resume"), "{e}");
        assert_eq!(choose(Some(&dir), root.path(), Path::new("a.yaml"), true, 0).unwrap(), dir);
    }

    #[test]
    fn torchrun_jobs_keep_their_directory_across_restarts() {
        let root = tempfile::tempdir().unwrap();
        let cfg = Path::new("configs/vectors.yaml");
        let first = torchrun_run_dir(root.path(), cfg, "job/7", false, 0).unwrap();
        assert_eq!(first, root.path().join("vectors/torchrun-job_7"));
        assert_eq!(torchrun_run_dir(root.path(), cfg, "job/7", true, 99).unwrap(), first);
        // A fresh job that reuses the id must not overwrite the checkpoints of the earlier one.
        let other = Path::new("configs/other.yaml");
        let used = torchrun_run_dir(root.path(), other, "job/7", false, 0).unwrap();
        std::fs::create_dir_all(used.join("checkpoints/latest")).unwrap();
        assert!(matches!(torchrun_run_dir(root.path(), other, "job/7", false, 0), Err(RunDirError::Occupied(_))));
        assert_eq!(torchrun_run_dir(root.path(), other, "job/7", true, 0).unwrap(), used);
        // The default id names no job: a new stamp, and on restart the newest run with checkpoints.
        assert_eq!(torchrun_run_dir(root.path(), cfg, "none", false, 0).unwrap(), root.path().join("vectors/19700101-000000"));
        let old = root.path().join("vectors/19700101-000000");
        std::fs::create_dir_all(old.join("checkpoints/latest")).unwrap();
        assert_eq!(torchrun_run_dir(root.path(), cfg, "none", true, 5_000).unwrap(), old);
    }

    #[test]
    fn launch_restarts_keep_the_directory_named_by_the_run_id() {
        let root = tempfile::tempdir().unwrap();
        let cfg = Path::new("configs/vectors.yaml");
        let first = launch_run_dir(root.path(), cfg, "20261122-180000", false, 0).unwrap();
        assert_eq!(first, root.path().join("vectors/20261122-180000"));
        checkpointed(&first);
        assert_eq!(launch_run_dir(root.path(), cfg, "20261122-180000", true, 99).unwrap(), first);
        assert!(matches!(launch_run_dir(root.path(), cfg, "20261122-180000", false, 0), Err(RunDirError::Occupied(_))));
    }
}
