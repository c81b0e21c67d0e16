//! `train` as a process, alone and under `launch`: W ranks end where 1 rank does; a process
//! killed while saving a checkpoint leaves `latest` loadable and resumes exactly; config
//! errors name the file, the key and the numbers.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use candle_core::{Device, Tensor};

use crate::common;

fn config() -> String {
    common::vectors_config(
        "train: {global_batch: 24, epochs: 2}\ncheckpoint: {every: 2, keep_last: 2}\nlog: {every: 1, progress: lines}\n",
    )
}

fn run(cmd: &mut Command, limit: Duration) -> Output {
    common::run_with_watchdog(cmd, limit).0
}

fn train(dir: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_train"));
    c.arg("--config").arg(dir.join("run.yaml")).args(args);
    c
}

fn launched(dir: &Path, n: usize, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_launch"));
    c.args(["--nproc-per-node", &n.to_string(), env!("CARGO_BIN_EXE_train"), "--config"]).arg(dir.join("run.yaml")).args(args);
    c
}

fn setup() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("run.yaml"), config()).unwrap();
    d
}

fn latest_model(run_dir: &Path) -> (PathBuf, HashMap<String, Tensor>) {
    let name = std::fs::read_to_string(run_dir.join("checkpoints/latest")).expect("checkpoints/latest");
    let ck = run_dir.join("checkpoints").join(name.trim());
    let model = candle_core::safetensors::load(ck.join("model.safetensors"), &Device::Cpu).expect("a complete checkpoint");
    (ck, model)
}

