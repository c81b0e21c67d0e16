//! The fault drill on the GPU path: two ranks train SimCLR (SyncBatchNorm, so every step is
//! full of collectives of CUDA tensors) on the GPU; once a few checkpoints exist, rank 1 is
//! SIGKILLed at a random moment of a step. Rank 0 must fail within ALLGRAD_TIMEOUT_S, with an
//! error naming rank 1, and the last checkpoint must load. Nothing may hang: every process has
//! a watchdog.
//!
//! The ranks are started directly (the torchrun variables), not by `launch`, which would stop
//! the survivor as soon as rank 1 died and hide how it fails on its own.
//!
//! It runs on each path a 2-rank group can take: `host` (forced) and `auto`, which is NCCL
//! where the machine has two GPUs and the build has the `nccl` feature (then the survivor
//! waits in NCCL and must see the death on the TCP mesh and abort its communicator), and the
//! host otherwise (two ranks on one GPU).
//!
//! Without a GPU it prints why it skipped (`allgrad_testkit::skip`); with
//! ALLGRAD_REQUIRE_GPU=1 that is a failure. ALLGRAD_GPU_TEST_DEVICE=cpu runs the drill on the
//! CPU, to check the harness.

mod gpu_common;

use std::fs::File;
use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use candle_core::Device;
use gpu_common::{bin, repo_root, target, Target};

/// Says that `test` did not run and why, through the workspace's skip (a failure instead
/// under ALLGRAD_REQUIRE_GPU=1).
fn skip(test: &str, reason: &str) {
    allgrad_testkit::skip(allgrad_testkit::Need::Gpu, &format!("{test}: {reason}"));
}

/// The collective timeout of the drill: the survivor must fail well within it.
const TIMEOUT_S: u64 = 60;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn latest_step(run_dir: &Path) -> Option<usize> {
    let name = std::fs::read_to_string(run_dir.join("checkpoints/latest")).ok()?;
    name.trim().strip_prefix("step_")?.parse().ok()
}

/// Rank `rank` of 2, its output in `log`.
fn rank(rank: usize, port: u16, sets: &[String], out: &Path, log: &Path, mode: Option<&str>) -> Child {
    let mut c = Command::new(bin("train"));
    c.current_dir(repo_root()).args(["--config", "configs/simclr.yaml"]);
    for s in sets {
        c.args(["--set", s]);
    }
    c.arg("--output-dir").arg(out);
    c.env("RANK", rank.to_string())
        .env("WORLD_SIZE", "2")
        .env("LOCAL_RANK", rank.to_string())
        .env("LOCAL_WORLD_SIZE", "2")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("ALLGRAD_JOB_TOKEN", format!("gpu-fault-drill-{port}"))
        .env("ALLGRAD_TIMEOUT_S", TIMEOUT_S.to_string())
        .env_remove("ALLGRAD_CUDA_COLLECTIVES");
    if let Some(m) = mode {
        c.env("ALLGRAD_CUDA_COLLECTIVES", m);
    }
    let f = File::create(log).unwrap();
    c.stdout(f.try_clone().unwrap()).stderr(f);
    c.spawn().unwrap()
}

fn read(log: &Path) -> String {
    std::fs::read_to_string(log).unwrap_or_default()
}

/// Kills both ranks (the drill failed): no process outlives the test.
fn kill_all(ranks: &mut [Child]) {
    for r in ranks {
        let _ = r.kill();
        let _ = r.wait();
    }
}

fn drill(test: &str, mode: Option<&str>) {
    let t = match target() {
        Ok(t) => t,
        Err(reason) => return skip(test, &reason),
    };
    if t == Target::CpuHarness {
        eprintln!("{test}: ALLGRAD_GPU_TEST_DEVICE=cpu: the drill runs on the CPU; this checks the harness, not the GPU");
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let batch = if t == Target::CpuHarness { 16 } else { 128 };
    let sets: Vec<String> = [
        format!("device={}", t.device()),
        format!("train.global_batch={batch}"),
        "train.max_steps=100000".into(),
        "train.eval=false".into(),
        "checkpoint.every=2".into(),
        "checkpoint.keep_last=2".into(),
        "log.progress=quiet".into(),
        "log.plot=false".into(),
    ]
    .to_vec();
    let port = free_port();
    let logs = [dir.path().join("rank0.log"), dir.path().join("rank1.log")];
    let mut ranks: Vec<Child> = (0..2).map(|r| rank(r, port, &sets, &out, &logs[r], mode)).collect();

    // Train until the third checkpoint (step 6), then kill rank 1 at a random moment of a step.
    let started = Instant::now();
    while latest_step(&out).is_none_or(|s| s < 6) {
        let exited: Vec<usize> = (0..2).filter(|r| ranks[*r].try_wait().unwrap().is_some()).collect();
        if !exited.is_empty() || started.elapsed() > Duration::from_secs(300) {
            kill_all(&mut ranks);
            panic!(
                "{test}: the ranks did not reach step 6 (exited: {exited:?}, {:?})\nrank 0:\n{}\nrank 1:\n{}",
                started.elapsed(),
                read(&logs[0]),
                read(&logs[1])
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(rand::random::<u64>() % 200));
    ranks[1].kill().unwrap();
    let killed_at = Instant::now();
    ranks[1].wait().unwrap();

    // Rank 0 fails on its own, within the timeout, naming rank 1.
    let status = loop {
        if let Some(s) = ranks[0].try_wait().unwrap() {
            break s;
        }
        if killed_at.elapsed() > Duration::from_secs(TIMEOUT_S + 30) {
            kill_all(&mut ranks);
            panic!("{test}: rank 0 still running {:?} after rank 1 was killed:\n{}", killed_at.elapsed(), read(&logs[0]));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = killed_at.elapsed();
    let log0 = read(&logs[0]);
    let error = log0.lines().find(|l| l.starts_with("train: error")).unwrap_or("").to_string();
    assert!(!status.success(), "{test}: rank 0 succeeded after rank 1 died:\n{log0}");
    assert!(error.contains("rank 1"), "{test}: rank 0's error does not name rank 1:\n{log0}");
    assert!(took < Duration::from_secs(TIMEOUT_S), "{test}: rank 0 took {took:?}, beyond ALLGRAD_TIMEOUT_S={TIMEOUT_S}:\n{log0}");

    // The newest checkpoint is complete.
    let ck = allgrad_train::checkpoint::load_latest(&out, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{test}: the last checkpoint does not load: {e}"))
        .expect("a checkpoint");
    assert!(ck.state.step >= 6 && !ck.model.is_empty(), "{test}: checkpoint at step {}", ck.state.step);
    let path = log0.lines().find(|l| l.contains("collectives of CUDA tensors take")).unwrap_or("").trim().to_string();
    println!(
        "{test}: rank 1 SIGKILLed after step {}; rank 0 failed {:.2} s later naming it ({error:?}); checkpoint step_{} loads. {path}",
        ck.state.step,
        took.as_secs_f64(),
        ck.state.step
    );
}

#[test]
fn a_rank_killed_on_the_host_path_makes_the_other_fail_naming_it_and_leaves_a_loadable_checkpoint() {
    drill("gpu_fault_drill_host", Some("host"));
}

#[test]
fn a_rank_killed_on_the_auto_path_makes_the_other_fail_naming_it_and_leaves_a_loadable_checkpoint() {
    // NCCL with two GPUs (and the nccl feature), the host path on one.
    drill("gpu_fault_drill_auto", None);
}
