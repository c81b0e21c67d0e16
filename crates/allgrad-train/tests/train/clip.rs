//! CLIP and SigLIP through the trainer, on the committed tiny CLIP architecture
//! (`data/clip-tiny`, a fresh keyed initialisation in f64) and the first 36
//! Fashion-MNIST images captioned from class names: 2 and 3 ranks end 4 AdamW steps with the
//! same per-step losses and parameters as 1 rank at the same global batch of 12 (f64, 1e-10),
//! for CLIP's loss whole and tiled, SigLIP's in both forms, and with gradient caching; a
//! cached step equals the plain one; both ring forms (tiled, cached) equal the gather forms. The
//! same for SigLIP's architecture (a `SiglipModel` folder: attention-pool head, last-token text
//! pooling, its own logit bias).

use std::collections::BTreeMap;
use std::path::PathBuf;

use allgrad_dist::run_threads;
use allgrad_models::clip::{Clip, ClipData, ClipLoss, ClipModelSection, LossKind};
use allgrad_train::checkpoint::CheckpointConfig;
use allgrad_train::metrics::{LogConfig, Progress};
use allgrad_train::optim::OptimConfig;
use allgrad_train::schedule::ScheduleConfig;
use allgrad_train::TrainSection;
use allgrad_train::{Trainer, TrainerConfig};
use candle_core::{DType, Device};