fn values(m: &HashMap<String, Tensor>) -> Vec<(String, Vec<f32>)> {
    let mut v: Vec<_> = m.iter().map(|(k, t)| (k.clone(), t.flatten_all().unwrap().to_vec1::<f32>().unwrap())).collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn ok(out: &Output) {
    assert!(
        out.status.success(),
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn launched_runs_on_2_and_3_ranks_end_where_1_rank_does() {
    // A local loss (NT-Xent per local anchor) and a replicated one (cross-correlation of
    // all-reduced statistics), each on 1, 2 and 3 processes at the same global batch.
    let d = setup();
    let limit = Duration::from_secs(120);
    for loss in ["{kind: nt_xent, temperature: 0.3}", "{kind: cross_correlation, lambda: 0.01}"] {
        let set = format!("loss={loss}");
        let tag = if loss.contains("nt_xent") { "local" } else { "replicated" };
        let dir = |w: usize| d.path().join(format!("{tag}-w{w}"));
        ok(&run(train(d.path(), &["--set", &set, "--output-dir"]).arg(dir(1)), limit));
        let one = values(&latest_model(&dir(1)).1);
        for w in [2, 3] {
            ok(&run(launched(d.path(), w, &["--set", &set, "--output-dir"]).arg(dir(w)), limit));
            let (ck, m) = latest_model(&dir(w));
            assert!(ck.ends_with("step_8"), "{}", ck.display());
            for ((name, a), (_, b)) in values(&m).iter().zip(&one) {
                let wide = |v: &[f32]| -> Vec<f64> { v.iter().map(|x| f64::from(*x)).collect() };
                allgrad_testkit::close::assert_rel(&wide(a), &wide(b), 1e-5, &format!("{tag} W={w} vs W=1: {name}"));
            }
        }
    }
    for f in
        ["config.yaml", "metrics.jsonl", "loss.png", "checkpoints/step_8/optimizer.safetensors", "checkpoints/step_8/state.json"]
    {
        assert!(d.path().join("local-w2").join(f).exists(), "missing {f}");
    }
}

#[test]
fn a_crash_while_saving_keeps_latest_loadable_and_resume_is_exact() {
    let d = setup();
    let limit = Duration::from_secs(120);
    let straight = d.path().join("straight");
    ok(&run(train(d.path(), &["--output-dir"]).arg(&straight), limit));
    let want = values(&latest_model(&straight).1);

    let crashed = d.path().join("crashed");
    ok(&run(train(d.path(), &["--stop-after", "2", "--output-dir"]).arg(&crashed), limit));
    assert!(latest_model(&crashed).0.ends_with("step_2"));
    for stage in ["model", "optimizer", "rename"] {
        let out = run(
            train(d.path(), &["--resume", "--output-dir"]).arg(&crashed).env("ALLGRAD_FAULT", format!("checkpoint:{stage}")),
            limit,
        );
        assert!(!out.status.success(), "the fault at {stage} did not fire");
        assert!(String::from_utf8_lossy(&out.stderr).contains(&format!("stage {stage}")));
        // The interrupted save of step 4 is invisible: latest still names step 2, complete.
        let (ck, _) = latest_model(&crashed);
        assert!(ck.ends_with("step_2"), "after a crash at {stage}: {}", ck.display());
    }
    ok(&run(train(d.path(), &["--resume", "--output-dir"]).arg(&crashed), limit));
    let (ck, m) = latest_model(&crashed);
    assert!(ck.ends_with("step_8"));
    assert_eq!(values(&m), want, "resumed run differs from the uninterrupted one");
    let leftovers: Vec<_> = std::fs::read_dir(crashed.join("checkpoints")).unwrap().flatten().map(|e| e.file_name()).collect();
    assert!(leftovers.iter().all(|n| !n.to_string_lossy().contains(".tmp-")), "{leftovers:?}");
}

#[test]
fn sigkill_at_random_moments_never_leaves_a_broken_latest() {
    let d = setup();
    let out_dir = d.path().join("killed");
    let args = ["--set", "checkpoint.every=1", "--set", "train.epochs=40", "--output-dir"];
    let mut checked = 0;
    for (i, delay_ms) in [150u64, 400, 700, 1100].into_iter().enumerate() {
        let mut c = train(d.path(), &args);
        c.arg(&out_dir);
        if i > 0 {
            c.arg("--resume");
        }
        let mut child = c.stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
        std::thread::sleep(Duration::from_millis(delay_ms));
        let _ = child.kill();
        let _ = child.wait();
        if out_dir.join("checkpoints/latest").exists() {
            let (ck, m) = latest_model(&out_dir);
            assert!(!m.is_empty(), "{}", ck.display());
            assert!(ck.join("optimizer.safetensors").exists() && ck.join("state.json").exists());
            checked += 1;
        }
    }
    // Without a checkpoint written before some kill, the test would have checked nothing.
    assert!(checked > 0, "no run lived long enough to write a checkpoint: nothing was checked");
    // The last latest is loadable by a resume that completes a step.
    ok(&run(train(d.path(), &args).arg(&out_dir).args(["--resume", "--stop-after", "1"]), Duration::from_secs(60)));
}

#[test]
fn config_errors_name_the_file_or_the_set_argument_the_key_and_the_numbers() {
    let d = setup();
    let limit = Duration::from_secs(60);
    let bad = d.path().join("bad");
    std::fs::create_dir(&bad).unwrap();
    std::fs::write(bad.join("run.yaml"), config().replace("epochs: 2", "epochs: two")).unwrap();
    let cases: Vec<(Command, Vec<&str>)> = vec![
        (train(&bad, &[]), vec!["run.yaml: at `train.epochs`", "invalid type"]),
        (
            train(d.path(), &["--set", "optim.momentun=0.9"]),
            vec!["--set optim.momentun=0.9: at `optim", "unknown field `momentun`"],
        ),
        (
            train(d.path(), &["--set", "train.global_batch=lots"]),
            vec!["--set train.global_batch=lots: at `train.global_batch`", "invalid type", "comes from the command line"],
        ),
        (
            launched(d.path(), 2, &["--set", "train.global_batch=25"]),
            vec!["train.global_batch = 25 is not divisible by world size 2"],
        ),
    ];
    for (mut cmd, needles) in cases {
        let out = run(&mut cmd, limit);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{err}");
        for n in needles {
            assert!(err.contains(n), "missing {n:?} in:\n{err}");
        }
    }
}

#[test]
fn an_existing_run_is_not_overwritten_without_resume() {
    let d = setup();
    let out_dir = d.path().join("r");
    ok(&run(train(d.path(), &["--stop-after", "2", "--output-dir"]).arg(&out_dir), Duration::from_secs(60)));
    let out = run(train(d.path(), &["--output-dir"]).arg(&out_dir), Duration::from_secs(60));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--resume"));
    assert!(latest_model(&out_dir).0.ends_with("step_2"));
}

/// A bad value of a variable allgrad-nn reads (the Winograd and fused-CUDA switches, the SIMD
/// level) stops `train` before it writes anything, naming the variable, the value and what it
/// may be; nothing falls back to a default.
#[test]
fn a_bad_setting_variable_stops_train_before_it_starts_naming_it() {
    let d = setup();
    let cases = [
        ("ALLGRAD_WINOGRAD", "yes", "expected 0 or 1"),
        ("ALLGRAD_CUDA_FUSED", "off", "expected 0 or 1"),
        ("ALLGRAD_CPU_SIMD", "sse9", "expected auto, avx512, avx2 or baseline"),
        ("ALLGRAD_MALLOC_TUNE", "yes", "must be 0 or 1"),
        ("ALLGRAD_LOG", "info,[", "is not a log filter"),
    ];
    for (var, value, why) in cases {
        let out_dir = d.path().join(var);
        let out = run(train(d.path(), &["--output-dir"]).arg(&out_dir).env(var, value), Duration::from_secs(60));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{var}={value} was accepted:\n{err}");
        let named = format!("{var}={value:?}");
        assert!(err.contains(&named) && err.contains(why), "missing {named:?} / {why:?} in:\n{err}");
        assert!(!out_dir.exists(), "{var}={value}: the run wrote {}", out_dir.display());
    }
}
