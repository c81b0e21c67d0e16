//! The defining test on a GPU: W ranks on the GPU end where 1 rank on the GPU does, at the
//! same global batch, through `launch` and the shipped configs (shortened with `--set`):
//! SimCLR (SyncBatchNorm), BarlowTwins, SimCSE unsupervised and supervised (a small BERT from
//! a random initialisation; all-MiniLM-L6-v2 where scripts/data/get_minilm.sh has fetched it), the
//! face head (negative-class sampling on, class-sharded), vectors, and CLIP (gathered, and the
//! ring in tiles) and SigLIP's ring form (the tiny CLIP architecture from a random
//! initialisation). Each runs 3 optimizer
//! steps at W = 1 and W = 2 (and W = 3 for the face head: shards of 667, 667 and 666
//! classes), and again at W = 1 on the CPU; every parameter, batch-norm buffer and assembled
//! head shard of the final checkpoints, and every logged loss, is compared.
//!
//! Precision: f64, compared at ‖a − b‖/‖b‖ <= 1e-10 per tensor (tensors of RMS below 1e-3,
//! which hold rounding noise where a gradient is zero by construction, at 1e-13 RMS absolute:
//! `gpu_common::rel_norm`, through `allgrad_testkit::close`). Every method runs in f64 on CUDA
//! (all did on an H200, docs/gpu.md), so each test names its dtype up front ([`DTYPE`]) and a
//! run that fails (an op missing in f64, a crash in a kernel) fails the test: nothing falls back
//! to f32.
//!
//! Ranks on one GPU share it: collectives take the host path ([`allgrad_dist::gpu`]); with
//! two GPUs or more, W = 2 goes through NCCL (when built with `nccl`). The run's log says which
//! (`collectives of CUDA tensors take the ... path`); the test prints it.
//!
//! Without a GPU (or in a build without the `cuda` feature) every test prints why it skipped
//! (`allgrad_testkit::skip`); with ALLGRAD_REQUIRE_GPU=1 that is a failure.
//! ALLGRAD_GPU_TEST_DEVICE=cpu runs everything on the CPU, to check the harness.

mod common;
mod gpu_common;

use std::path::Path;
use std::time::Duration;

use gpu_common::{compare, launched_train, read_run, repo_root, target, Target, Trained};

/// Says that `test` did not run and why, through the workspace's skip (a failure instead
/// where the machine should provide the need: a GPU under ALLGRAD_REQUIRE_GPU=1).
fn skip(test: &str, reason: &str, gpu: bool) {
    let need = if gpu { allgrad_testkit::Need::Gpu } else { allgrad_testkit::Need::MiniLm };
    allgrad_testkit::skip(need, &format!("{test}: {reason}"));
}

/// The dtype of every method's runs and its tolerance: f64 for all (each ran in f64 on an H200;
/// a method that could not would be listed here with its own dtype and the reason).
const DTYPE: (&str, f64) = ("f64", 1e-10);

/// Every run's limit (a watchdog kills it and fails the test).
const LIMIT: Duration = Duration::from_secs(600);

/// The settings every run gets: 3 steps at global batch 24 (divisible by 1, 2 and 3), no
/// evaluation, a checkpoint at the end only, a loss line per step.
fn common_sets(device: &str, dtype: &str) -> Vec<String> {
    [
        format!("device={device}"),
        format!("dtype={dtype}"),
        "train.global_batch=24".into(),
        "train.max_steps=3".into(),
        "train.eval=false".into(),
        "checkpoint.every=0".into(),
        "checkpoint.keep_last=1".into(),
        "log.every=1".into(),
        "log.progress=quiet".into(),
        "log.plot=false".into(),
    ]
    .to_vec()
}

/// Runs `config` with `sets` on `w` ranks on `device`; the run's stderr on failure.
fn train(
    dir: &Path,
    tag: &str,
    w: usize,
    device: &str,
    dtype: &str,
    config: &str,
    sets: &[&str],
) -> Result<(Trained, String), String> {
    let out = dir.join(tag);
    let mut all = common_sets(device, dtype);
    all.extend(sets.iter().map(|s| s.to_string()));
    let mut cmd = launched_train(w, config, &all, &out);
    cmd.env("ALLGRAD_TIMEOUT_S", "300");
    let (o, took) = common::run_with_watchdog(&mut cmd, LIMIT);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    if !o.status.success() {
        return Err(format!("{tag} failed ({:?}):\n{err}", o.status));
    }
    let path = err.lines().find(|l| l.contains("collectives of CUDA tensors take")).unwrap_or("").trim().to_string();
    eprintln!("  {tag}: {w} rank(s) on {device} in {:.1} s {path}", took.as_secs_f64());
    Ok((read_run(&out), path))
}

