//! What a new user meets first, as processes: `train --help`, `--list-methods` and
//! `--print-config`; `launch` finding `train` beside itself; a config error printed once for
//! the whole job and blamed on the command line when it came from there; no empty run folder
//! after a failed start; logs without colour codes in files, a job-wide warning once; a
//! checkpoint as readable as the rest of the run.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use crate::common;

const LIMIT: Duration = Duration::from_secs(120);

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).canonicalize().unwrap()
}

fn run(cmd: &mut Command) -> Output {
    common::run_with_watchdog(cmd, LIMIT).0
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A command in `cwd` whose PATH holds only the system's folders (not the build's).
fn cmd(program: &str, cwd: &Path) -> Command {
    let mut c = Command::new(program);
    c.current_dir(cwd).env("PATH", "/usr/bin:/bin").env_remove("RANK").env_remove("NO_COLOR");
    c
}

#[test]
fn help_lists_examples_and_list_methods_names_the_builtin_ones() {
    let cwd = tempfile::tempdir().unwrap();
    let out = run(cmd(env!("CARGO_BIN_EXE_train"), cwd.path()).arg("--help"));
    let help = text(&out.stdout);
    assert!(out.status.success() && help.contains("Examples:") && help.contains("--print-config"), "{help}");
    let out = run(cmd(env!("CARGO_BIN_EXE_launch"), cwd.path()).arg("--help"));
    let help = text(&out.stdout);
    assert!(out.status.success() && help.contains("Examples:") && help.contains("--max-restarts"), "{help}");
    // `launch` finds `train` beside itself though it is not on PATH (right after a build).
    let out = run(cmd(env!("CARGO_BIN_EXE_launch"), cwd.path()).args([
        "--nproc-per-node",
        "1",
        "--no-prefix",
        "train",
        "--list-methods",
    ]));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).lines().collect::<Vec<_>>(), ["barlowtwins", "clip", "face", "simclr", "simcse", "vectors"]);
    // A program that is nowhere: exit code 2 and what to do.
    let out = run(cmd(env!("CARGO_BIN_EXE_launch"), cwd.path()).args(["--nproc-per-node", "2", "trian", "--list-methods"]));
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    assert!(err.contains("`trian` is not on PATH nor beside launch in") && err.contains("target/release/trian"), "{err}");
}

#[test]
fn print_config_from_another_folder_shows_absolute_paths_and_defaults() {
    let cwd = tempfile::tempdir().unwrap();
    let config = repo().join("configs/simclr.yaml");
    let out = run(cmd(env!("CARGO_BIN_EXE_train"), cwd.path()).arg("--config").arg(&config).args([
        "--print-config",
        "--set",
        "train.epochs=1",
    ]));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let yaml = text(&out.stdout);
    assert!(yaml.contains(&format!("dir: {}", repo().join("data/fashion-mnist").display())), "{yaml}");
    assert!(yaml.contains("epochs: 1") && yaml.contains("clip_grad_norm: null") && yaml.contains("augment:"), "{yaml}");
    assert!(!cwd.path().join("runs").exists(), "--print-config made a run folder");
}

#[test]
fn a_config_error_is_printed_once_for_the_job_and_blamed_on_the_command_line() {
    let cwd = tempfile::tempdir().unwrap();
    let config = repo().join("configs/vectors.yaml");
    let out = run(cmd(env!("CARGO_BIN_EXE_launch"), cwd.path())
        .args(["--nproc-per-node", "2", env!("CARGO_BIN_EXE_train"), "--config"])
        .arg(&config)
        .args(["--set", "optim.lr=0.1.0"]));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    let lines: Vec<&str> = err.lines().filter(|l| l.contains("train: error:")).collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(lines[0].contains("--set optim.lr=0.1.0: at `optim.lr`") && !lines[0].contains("vectors.yaml"), "{err}");
}

#[test]
fn a_run_that_fails_at_start_leaves_no_folder_behind() {
    let cwd = tempfile::tempdir().unwrap();
    let config = cwd.path().join("images.yaml");
    // Valid as a config; the data folder is absent, so building the objective fails.
    std::fs::write(
        &config,
        "method: simclr\ndata: {kind: images, dir: absent, format: idx}\nmodel: {kind: resnet}\ntrain: {global_batch: 8, epochs: 1}\n",
    )
    .unwrap();
    let out = run(cmd(env!("CARGO_BIN_EXE_train"), cwd.path()).arg("--config").arg(&config));
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains(&cwd.path().join("absent").display().to_string()), "{}", text(&out.stderr));
    let runs = cwd.path().join("runs/images");
    let left: Vec<_> = std::fs::read_dir(&runs).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    assert!(left.is_empty(), "left behind: {left:?}");
    // A folder the user named and that existed is theirs: kept.
    let mine = cwd.path().join("mine");
    std::fs::create_dir(&mine).unwrap();
    let out = run(cmd(env!("CARGO_BIN_EXE_train"), cwd.path()).arg("--config").arg(&config).arg("--output-dir").arg(&mine));
    assert_eq!(out.status.code(), Some(1));
    assert!(mine.is_dir());
}

#[test]
fn logs_in_a_file_have_no_colour_a_job_wide_warning_shows_once_and_checkpoints_are_readable() {
    let cwd = tempfile::tempdir().unwrap();
    let config = cwd.path().join("run.yaml");
    std::fs::write(
        &config,
        common::vectors_config(
            "train: {global_batch: 24, max_steps: 2, epochs: 1}\ncheckpoint: {every: 1}\nlog: {progress: lines}\n",
        ),
    )
    .unwrap();
    let run_dir = cwd.path().join("run");
    std::fs::create_dir(&run_dir).unwrap();
    // --resume in a folder without checkpoints: every rank notices, the job says it once.
    let out = run(cmd(env!("CARGO_BIN_EXE_launch"), cwd.path())
        .args(["--nproc-per-node", "2", env!("CARGO_BIN_EXE_train"), "--config"])
        .arg(&config)
        .arg("--output-dir")
        .arg(&run_dir)
        .arg("--resume"));
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert_eq!(err.matches("--resume: no checkpoint in").count(), 1, "{err}");
    assert!(!err.contains('\u{1b}'), "colour codes in a log that is not a terminal:\n{err:?}");
    // A checkpoint's files get the permissions of the run's other files.
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let latest = std::fs::read_to_string(run_dir.join("checkpoints/latest")).unwrap();
    let model = run_dir.join("checkpoints").join(latest.trim()).join("model.safetensors");
    assert_eq!(mode(&model), mode(&run_dir.join("config.yaml")), "{}", model.display());
}
