//! `launch --max-restarts N`: a job whose ranks are SIGKILLed several times (a random rank, a
//! random delay after chosen checkpoints) is started again each time, resumes from its newest
//! checkpoint in the same run directory, and ends bit for bit where an uninterrupted job ends:
//! parameters, optimizer state, buffers (batch-norm running statistics) and every logged
//! metric. Once on the vectors method, once on a short SimCLR run with SyncBatchNorm and
//! evaluation, once on SimCLR streaming webdataset shards (killed in the middle of an epoch;
//! there, 2 ranks also end where 1 rank does). Also: a restart on a different number of ranks
//! resumes the replicated state and says so.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};

use crate::common;

fn vectors() -> String {
    common::vectors_config(
        "train: {global_batch: 24, epochs: 30}\ncheckpoint: {every: 1, keep_last: 2}\nlog: {every: 1, progress: lines, plot: false}\n",
    )
}

fn image_config() -> String {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/fashion-mnist");
    format!(
        "seed: 11\n\
         method: simclr\n\
         data:\n  kind: images\n  dir: {}\n  format: idx\n  knn: {{k: 20, bank: 256, queries: 64, linear_probe_steps: 20}}\n  augment:\n    \
         crop: {{size: 12, scale: [0.3, 1.0], ratio: [0.75, 1.3333]}}\n    normalize: {{mean: [0.286], std: [0.353]}}\n\
         model: {{kind: resnet, encoder: {{depth: 18, width: 4, in_channels: 1, stem: cifar, sync_bn: true}}, projector: {{out: 8, layers: 2}}}}\n\
         loss: {{kind: nt_xent, temperature: 0.5}}\n\
         optim: {{kind: lars, lr: 0.5, weight_decay: 1.0e-6}}\n\
         train: {{global_batch: 16, epochs: 1, max_steps: 16}}\n\
         checkpoint: {{every: 1, keep_last: 2}}\n\
         log: {{every: 1, progress: lines, plot: false}}\n",
        data.display()
    )
}

/// `launch [extra...] --nproc-per-node n train --config CONFIG --output-dir OUT`.
fn launched(dir: &Path, n: usize, extra: &[&str], out: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_launch"));
    c.args(extra)
        .args(["--nproc-per-node", &n.to_string(), env!("CARGO_BIN_EXE_train"), "--config"])
        .arg(dir.join("run.yaml"))
        .arg("--output-dir")
        .arg(out)
        .env("ALLGRAD_TIMEOUT_S", "60");
    c
}

/// Runs `cmd` to its end under a watchdog of `limit`.
fn run(cmd: &mut Command, what: &str, limit: Duration) -> Output {
    common::spawn_watched(cmd, what, limit).wait().0
}

fn ok(out: &Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "stdout:\n{}\nstderr:\n{err}", String::from_utf8_lossy(&out.stdout));
    err
}

fn latest_step(run_dir: &Path) -> Option<usize> {
    let name = std::fs::read_to_string(run_dir.join("checkpoints/latest")).ok()?;
    name.trim().strip_prefix("step_")?.parse().ok()
}

/// The launcher's children (the ranks), from /proc.
fn ranks_of(launcher: u32) -> Vec<i32> {
    let path = format!("/proc/{launcher}/task/{launcher}/children");
    std::fs::read_to_string(path).unwrap_or_default().split_whitespace().filter_map(|p| p.parse().ok()).collect()
}

/// Every tensor of the final checkpoint's files, as bits, by file and name.
fn final_state(run_dir: &Path) -> BTreeMap<String, Vec<u32>> {
    let step = latest_step(run_dir).expect("a final checkpoint");
    let ck = run_dir.join("checkpoints").join(format!("step_{step}"));
    let mut out = BTreeMap::new();
    for file in ["model", "optimizer", "buffers"] {
        let path = ck.join(format!("{file}.safetensors"));
        if !path.exists() {
            continue;
        }
        let tensors: std::collections::HashMap<String, Tensor> = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
        for (name, t) in tensors {
            let bits = t.to_dtype(candle_core::DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            out.insert(format!("{file}/{name}"), bits.iter().map(|v| v.to_bits()).collect());
        }
    }
    out.insert("step".into(), vec![step as u32]);
    out
}

/// metrics.jsonl without the wall-clock throughput (every other field is a function of the
/// training state), as text: the numbers are printed as shortest round-trip decimals, so equal
/// text is equal bits.
fn metrics(run_dir: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|line| match line.find(",\"samples_per_s\":") {
            None => line.to_string(),
            Some(at) => {
                let rest = &line[at + 1..];
                let end = rest.find([',', '}']).unwrap();
                format!("{}{}", &line[..at], &rest[end..])
            }
        })
        .collect()
}