/// W ranks vs 1 on the target, and 1 on the CPU vs 1 on the target (see the module docs).
fn equivalence(test: &str, config: &str, sets: &[&str], world_sizes: &[usize]) {
    let t = match target() {
        Ok(t) => t,
        Err(reason) => return skip(test, &reason, true),
    };
    if t == Target::CpuHarness {
        eprintln!("{test}: ALLGRAD_GPU_TEST_DEVICE=cpu: every run on the CPU; this checks the harness, not the GPU");
    }
    let dir = tempfile::tempdir().unwrap();
    let dev = t.device();
    let (dtype, tol) = DTYPE;
    let (one, _) =
        train(dir.path(), &format!("w1-{dtype}"), 1, dev, dtype, config, sets).unwrap_or_else(|e| panic!("{test}: {e}"));
    let moved = one.losses.windows(2).any(|p| p[0].1 != p[1].1);
    assert!(moved && one.losses.len() == 3, "{test}: the losses must be 3 and change: {:?}", one.losses);
    for &w in world_sizes {
        let (many, path) =
            train(dir.path(), &format!("w{w}-{dtype}"), w, dev, dtype, config, sets).unwrap_or_else(|e| panic!("{test}: {e}"));
        let (worst, at) = compare(&format!("{test}: W={w} vs W=1 on {dev}"), &many, &one, tol).unwrap_or_else(|e| panic!("{e}"));
        println!("{test}: W={w} == W=1 on {dev} ({dtype}, {tol:e}): largest relative difference {worst:.2e} ({at}) {path}");
    }
    if dev != "cpu" {
        let (cpu, _) = train(dir.path(), &format!("cpu-w1-{dtype}"), 1, "cpu", dtype, config, sets)
            .unwrap_or_else(|e| panic!("{test}: {e}"));
        let (worst, at) =
            compare(&format!("{test}: W=1 on cuda vs W=1 on cpu"), &one, &cpu, tol).unwrap_or_else(|e| panic!("{e}"));
        println!("{test}: W=1 on cuda == W=1 on cpu ({dtype}, {tol:e}): largest relative difference {worst:.2e} ({at})");
    }
}

#[test]
fn simclr_with_sync_batch_norm_on_2_ranks_equals_1_rank() {
    equivalence("simclr", "configs/simclr.yaml", &[], &[2]);
}

#[test]
fn barlowtwins_on_2_ranks_equals_1_rank() {
    equivalence("barlowtwins", "configs/barlowtwins.yaml", &[], &[2]);
}

/// SGD for SimCSE's comparisons instead of the configs' AdamW: AdamW divides each gradient by
/// its running RMS, so a gradient that is zero by construction (attention's key bias: the
/// softmax ignores a shift common to all keys) becomes a full step of size lr in the
/// direction of its rounding noise, which differs between any two runs (measured: the key
/// biases of a 2-rank and a 1-rank run on the CPU 1.0 apart, relatively). SGD leaves such
/// noise at its own size.
const SIMCSE_SGD: &str = "optim={kind: sgd, lr: 0.05, momentum: 0.9}";

/// The small BERT committed for the tests, from a random initialisation, trained with SGD.
const SMALL_BERT: [&str; 4] =
    ["model.dir=crates/allgrad-models/tests/data/tiny-bert", "model.pretrained=false", "model.max_len=16", SIMCSE_SGD];

#[test]
fn simcse_unsupervised_small_random_bert_on_2_ranks_equals_1_rank() {
    equivalence("simcse", "configs/simcse.yaml", &SMALL_BERT, &[2]);
}

#[test]
fn simcse_supervised_small_random_bert_on_2_ranks_equals_1_rank() {
    equivalence("simcse_sup", "configs/simcse_sup.yaml", &SMALL_BERT, &[2]);
}

