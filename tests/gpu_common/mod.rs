//! Shared by the GPU tests (`gpu_equivalence.rs`, `gpu_faults.rs`): where the binaries and
//! the shipped configs are, which device the tests run on, and what a finished run left
//! behind (its parameters, shards assembled, and its losses).
//!
//! The binaries are `train` and `launch` of this build, or those in ALLGRAD_GPU_BIN (the
//! directory `scripts/ci/build_cuda_bins.sh` fills, run by `scripts/ci/gpu_ci.sh` on a machine
//! without Rust). Configs and data are read from the repository root: the current directory
//! when it holds `configs/` (cargo runs tests there; gpu_ci.sh runs from there), else the
//! root this test was built in.
//!
//! ALLGRAD_GPU_TEST_DEVICE=cpu runs the same drills with `device=cpu` on a machine without a
//! GPU: it proves the harness (launching, reading checkpoints and shards, comparing), not the
//! GPU path, and the tests say so.

#![allow(dead_code)] // each test file uses a different subset

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;

use allgrad_train::shards::ShardMeta;
use candle_core::{DType, Device, Tensor};

/// Where the tests run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// On CUDA, with this many visible devices.
    Gpu(usize),
    /// On the CPU, to check the harness (ALLGRAD_GPU_TEST_DEVICE=cpu).
    CpuHarness,
}

impl Target {
    /// The `device:` value of the runs.
    pub fn device(self) -> &'static str {
        match self {
            Target::Gpu(_) => "cuda",
            Target::CpuHarness => "cpu",
        }
    }
}

/// The target, or why there is none (no GPU, or a build without the `cuda` feature).
pub fn target() -> Result<Target, String> {
    match std::env::var("ALLGRAD_GPU_TEST_DEVICE").as_deref() {
        Ok("cpu") => return Ok(Target::CpuHarness),
        Ok("") | Ok("cuda") | Err(_) => {}
        Ok(other) => return Err(format!("ALLGRAD_GPU_TEST_DEVICE={other:?} is neither cuda (default) nor cpu")),
    }
    gpu_count().map(Target::Gpu)
}

#[cfg(feature = "cuda")]
fn gpu_count() -> Result<usize, String> {
    use candle_core::cuda::cudarc::driver::CudaContext;
    match CudaContext::device_count() {
        Ok(n) if n > 0 => Ok(n as usize),
        Ok(_) => Err("no CUDA device is visible".into()),
        Err(e) => Err(format!("no CUDA device is visible (the driver says {e:?})")),
    }
}

#[cfg(not(feature = "cuda"))]
fn gpu_count() -> Result<usize, String> {
    Err("this test binary was built without the `cuda` feature (cargo test --features cuda,nccl,cudnn, \
         or scripts/ci/build_cuda_bins.sh)"
        .into())
}

/// The repository root (configs, data).
pub fn repo_root() -> PathBuf {
    let here = std::env::current_dir().expect("a current directory");
    if here.join("configs").is_dir() {
        here
    } else {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
    }
}

/// A binary of this build, or of ALLGRAD_GPU_BIN.
pub fn bin(name: &str) -> PathBuf {
    let p = match std::env::var_os("ALLGRAD_GPU_BIN") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir).join(name),
        _ => PathBuf::from(match name {
            "train" => env!("CARGO_BIN_EXE_train"),
            "launch" => env!("CARGO_BIN_EXE_launch"),
            other => panic!("no binary {other}"),
        }),
    };
    assert!(p.is_file(), "{} does not exist", p.display());
    p
}

/// `launch --nproc-per-node W train --config CONFIG --set ... --output-dir OUT`, run from the
/// repository root.
pub fn launched_train(w: usize, config: &str, sets: &[String], out: &Path) -> Command {
    let mut c = Command::new(bin("launch"));
    c.current_dir(repo_root()).args(["--nproc-per-node", &w.to_string()]).arg(bin("train")).args(["--config", config]);
    for s in sets {
        c.args(["--set", s]);
    }
    c.arg("--output-dir").arg(out);
    c
}

/// What a run left: every parameter and buffer of its latest checkpoint as f64 (sharded
/// parameters assembled from every rank's shard by their global rows), its step, and the loss
/// of each logged step.
#[derive(Debug)]
pub struct Trained {
    /// `model/<name>`, `buffers/<name>` and `shard/<name>` (assembled).
    pub tensors: BTreeMap<String, Vec<f64>>,
    /// The checkpoint's step.
    pub step: usize,
    /// (step, loss) from metrics.jsonl.
    pub losses: Vec<(usize, f64)>,
}