/// Runs the config in `dir` on 2 ranks straight, then with `--max-restarts 3` while a ranks
/// is SIGKILLed (a random one, after a random extra delay) each time the newest checkpoint
/// reaches one of `kill_at` steps; both must end in the same state, bit for bit.
/// Returns the final state, the metrics and the killed job's stderr.
fn killed_job_ends_where_an_uninterrupted_one_does(
    dir: &Path,
    kill_at: &[usize],
    limit: Duration,
) -> (BTreeMap<String, Vec<u32>>, Vec<String>, String) {
    let straight = dir.join("straight");
    ok(&run(&mut launched(dir, 2, &[], &straight), "the uninterrupted job", limit));

    let killed = dir.join("killed");
    let restarts = kill_at.len().to_string();
    let child = common::spawn_watched(&mut launched(dir, 2, &["--max-restarts", &restarts], &killed), "the killed job", limit);
    let launcher = child.id();
    let mut rng = allgrad_rng::stream(&[0x6b696c6c, kill_at.len() as u64]);
    let started = Instant::now();
    for &at in kill_at {
        while latest_step(&killed).is_none_or(|s| s < at) {
            assert!(started.elapsed() < limit, "watchdog: the killed job never reached step {at}");
            std::thread::sleep(Duration::from_millis(2));
        }
        std::thread::sleep(Duration::from_millis(allgrad_rng::below(&mut rng, 40) as u64));
        let ranks = ranks_of(launcher);
        assert_eq!(ranks.len(), 2, "the launcher should have 2 ranks running near step {at}: {ranks:?}");
        let victim = ranks[allgrad_rng::below(&mut rng, ranks.len())];
        // SAFETY: plain kill(2) of a child of the launcher we started.
        unsafe {
            libc::kill(victim, libc::SIGKILL);
        }
        // The next kill waits for the restarted ranks (new pids).
        while ranks_of(launcher).contains(&victim) {
            assert!(started.elapsed() < limit, "watchdog: rank {victim} still a child of the launcher after SIGKILL");
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    let err = ok(&child.wait().0);
    for k in 1..=kill_at.len() {
        assert!(err.contains(&format!("restart {k} of {restarts}")), "restart {k} not reported:\n{err}");
    }
    assert!(err.contains("resumed from"), "no rank said it resumed:\n{err}");
    assert_eq!(final_state(&killed), final_state(&straight), "final checkpoint differs from the uninterrupted job's");
    let (got, want) = (metrics(&killed), metrics(&straight));
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "line {} of metrics.jsonl differs from the uninterrupted job's", i + 1);
    }
    assert_eq!(got.len(), want.len(), "metrics.jsonl has {} lines, the uninterrupted job's {}", got.len(), want.len());
    (final_state(&straight), want, err)
}

fn job_dir(config: &str) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("run.yaml"), config).unwrap();
    d
}

#[test]
fn vectors_job_killed_three_times_ends_bitwise_where_an_uninterrupted_one_does() {
    let d = job_dir(&vectors());
    killed_job_ends_where_an_uninterrupted_one_does(d.path(), &[7, 41, 90], Duration::from_secs(240));
}

#[test]
fn image_job_with_batch_norm_killed_twice_ends_bitwise_where_an_uninterrupted_one_does() {
    let d = job_dir(&image_config());
    let (state, metrics, _) = killed_job_ends_where_an_uninterrupted_one_does(d.path(), &[3, 10], Duration::from_secs(400));
    // What the comparison covered: batch-norm running statistics and the kNN evaluation.
    assert!(state.keys().any(|k| k.starts_with("buffers/") && k.contains("running_mean")), "{:?}", state.keys());
    assert!(metrics.iter().any(|l| l.contains("knn_top1")), "{metrics:?}");
}

#[test]
fn a_job_resumed_on_another_number_of_ranks_says_so_and_continues() {
    let d = job_dir(&vectors());
    let out: PathBuf = d.path().join("run");
    let limit = Duration::from_secs(120);
    let mut first = launched(d.path(), 2, &[], &out);
    first.args(["--stop-after", "8"]);
    ok(&run(&mut first, "the 2-rank part", limit));
    assert_eq!(latest_step(&out), Some(8));
    let mut second = launched(d.path(), 3, &[], &out);
    second.args(["--resume", "--stop-after", "12"]).env("ALLGRAD_LOG", "info");
    let err = ok(&run(&mut second, "the 3-rank part", limit));
    assert!(err.contains("written by 2 rank(s), this run has 3"), "the change of world size was not reported:\n{err}");
    assert_eq!(latest_step(&out), Some(12));
}

