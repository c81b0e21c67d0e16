//! Ranks under the real torchrun (PyTorch's elastic agent, which serves its own TCPStore on
//! MASTER_PORT): 2 ranks train the vectors method and end exactly where `launch` does; a run
//! whose worker is SIGKILLed once under `--max-restarts 1` is restarted by torchrun, resumes
//! from its checkpoint and ends where an uninterrupted run does; and allgrad's TCPStore
//! client talks to PyTorch's own store.
//!
//! These tests run only with ALLGRAD_WITH_TORCH=1 (PyTorch is a large install that the CI
//! does not make); without it each skips, saying why (`allgrad_testkit::skip`). With it,
//! torchrun is found through ALLGRAD_TORCHRUN (a path) or `torchrun` on PATH, and Python (for
//! the store test) through ALLGRAD_PYTHON or the `python` next to that torchrun, and a test
//! whose torchrun or Python is missing or cannot import torch fails.
//! `scripts/launch/torchrun_local.sh` runs this file against the venv's torchrun.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use allgrad::dist::torch_store::TorchStore;
use allgrad_testkit::Need;
use candle_core::{Device, Tensor};

use crate::common;

const LIMIT: Duration = Duration::from_secs(240);

/// The shared vectors run at 4 steps an epoch; `epochs` and the checkpoint period set its length.
fn config(epochs: usize, every: usize) -> String {
    common::vectors_config(&format!(
        "train: {{global_batch: 24, epochs: {epochs}}}\n\
         checkpoint: {{every: {every}, keep_last: 2}}\n\
         log: {{every: 1, progress: lines}}\n"
    ))
}

/// Whether the torch tests were asked for; if not, the test skips, saying so.
fn asked_for() -> bool {
    let on = std::env::var("ALLGRAD_WITH_TORCH").is_ok_and(|v| v.trim() == "1");
    if !on {
        allgrad_testkit::skip(Need::Torch, "ALLGRAD_WITH_TORCH is not 1");
    }
    on
}

/// torchrun; asked for, it must be there.
fn torchrun_or_fail() -> PathBuf {
    torchrun().expect("ALLGRAD_WITH_TORCH=1, but no torchrun runs (set ALLGRAD_TORCHRUN, or put torchrun on PATH)")
}

fn torchrun() -> Option<PathBuf> {
    let path = match std::env::var_os("ALLGRAD_TORCHRUN") {
        Some(p) => PathBuf::from(p),
        None => std::env::var_os("PATH")
            .and_then(|paths| std::env::split_paths(&paths).map(|d| d.join("torchrun")).find(|p| p.is_file()))?,
    };
    let ok = Command::new(&path).arg("--help").stdout(Stdio::null()).stderr(Stdio::null()).status();
    ok.map(|s| s.success()).unwrap_or(false).then_some(path)
}

fn python() -> Option<PathBuf> {
    let path =
        std::env::var_os("ALLGRAD_PYTHON").map(PathBuf::from).or_else(|| torchrun().map(|t| t.with_file_name("python")))?;
    let ok = Command::new(&path).args(["-c", "import torch.distributed"]).stderr(Stdio::null()).status();
    ok.map(|s| s.success()).unwrap_or(false).then_some(path)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Starts `cmd` under a watchdog of [`LIMIT`] (`allgrad_testkit::process`: past it, or when a
/// surviving descendant holds the output open, everything it started is killed and the test
/// fails) and waits for it; `tick(pid)` runs every few milliseconds meanwhile.
fn run(cmd: &mut Command, what: &str, tick: impl FnMut(u32)) -> Output {
    allgrad_testkit::process::spawn(cmd, what, LIMIT).wait_ticking(tick).0
}

fn ok(out: &Output, what: &str) -> String {
    let (so, se) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{what} failed: {}\nstdout:\n{so}\nstderr:\n{se}", out.status);
    format!("{so}\n{se}")
}

fn torchrun_cmd(torchrun: &Path, dir: &Path, run_dir: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(torchrun);
    c.args(["--nproc-per-node", "2", "--master-port", &free_port().to_string()])
        .args(extra)
        .args(["--no-python", env!("CARGO_BIN_EXE_train"), "--config"])
        .arg(dir.join("run.yaml"))
        .arg("--output-dir")
        .arg(run_dir)
        .env("ALLGRAD_JOB_TOKEN", "torchrun-test-token")
        .env("ALLGRAD_TIMEOUT_S", "60")
        .env("OMP_NUM_THREADS", "1");
    c
}

fn launched(dir: &Path, run_dir: &Path) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_launch"));
    cmd.args(["--nproc-per-node", "2", env!("CARGO_BIN_EXE_train"), "--config"])
        .arg(dir.join("run.yaml"))
        .arg("--output-dir")
        .arg(run_dir);
    run(&mut cmd, "launch", |_| {})
}

/// The final checkpoint's parameters, by name.
fn final_model(run_dir: &Path) -> (String, Vec<(String, Vec<f32>)>) {
    let name = std::fs::read_to_string(run_dir.join("checkpoints/latest")).expect("checkpoints/latest");
    let path = run_dir.join("checkpoints").join(name.trim()).join("model.safetensors");
    let m: HashMap<String, Tensor> = candle_core::safetensors::load(path, &Device::Cpu).unwrap();
    let mut v: Vec<_> = m.iter().map(|(k, t)| (k.clone(), t.flatten_all().unwrap().to_vec1::<f32>().unwrap())).collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    (name.trim().to_string(), v)
}

/// The `last loss X` that rank 0 prints.
fn last_loss(text: &str) -> String {
    let at = text.find("last loss ").unwrap_or_else(|| panic!("no `last loss` in:\n{text}"));
    text[at + 10..].split(|c: char| c == ';' || c.is_whitespace()).next().unwrap().to_string()
}

#[test]
fn two_ranks_under_torchrun_end_where_launch_does() {
    if !asked_for() {
        return;
    }
    let torchrun = torchrun_or_fail();
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("run.yaml"), config(2, 4)).unwrap();
    let by_launch = ok(&launched(d.path(), &d.path().join("launch")), "launch");
    let by_torchrun =
        ok(&run(&mut torchrun_cmd(&torchrun, d.path(), &d.path().join("torchrun"), &[]), "torchrun", |_| {}), "torchrun");
    assert!(by_torchrun.contains("trained 8 of 8 steps on 2 rank(s)"), "{by_torchrun}");
    assert_eq!(last_loss(&by_torchrun), last_loss(&by_launch));
    assert_eq!(final_model(&d.path().join("torchrun")), final_model(&d.path().join("launch")));
}