/// Reads a run directory (see [`Trained`]).
pub fn read_run(run_dir: &Path) -> Trained {
    let ck = allgrad_train::checkpoint::load_latest(run_dir, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", run_dir.display()))
        .unwrap_or_else(|| panic!("{}: no checkpoint", run_dir.display()));
    let flat = |t: &Tensor| -> Vec<f64> { t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap() };
    let mut tensors = BTreeMap::new();
    for (name, t) in &ck.model {
        tensors.insert(format!("model/{name}"), flat(t));
    }
    for (name, t) in &ck.buffers {
        tensors.insert(format!("buffers/{name}"), flat(t));
    }
    for (name, rows) in assemble_shards(&ck.path) {
        tensors.insert(format!("shard/{name}"), rows);
    }
    Trained { tensors, step: ck.state.step, losses: losses(run_dir) }
}

/// Each sharded parameter of a checkpoint directory, its rows put in global order.
fn assemble_shards(dir: &Path) -> BTreeMap<String, Vec<f64>> {
    let mut pieces: BTreeMap<String, Vec<(usize, Vec<f64>)>> = BTreeMap::new();
    for r in 0.. {
        let meta_path = dir.join(format!("shard_{r}.json"));
        if !meta_path.exists() {
            break;
        }
        let meta: ShardMeta = serde_json::from_slice(&std::fs::read(&meta_path).unwrap()).unwrap();
        let tensors: HashMap<String, Tensor> =
            candle_core::safetensors::load(dir.join(format!("shard_{r}.safetensors")), &Device::Cpu).unwrap();
        for (name, range) in &meta.params {
            let range = range.as_ref().unwrap_or_else(|| panic!("{name} in shard_{r} has no row range"));
            let t = &tensors[name];
            let v = t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
            pieces.entry(name.clone()).or_default().push((range.start, v));
        }
    }
    pieces
        .into_iter()
        .map(|(name, mut p)| {
            p.sort_by_key(|(start, _)| *start);
            (name, p.into_iter().flat_map(|(_, v)| v).collect())
        })
        .collect()
}

/// (step, loss) of every line of metrics.jsonl that has both.
fn losses(run_dir: &Path) -> Vec<(usize, f64)> {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| Some((v.get("step")?.as_u64()? as usize, v.get("loss")?.as_f64()?)))
        .collect()
}

/// Root-mean-square below which a tensor counts as zero-sized: [`rel_norm`] divides by
/// `√n · ZERO_SCALE_RMS` at least. A parameter whose gradient is zero by construction (a bias
/// followed by a batch norm: the face embedding's `bn1.bias`) holds only rounding noise
/// (about 1e-17 in f64 after 3 steps, measured) that differs between any two runs, so its
/// relative error is meaningless; trained tensors are far above 1e-3 RMS, and for them the
/// comparison is purely relative.
pub const ZERO_SCALE_RMS: f64 = 1e-3;

/// ‖a − b‖ / max(‖b‖, √n · [`ZERO_SCALE_RMS`]) (`allgrad_testkit::close::rel_err_floor`).
pub fn rel_norm(a: &[f64], b: &[f64]) -> f64 {
    allgrad_testkit::close::rel_err_floor(a, b, (b.len() as f64).sqrt() * ZERO_SCALE_RMS)
}

/// Compares two runs tensor by tensor (norm-wise relative error, see [`rel_norm`]) and loss by
/// loss (element-wise, `allgrad_testkit::close::elem_rel_err`); returns the largest error and
/// where, or a message naming the first tensor over `tol`. Each error is reported
/// (`ALLGRAD_TEST_ERRORS=1`).
pub fn compare(what: &str, got: &Trained, want: &Trained, tol: f64) -> Result<(f64, String), String> {
    if got.step != want.step {
        return Err(format!("{what}: checkpoint at step {} vs {}", got.step, want.step));
    }
    let names = |t: &Trained| t.tensors.keys().cloned().collect::<Vec<_>>();
    if names(got) != names(want) {
        return Err(format!("{what}: tensors {:?} vs {:?}", names(got), names(want)));
    }
    let mut worst = (0.0f64, String::new());
    for (name, b) in &want.tensors {
        let a = &got.tensors[name];
        if a.len() != b.len() {
            return Err(format!("{what}: {name} has {} values vs {}", a.len(), b.len()));
        }
        let e = rel_norm(a, b);
        allgrad_testkit::close::report(&format!("{what}: {name}"), e, tol);
        if e.is_nan() || e > tol {
            let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
            return Err(format!(
                "{what}: {name}: ‖a − b‖/‖b‖ = {e:.3e} > {tol:e} (see rel_norm; ‖a‖ = {:.3e}, ‖b‖ = {:.3e}, {} values; first: {:?} vs {:?})",
                norm(a),
                norm(b),
                b.len(),
                &a[..a.len().min(3)],
                &b[..b.len().min(3)]
            ));
        }
        if e > worst.0 {
            worst = (e, name.clone());
        }
    }
    if got.losses.len() != want.losses.len() || got.losses.is_empty() {
        return Err(format!("{what}: losses {:?} vs {:?}", got.losses, want.losses));
    }
    for ((s1, l1), (s2, l2)) in got.losses.iter().zip(&want.losses) {
        let (e, _) = allgrad_testkit::close::elem_rel_err(&[*l1], &[*l2], f64::MIN_POSITIVE);
        allgrad_testkit::close::report(&format!("{what}: loss of step {s1}"), e, tol);
        if s1 != s2 || e.is_nan() || e > tol {
            return Err(format!("{what}: step {s1} loss {l1} vs step {s2} loss {l2} (relative {e:.3e} > {tol:e})"));
        }
        if e > worst.0 {
            worst = (e, format!("loss of step {s1}"));
        }
    }
    Ok(worst)
}