use crate::common::max_rel_diff_floor;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn data() -> ClipData {
    let names = ["t-shirt", "trousers", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle boot"];
    ClipData {
        csv: None,
        images: Some(repo().join("data/fashion-mnist")),
        classes: names.iter().map(|n| vec![n.to_string(), format!("{n} item")]).collect(),
        templates: vec!["a photo of a {}.".into(), "{}".into(), "this is the {} for sale".into()],
        limit: Some(36),
        ..Default::default()
    }
}

struct Run {
    losses: Vec<f64>,
    params: BTreeMap<String, Vec<f64>>,
}

fn train(w: usize, kind: LossKind, tile: Option<usize>, cache_chunk: Option<usize>, steps: usize) -> Run {
    train_in(&repo().join("data/clip-tiny"), w, kind, tile, cache_chunk, steps)
}

/// A tiny `SiglipModel` folder for 28 x 28 gray images, with `data/clip-tiny`'s tokenizer.
fn siglip_folder() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(repo().join("data/clip-tiny/tokenizer.json"), dir.path().join("tokenizer.json")).unwrap();
    let config = serde_json::json!({
        "model_type": "siglip",
        "text_config": {"vocab_size": 707, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "max_position_embeddings": 16, "pad_token_id": 706,
                        "eos_token_id": 706, "projection_size": 48},
        "vision_config": {"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                          "num_channels": 1, "image_size": 28, "patch_size": 7}
    });
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    dir
}

fn train_in(
    dir: &std::path::Path,
    w: usize,
    kind: LossKind,
    tile: Option<usize>,
    cache_chunk: Option<usize>,
    steps: usize,
) -> Run {
    let model = ClipModelSection { dir: dir.to_path_buf(), pretrained: false, max_len: None, mean: None, std: None };
    let loss = ClipLoss { kind, tile, ..Default::default() };
    let cfg = TrainerConfig {
        seed: 5,
        dtype: DType::F64,
        precision: Default::default(),
        device: Device::Cpu,
        train: TrainSection {
            global_batch: 12,
            epochs: 2,
            max_steps: Some(steps),
            accumulate: 1,
            clip_grad_norm: Some(5.0),
            on_nonfinite: Default::default(),
            shuffle: true,
            eval: false,
            cache_chunk,
        },
        optim: OptimConfig::Adamw { lr: 3e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 },
        param_groups: Default::default(),
        schedule: ScheduleConfig { warmup_steps: 2, ..Default::default() },
        checkpoint: CheckpointConfig::default(),
        log: LogConfig { progress: Progress::Quiet, plot: false, ..Default::default() },
        settings: Default::default(),
    };
    run_threads(w, |pg| {
        let objective = Clip::new(&model, loss.clone(), &data(), 5, 12, Device::Cpu)?;
        let mut t = Trainer::new(cfg.clone(), Box::new(objective), pg, None, false)?;
        let losses = (1..=steps).map(|s| Ok(t.train_until(s)?.last_loss)).collect::<candle_core::Result<Vec<_>>>()?;
        let mut params = BTreeMap::new();
        for (n, v) in t.params() {
            params.insert(n.clone(), v.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?);
        }
        Ok(Run { losses, params })
    })
    .unwrap()
    .remove(0)
}

/// The parameters whose gradient is not identically zero: the attention key bias adds
/// `q · b_k` to every score of a query row, which the softmax cancels; its computed gradient
/// is rounding noise, which AdamW magnifies to updates of full size and arbitrary sign.
fn comparable(params: &BTreeMap<String, Vec<f64>>) -> BTreeMap<String, Vec<f64>> {
    params.iter().filter(|(n, _)| !n.ends_with("self_attn.k_proj.bias")).map(|(n, v)| (n.clone(), v.clone())).collect()
}

fn assert_same(run: &Run, one: &Run, tol: f64, what: &str) {
    for (s, (a, b)) in run.losses.iter().zip(&one.losses).enumerate() {
        let d = (a - b).abs() / b.abs();
        assert!(d <= tol, "{what} step {}: loss {a} vs {b} (rel. {d:.2e})", s + 1);
    }
    let (d, name) = max_rel_diff_floor(&comparable(&run.params), &comparable(&one.params), 1e-2);
    assert!(d <= tol, "{what}: largest relative parameter difference {d:.2e} in {name}");
}

fn assert_equivalent(kind: LossKind, tile: Option<usize>, cache_chunk: Option<usize>) {
    let one = train(1, kind, tile, None, 4);
    assert!(one.losses.iter().all(|l| l.is_finite() && *l > 0.01), "losses {:?}", one.losses);
    for w in [2, 3] {
        assert_same(
            &train(w, kind, tile, cache_chunk, 4),
            &one,
            1e-10,
            &format!("{kind:?} tile {tile:?} cache {cache_chunk:?} W={w} vs plain W=1"),
        );
    }
}

#[test]
fn clip_on_2_and_3_ranks_equals_1_rank_in_f64() {
    assert_equivalent(LossKind::Clip, None, None);
}

#[test]
fn tiled_clip_on_2_and_3_ranks_equals_untiled_1_rank_in_f64() {
    let one = train(1, LossKind::Clip, None, None, 4);
    for w in [1, 2, 3] {
        assert_same(&train(w, LossKind::Clip, Some(5), None, 4), &one, 1e-10, &format!("tiled W={w} vs untiled W=1"));
    }
}

#[test]
fn clip_with_gradient_caching_on_1_2_and_3_ranks_equals_the_plain_step() {
    // Chunks of 2 and 3 samples per rank: 6 local samples at W = 2, 4 at W = 3.
    let one = train(1, LossKind::Clip, None, None, 4);
    for (w, chunk) in [(1, 5), (2, 2), (3, 3)] {
        assert_same(
            &train(w, LossKind::Clip, None, Some(chunk), 4),
            &one,
            1e-10,
            &format!("cached (chunk {chunk}) W={w} vs plain W=1"),
        );
    }
}

#[test]
fn siglip_gather_and_ring_on_2_and_3_ranks_equal_1_rank_in_f64() {
    assert_equivalent(LossKind::SiglipGather, None, None);
    assert_equivalent(LossKind::SiglipRing, None, None);
    let gather = train(1, LossKind::SiglipGather, None, None, 4);
    assert_same(&train(3, LossKind::SiglipRing, None, None, 4), &gather, 1e-10, "ring W=3 vs gather W=1");
}

#[test]
fn siglip_ring_with_gradient_caching_equals_the_plain_step() {
    let one = train(1, LossKind::SiglipRing, None, None, 4);
    assert_same(&train(2, LossKind::SiglipRing, None, Some(4), 4), &one, 1e-10, "ring cached (chunk 4) W=2 vs plain W=1");
}

#[test]
fn siglips_architecture_on_2_and_3_ranks_equals_1_rank_in_f64() {
    let dir = siglip_folder();
    // The attention-pool head's packed in-projection bias holds its key bias, which the
    // softmax cancels as the blocks' (see `comparable`): left out of the comparison.
    let keep = |r: &Run| Run {
        losses: r.losses.clone(),
        params: r.params.iter().filter(|(n, _)| !n.ends_with("in_proj_bias")).map(|(n, v)| (n.clone(), v.clone())).collect(),
    };
    let one = keep(&train_in(dir.path(), 1, LossKind::SiglipGather, None, None, 4));
    assert!(one.losses.iter().all(|l| l.is_finite() && *l > 0.01), "losses {:?}", one.losses);
    for (w, kind, chunk) in
        [(2, LossKind::SiglipGather, None), (3, LossKind::SiglipRing, None), (2, LossKind::SiglipRing, Some(3))]
    {
        let run = keep(&train_in(dir.path(), w, kind, None, chunk, 4));
        assert_same(&run, &one, 1e-10, &format!("SigLIP architecture, {kind:?} cache {chunk:?} W={w} vs W=1"));
    }
    // Not vacuous: the head, the text head and the logit bias (shape [1], SigLIP's own) move.
    let start = train_in(dir.path(), 1, LossKind::SiglipGather, None, None, 0);
    for name in ["vision_model.head.probe", "vision_model.head.mlp.fc2.weight", "text_model.head.bias", "logit_bias"] {
        let (a, b) = (&one.params[name], &start.params[name]);
        let moved = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f64, f64::max);
        assert!(moved > 1e-4, "{name} moved by {moved:e} in 4 steps");
    }
    assert_eq!(one.params["logit_bias"].len(), 1);
}