/// The `train` processes torchrun's agent started.
fn workers_of(agent: u32) -> Vec<i32> {
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else { continue };
        // pid (comm) state ppid ...
        let Some(close) = stat.rfind(')') else { continue };
        let comm = &stat[stat.find('(').unwrap_or(0) + 1..close];
        let ppid = stat[close + 2..].split(' ').nth(1).and_then(|p| p.parse::<u32>().ok());
        if comm == "train" && ppid == Some(agent) {
            pids.push(stat.split(' ').next().unwrap().parse().unwrap());
        }
    }
    pids
}

#[test]
fn a_worker_killed_once_is_restarted_by_torchrun_and_resumes_exactly() {
    if !asked_for() {
        return;
    }
    let torchrun = torchrun_or_fail();
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("run.yaml"), config(150, 4)).unwrap();
    ok(&launched(d.path(), &d.path().join("straight")), "launch");

    let run_dir = d.path().join("killed");
    let mut killed = None;
    let mut cmd = torchrun_cmd(&torchrun, d.path(), &run_dir, &["--max-restarts", "1"]);
    let out = run(&mut cmd, "torchrun --max-restarts 1", |agent| {
        if killed.is_none() && run_dir.join("checkpoints/latest").exists() {
            let workers = workers_of(agent);
            if let Some(&pid) = workers.last() {
                // SAFETY: kill(2) on a process id read from /proc; no memory is involved.
                assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0, "SIGKILL of worker {pid}");
                killed = Some(pid);
            }
        }
    });
    let text = ok(&out, "torchrun --max-restarts 1");
    assert!(killed.is_some(), "no worker was killed: the run ended before its first checkpoint\n{text}");
    let resumed = text.lines().find(|l| l.contains("resumed from")).unwrap_or_else(|| panic!("no resume in:\n{text}"));
    let step: usize = resumed.rsplit("at step ").next().and_then(|s| s.trim().parse().ok()).expect(resumed);
    assert!(step > 0 && step < 600, "resumed at step {step}: {resumed}");
    assert!(text.contains("trained 600 of 600 steps"), "{text}");
    assert_eq!(final_model(&run_dir), final_model(&d.path().join("straight")), "resumed run differs");
}

#[test]
fn the_store_client_talks_to_pytorchs_tcpstore() {
    if !asked_for() {
        return;
    }
    let python = python().expect(
        "ALLGRAD_WITH_TORCH=1, but no Python imports torch.distributed (set ALLGRAD_PYTHON, or the python beside torchrun)",
    );
    let script = r#"
import datetime, sys, torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
print(s.port, flush=True)
p = dist.PrefixStore("/worker/attempt_2", s)
v = p.get("from_rust")
p.add("counter", 10)
p.set("from_python", v[::-1] + b"!")
p.wait(["done"])
print("python read", v.decode(), "and counter", int(p.get("counter")), flush=True)
"#;
    // Its output is read here line by line: a watchdog kills it (and fails the reads) past LIMIT.
    let mut child = Command::new(&python)
        .args(["-c", script])
        .process_group(0)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let _dog = allgrad_testkit::process::Watchdog::start(child.id(), "python with the TCPStore", LIMIT);
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let port = lines.next().expect("the store's port").unwrap();
    let store = TorchStore::connect(&format!("127.0.0.1:{}", port.trim()), Duration::from_secs(60))
        .unwrap()
        .with_prefix("/worker/attempt_2");
    store.ping(12345).unwrap();
    assert!(!store.check(&["from_python"]).unwrap());
    store.set("from_rust", b"abc").unwrap();
    assert_eq!(store.get("from_python").unwrap(), b"cba!");
    assert!(store.check(&["from_python", "counter"]).unwrap());
    store.wait(&["from_python"], Duration::from_secs(5)).unwrap();
    assert_eq!(store.add("counter", 5).unwrap(), 15);
    let err = store.wait(&["never"], Duration::from_millis(200)).unwrap_err().to_string();
    assert!(err.contains("timed out") && err.contains(port.trim()), "{err}");
    store.set("done", b"").unwrap();
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let status = allgrad_testkit::process::wait_exit(&mut child, "python with the TCPStore", LIMIT);
    assert!(status.success(), "python: {status} (its stderr is above)");
    assert_eq!(rest, ["python read abc and counter 15"]);
}