/// SimCLR (SyncBatchNorm, kNN monitor) on webdataset shards that `write-shards` writes from
/// the bundled Fashion-MNIST: 384 training samples in 8 shards, 128 test samples in 2; an
/// epoch of 64 samples (4 steps of 16) from 4 streams with shuffle buffers, 3 epochs.
fn webdataset_job() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    let fashion = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/fashion-mnist");
    let shards = d.path().join("shards");
    for (split, per, limit, pattern) in
        [("train", "48", "384", "train-{000000..000007}.tar"), ("test", "64", "128", "test-{000000..000001}.tar")]
    {
        let mut w = Command::new(env!("CARGO_BIN_EXE_write-shards"));
        w.args(["--format", "idx", "--split", split, "--per-shard", per, "--limit", limit, "--dir"]).arg(&fashion);
        w.arg("--out").arg(&shards);
        let out = run(&mut w, "write-shards", Duration::from_secs(60));
        ok(&out);
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), pattern);
    }
    let config = format!(
        "seed: 11\n\
         method: simclr\n\
         data:\n  kind: images\n  dir: {}\n  format: webdataset\n  folder: {{color: gray}}\n  \
         webdataset: {{train: ['train-{{000000..000007}}.tar'], test: ['test-{{000000..000001}}.tar'], epoch_samples: 64, streams: 4, shuffle_buffer: 16}}\n  \
         loader: {{workers: 2, prefetch: 2}}\n  \
         knn: {{k: 20, bank: 128, queries: 64, linear_probe_steps: 20}}\n  augment:\n    \
         crop: {{size: 12, scale: [0.3, 1.0], ratio: [0.75, 1.3333]}}\n    normalize: {{mean: [0.286], std: [0.353]}}\n\
         model: {{kind: resnet, encoder: {{depth: 18, width: 4, in_channels: 1, stem: cifar, sync_bn: true}}, projector: {{out: 8, layers: 2}}}}\n\
         loss: {{kind: nt_xent, temperature: 0.5}}\n\
         optim: {{kind: lars, lr: 0.5, weight_decay: 1.0e-6}}\n\
         train: {{global_batch: 16, epochs: 3}}\n\
         checkpoint: {{every: 1, keep_last: 2}}\n\
         log: {{every: 1, progress: lines, plot: false}}\n",
        shards.display()
    );
    std::fs::write(d.path().join("run.yaml"), config).unwrap();
    d
}