#[test]
fn simcse_minilm_on_2_ranks_equals_1_rank() {
    let test = "simcse_minilm";
    if !repo_root().join("data/models/all-MiniLM-L6-v2/model.safetensors").is_file() {
        return skip(test, "data/models/all-MiniLM-L6-v2 is absent (scripts/data/get_minilm.sh fetches it)", false);
    }
    equivalence(test, "configs/simcse.yaml", &["model.max_len=16", SIMCSE_SGD], &[2]);
}

#[test]
fn face_head_with_sampling_on_2_and_3_ranks_equals_1_rank() {
    equivalence("face", "configs/face.yaml", &["head.sample_rate=0.5"], &[2, 3]);
}

#[test]
fn vectors_on_2_ranks_equals_1_rank() {
    equivalence("vectors", "configs/vectors.yaml", &[], &[2]);
}

/// CLIP from a fresh initialisation of the tiny architecture, with SGD for the reason of
/// [`SIMCSE_SGD`] (the attention key biases).
const CLIP_SGD: &str = "optim={kind: sgd, lr: 0.05, momentum: 0.9}";

#[test]
fn clip_on_2_ranks_equals_1_rank() {
    equivalence("clip", "configs/clip.yaml", &[CLIP_SGD], &[2]);
}

#[test]
fn clip_siglip_ring_on_2_ranks_equals_1_rank() {
    equivalence("siglip_ring", "configs/clip.yaml", &["loss={kind: siglip_ring}", CLIP_SGD], &[2]);
}

/// CLIP's memory-flat ring, in tiles, its embeddings staged from the GPU through host memory.
#[test]
fn clip_ring_tiled_on_2_ranks_equals_1_rank() {
    equivalence("clip_ring", "configs/clip.yaml", &["loss={kind: clip_ring, tile: 4}", CLIP_SGD], &[2]);
}

/// Rank r's rows of the in-process ring test: uneven, none alike.
fn ring_shard(r: usize) -> usize {
    (r * 5 + 2) % 4 + 1
}

/// One rank's loss, embedding gradients and parameter gradients of a ring (or gather) loss
/// on `dev`, its ring counts and its tiled-path counts.
type RingLossRun = (f64, Vec<f64>, Vec<f64>, Vec<f64>, allgrad::dist::RingCounts, allgrad::models::TiledPaths);

fn ring_loss_run(
    pg: &allgrad::dist::ProcessGroup,
    dev: &candle_core::Device,
    siglip: bool,
    ring: Option<allgrad::models::clip::RingOptions>,
) -> candle_core::Result<RingLossRun> {
    use allgrad::models::clip::{clip_loss, clip_loss_ring, siglip_loss, siglip_loss_ring};
    use candle_core::{Device, Tensor, Var};
    let (w, r) = (pg.world_size(), pg.rank());
    let d = 6;
    let rows = ring_shard(r);
    let values = |phase: f64| -> Vec<f64> {
        (0..rows * d).map(|j| ((j as f64) * 0.41 + phase + 1.7 * r as f64).sin() * (1.0 + (j % 5) as f64 * 0.2)).collect()
    };
    let on = |v: Vec<f64>, shape: &[usize]| Var::from_tensor(&Tensor::from_vec(v, shape, &Device::Cpu)?.to_device(dev)?);
    let (i, t) = (on(values(0.0), &[rows, d])?, on(values(1.3), &[rows, d])?);
    let s = on(vec![1.1], &[])?;
    let b = on(vec![-1.5], &[])?;
    let (counts0, paths0) = (pg.ring_counts(), allgrad::models::tiled_paths());
    let loss = match (siglip, ring) {
        (false, None) => clip_loss(i.as_tensor(), t.as_tensor(), s.as_tensor(), pg)?,
        (true, None) => siglip_loss(i.as_tensor(), t.as_tensor(), s.as_tensor(), b.as_tensor(), pg)?,
        (false, Some(o)) => clip_loss_ring(i.as_tensor(), t.as_tensor(), s.as_tensor(), o, pg)?,
        (true, Some(o)) => siglip_loss_ring(i.as_tensor(), t.as_tensor(), s.as_tensor(), b.as_tensor(), o, pg)?,
    };
    let g = (&loss / w as f64)?.backward()?;
    let counts = pg.ring_counts().since(counts0);
    let paths = allgrad::models::tiled_paths().since(paths0);
    let host = |v: &Var| -> candle_core::Result<Vec<f64>> {
        match g.get(v) {
            Some(x) => x.flatten_all()?.to_device(&Device::Cpu)?.to_vec1::<f64>(),
            None => Ok(vec![0.0; v.elem_count()]),
        }
    };
    let params = [host(&s)?, if siglip { host(&b)? } else { Vec::new() }].concat();
    Ok((loss.to_device(&Device::Cpu)?.to_scalar::<f64>()?, host(&i)?, host(&t)?, params, counts, paths))
}