#[test]
fn the_clip_ring_on_2_and_3_ranks_with_tiles_and_gradient_caching_equals_the_gathered_clip_on_1_rank() {
    let gather = train(1, LossKind::Clip, None, None, 4);
    assert_same(&train(1, LossKind::ClipRing, None, None, 4), &gather, 1e-10, "clip_ring W=1 vs clip W=1");
    for (w, tile, chunk) in [(2, None, None), (3, Some(2), None), (2, Some(3), Some(2)), (3, None, Some(3))] {
        assert_same(
            &train(w, LossKind::ClipRing, tile, chunk, 4),
            &gather,
            1e-10,
            &format!("clip_ring tile {tile:?} cache {chunk:?} W={w} vs clip W=1"),
        );
    }
    let siglip = train(1, LossKind::SiglipGather, None, None, 4);
    assert_same(
        &train(3, LossKind::SiglipRing, Some(2), Some(2), 4),
        &siglip,
        1e-10,
        "siglip_ring tiled cached W=3 vs gather W=1",
    );
}

#[test]
fn four_steps_move_the_parameters() {
    // The equivalences above are not vacuous: training changes what they compare.
    for kind in [LossKind::Clip, LossKind::SiglipRing] {
        let (d, name) = max_rel_diff_floor(&train(1, kind, None, None, 4).params, &train(1, kind, None, None, 0).params, 1e-2);
        assert!(d > 1e-3, "{kind:?}: 4 steps moved no parameter by more than {d:.2e} ({name})");
    }
}

#[test]
fn a_pretrained_folder_starts_the_trainer_from_its_weights() {
    // Every parameter of the trainer (the scalar logit_scale included) holds the folder's
    // value before the first step: the checkpoint is copied into the seeded variables. The
    // folder is data/clip-tiny with logit_scale 3.25, not the config's initial 2.6592, so that
    // a scale left at its initial value fails.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(repo().join("data/clip-tiny").join(f), dir.join(f)).unwrap();
    }
    let mut weights = candle_core::safetensors::load(repo().join("data/clip-tiny/model.safetensors"), &Device::Cpu).unwrap();
    weights.insert("logit_scale".into(), candle_core::Tensor::new(3.25f32, &Device::Cpu).unwrap());
    candle_core::safetensors::save(&weights, dir.join("model.safetensors")).unwrap();
    let model = ClipModelSection { dir: dir.clone(), pretrained: true, max_len: None, mean: None, std: None };
    let cfg = TrainerConfig {
        seed: 5,
        dtype: DType::F32,
        precision: Default::default(),
        device: Device::Cpu,
        train: TrainSection {
            global_batch: 12,
            epochs: 1,
            max_steps: Some(0),
            accumulate: 1,
            clip_grad_norm: None,
            on_nonfinite: Default::default(),
            shuffle: true,
            eval: false,
            cache_chunk: None,
        },
        optim: OptimConfig::Adamw { lr: 3e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 },
        param_groups: Default::default(),
        schedule: ScheduleConfig::default(),
        checkpoint: CheckpointConfig::default(),
        log: LogConfig { progress: Progress::Quiet, plot: false, ..Default::default() },
        settings: Default::default(),
    };
    let want = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let got = run_threads(1, |pg| {
        let objective = Clip::new(&model, ClipLoss::default(), &data(), 5, 12, Device::Cpu)?;
        let t = Trainer::new(cfg.clone(), Box::new(objective), pg, None, false)?;
        let mut params = BTreeMap::new();
        for (n, v) in t.params() {
            params.insert(n.clone(), v.flatten_all()?.to_vec1::<f32>()?);
        }
        Ok(params)
    })
    .unwrap()
    .remove(0);
    assert_eq!(
        got.len(),
        want.len(),
        "parameters {:?} vs the folder's {:?}",
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    for (name, v) in &got {
        let w = want[name].flatten_all().unwrap().to_vec1::<f32>().unwrap();
        if name == "logit_scale" {
            assert_eq!(w, [3.25]);
        }
        assert_eq!(v, &w, "{name} differs from the folder's");
    }
}