/// Every tensor of the final checkpoint (model, optimizer state, buffers) in f64, by file and
/// name.
fn final_values(run_dir: &Path) -> BTreeMap<String, Vec<f64>> {
    let step = latest_step(run_dir).expect("a final checkpoint");
    let ck = run_dir.join("checkpoints").join(format!("step_{step}"));
    let mut out = BTreeMap::new();
    for file in ["model", "optimizer", "buffers"] {
        let path = ck.join(format!("{file}.safetensors"));
        let tensors: std::collections::HashMap<String, Tensor> = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
        for (name, t) in tensors {
            let v = t.to_dtype(candle_core::DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
            out.insert(format!("{file}/{name}"), v);
        }
    }
    out.insert("step".into(), vec![step as f64]);
    out
}

#[test]
fn simclr_on_webdataset_shards_on_2_ranks_ends_where_1_rank_does() {
    // In f64 over two epochs (8 steps, an epoch boundary between): the streams give each
    // rank its part of every global batch, so the runs differ only by the rounding of sums
    // split over ranks (as the in-process SimCLR tests of allgrad-train: f64 at lr 0.05).
    let d = webdataset_job();
    let limit = Duration::from_secs(300);
    let sets = ["--set", "dtype=f64", "--set", "optim.lr=0.05", "--set", "train.epochs=2"];
    let one = d.path().join("w1");
    let mut train = Command::new(env!("CARGO_BIN_EXE_train"));
    train.arg("--config").arg(d.path().join("run.yaml")).args(sets).arg("--output-dir").arg(&one);
    ok(&run(&mut train, "the 1-rank job", limit));
    let two = d.path().join("w2");
    ok(&run(launched(d.path(), 2, &[], &two).args(sets), "the 2-rank job", limit));
    let (a, b) = (final_values(&one), final_values(&two));
    assert_eq!(a["step"], vec![8.0]);
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    let mut worst = (0f64, String::new());
    for (name, x) in &a {
        // Relative to each tensor's largest value (floored at 1e-3), as the f64 SimCLR tests.
        let scale = x.iter().fold(1e-3f64, |s, v| s.max(v.abs()));
        let d = x.iter().zip(&b[name]).map(|(p, q)| (p - q).abs() / scale).fold(0f64, f64::max);
        if d > worst.0 {
            worst = (d, name.clone());
        }
    }
    assert!(worst.0 <= 1e-10, "2 ranks vs 1: largest relative difference {:.2e} in {}", worst.0, worst.1);
    assert!(a.keys().any(|k| k.contains("running_mean")), "batch-norm statistics not compared");
    assert!(metrics(&one).iter().any(|l| l.contains("knn_top1")), "no kNN evaluation on the test shards");
}

#[test]
fn simclr_on_webdataset_shards_killed_mid_epoch_ends_bitwise_where_an_uninterrupted_job_does() {
    let d = webdataset_job();
    let (_, _, err) = killed_job_ends_where_an_uninterrupted_one_does(d.path(), &[2, 7], Duration::from_secs(400));
    // The streams were entered in the middle of an epoch (4 steps each) at least once.
    let resumed: Vec<usize> = err
        .split("resumed from ")
        .skip(1)
        .filter_map(|s| s.split(" at step ").nth(1)?.split_whitespace().next()?.parse().ok())
        .collect();
    assert!(resumed.iter().any(|s| s % 4 != 0), "every resume was at an epoch boundary: {resumed:?}");
}

/// The largest difference of two final checkpoints' values, relative to each tensor's largest
/// value (floored at 1e-3), and where.
fn worst_difference(a: &BTreeMap<String, Vec<f64>>, b: &BTreeMap<String, Vec<f64>>) -> (f64, String) {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    let mut worst = (0f64, String::new());
    for (name, x) in a {
        let scale = x.iter().fold(1e-3f64, |s, v| s.max(v.abs()));
        let d = x.iter().zip(&b[name]).map(|(p, q)| (p - q).abs() / scale).fold(0f64, f64::max);
        if d > worst.0 {
            worst = (d, name.clone());
        }
    }
    worst
}

#[test]
fn simclr_on_webdataset_shards_stopped_on_2_ranks_resumes_on_3_and_on_1_where_2_ranks_end() {
    // 6 streams, global batches of 12, epochs of 48 samples (4 steps), two epochs, in f64. The
    // 2-rank job stops in the middle of the first epoch (step 2) and of the second (step 6);
    // resumed on 3 ranks and on 1 from the saved stream position, both end where the
    // uninterrupted 2-rank job ends (only the rounding of sums split over other ranks
    // differs), with and without resampling.
    let d = webdataset_job();
    let limit = Duration::from_secs(300);
    for resampled in ["true", "false"] {
        let sets: Vec<String> = [
            "dtype=f64",
            "optim.lr=0.05",
            "train.epochs=2",
            "train.global_batch=12",
            "data.webdataset.streams=6",
            "data.webdataset.epoch_samples=48",
            &format!("data.webdataset.resampled={resampled}"),
        ]
        .iter()
        .flat_map(|s| ["--set".to_string(), s.to_string()])
        .collect();
        let straight = d.path().join(format!("straight-{resampled}"));
        ok(&run(launched(d.path(), 2, &[], &straight).args(&sets), "the uninterrupted 2-rank job", limit));
        let want = final_values(&straight);
        assert_eq!(want["step"], vec![8.0]);
        for (stop, w) in [(2, 3), (6, 1)] {
            let out = d.path().join(format!("resumed-{resampled}-{stop}-{w}"));
            let mut first = launched(d.path(), 2, &[], &out);
            first.args(&sets).args(["--stop-after", &stop.to_string()]);
            ok(&run(&mut first, "the stopped 2-rank job", limit));
            assert!(out.join(format!("checkpoints/step_{stop}/stream.json")).exists(), "no stream position saved");
            let mut second = launched(d.path(), w, &[], &out);
            second.args(&sets).arg("--resume").env("ALLGRAD_LOG", "info");
            let err = ok(&run(&mut second, "the resumed job", limit));
            assert!(err.contains("the stream resumes at its saved position"), "the saved position was not used:\n{err}");
            let (worst, name) = worst_difference(&want, &final_values(&out));
            assert!(
                worst <= 1e-10,
                "resampled {resampled}, stopped at step {stop} on 2 ranks, resumed on {w}: largest relative difference \
                 {worst:.2e} in {name}"
            );
        }
    }
}