/// CLIP's and SigLIP's ring losses with CUDA embeddings, in one process (ranks as threads on
/// GPU r % GPUs, `auto` collectives): loss and every gradient equal the gather forms on the
/// CPU at the same W (f64, 1e-10), W = 1, 2, 3, uneven shards, both ways and one way, in tiles
/// and chunks of 1 to 3 rows. Where the group goes through NCCL (a GPU per rank) the ring's
/// tensor form ran: nothing staged through the host, every exchange on the device, one host
/// wait per pass (forward and backward); elsewhere the host form ran, staged.
#[test]
fn clip_and_siglip_ring_losses_on_cuda_equal_the_gather_on_the_cpu_in_one_process() {
    use allgrad::dist::gpu::{cuda_ordinal, CudaCollectives, CudaPath};
    use allgrad::dist::ThreadWorld;
    use allgrad::models::clip::RingOptions;
    let test = "clip_and_siglip_ring_losses_on_cuda_equal_the_gather_on_the_cpu_in_one_process";
    let gpus = match target() {
        Ok(Target::Gpu(n)) => n,
        Ok(Target::CpuHarness) => return skip(test, "ALLGRAD_GPU_TEST_DEVICE=cpu: this test is about CUDA tensors", true),
        Err(reason) => return skip(test, &reason, true),
    };
    let opts = [
        RingOptions { bidirectional: true, tile: None, chunk: None },
        RingOptions { bidirectional: false, tile: Some(2), chunk: Some(1) },
        RingOptions { bidirectional: true, tile: Some(3), chunk: Some(2) },
        RingOptions { bidirectional: true, tile: Some(1), chunk: Some(3) },
    ];
    for w in [1, 2, 3] {
        for siglip in [false, true] {
            let cpu = ThreadWorld::new(w).run(|pg| ring_loss_run(&pg, &candle_core::Device::Cpu, siglip, None)).unwrap();
            for o in opts {
                let gpu = ThreadWorld::new(w)
                    .cuda_collectives(CudaCollectives::Auto)
                    .run(|pg| {
                        let ordinal = cuda_ordinal(pg.rank(), w, gpus, None).map_err(candle_core::Error::Msg)?;
                        let dev = candle_core::Device::new_cuda(ordinal)?;
                        let path = pg.cuda_path(&dev)?;
                        Ok((ring_loss_run(&pg, &dev, siglip, Some(o))?, path))
                    })
                    .unwrap();
                let what = format!("{} ring {o:?} W={w}", if siglip { "SigLIP" } else { "CLIP" });
                for (r, ((g, path), c)) in gpu.iter().zip(&cpu).enumerate() {
                    let what = format!("{what} rank {r} ({path} path)");
                    allgrad_testkit::close::assert_rel(&[g.0], &[c.0], 1e-10, &format!("{what}: loss"));
                    allgrad_testkit::close::assert_rel(&g.1, &c.1, 1e-10, &format!("{what}: image gradients"));
                    allgrad_testkit::close::assert_rel(&g.2, &c.2, 1e-10, &format!("{what}: text gradients"));
                    allgrad_testkit::close::assert_rel(&g.3, &c.3, 1e-10, &format!("{what}: scale (and bias) gradients"));
                    let (counts, paths) = (&g.4, &g.5);
                    if *path == CudaPath::Nccl {
                        assert_eq!(paths.ring_staged, 0, "{what}: nothing staged through the host: {paths:?}");
                        assert_eq!(counts.device_exchanges, counts.exchanges, "{what}: {counts:?}");
                        assert!(w == 1 || counts.device_exchanges > 0, "{what}: {counts:?}");
                        assert_eq!(counts.host_waits, if w == 1 { 0 } else { 2 }, "{what}: one host wait per pass: {counts:?}");
                    } else {
                        assert_eq!(counts.device_exchanges, 0, "{what}: {counts:?}");
                    }
                }
                println!("{what}: on CUDA == the gather on the CPU (f64, 1e-10), path {}", gpu[0].1);
            }
        }
    }
}
