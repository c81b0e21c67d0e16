//! Parameter groups and the logit scale's clamp through the trainer, on the tiny CLIP
//! (`data/clip-tiny`, a fresh keyed initialisation in f64) and 36 captioned Fashion-MNIST
//! images: a frozen tower (LiT) keeps its values bit for bit, gets no optimizer state, is in the
//! checkpoint, and 2 ranks equal 1; the logit scale, given a high learning rate by its group,
//! reaches ln 100 and is held there on the parameter; a resume with the groups it was written
//! with equals the uninterrupted run bit for bit, one with other groups is refused naming the
//! parameter; a pattern that matches nothing, or a parameter in two groups, stops the trainer
//! before its first step, naming them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use allgrad_dist::run_threads;
use allgrad_models::clip::{Clip, ClipData, ClipLoss, ClipModelSection, LossKind};
use allgrad_train::checkpoint::CheckpointConfig;
use allgrad_train::config::{GroupConfig, ParamGroupsConfig};
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
        classes: names.iter().map(|n| vec![n.to_string()]).collect(),
        templates: vec!["a photo of a {}.".into()],
        limit: Some(36),
        // The images as they are (the runs here were tuned on them, the scale's run to its cap).
        random_crop: None,
        ..Default::default()
    }
}

fn group(params: &[&str]) -> GroupConfig {
    GroupConfig {
        params: params.iter().map(|s| s.to_string()).collect(),
        lr_scale: 1.0,
        weight_decay: None,
        lars_adaptation: None,
        frozen: false,
    }
}

/// The locked text tower of LiT, the scale with 200 times the learning rate.
fn lit_groups() -> ParamGroupsConfig {
    ParamGroupsConfig {
        exclude_1d: true,
        groups: vec![
            GroupConfig { frozen: true, ..group(&["text_model.*", "text_projection.weight"]) },
            GroupConfig { lr_scale: 200.0, ..group(&["logit_scale"]) },
        ],
    }
}

#[derive(Debug)]
struct Run {
    losses: Vec<f64>,
    /// Every parameter, the frozen ones included.
    params: BTreeMap<String, Vec<f64>>,
    frozen: Vec<String>,
}

fn config(groups: &ParamGroupsConfig, steps: usize, every: usize) -> TrainerConfig {
    TrainerConfig {
        seed: 5,
        dtype: DType::F64,
        precision: Default::default(),
        device: Device::Cpu,
        train: TrainSection {
            global_batch: 12,
            epochs: 3,
            max_steps: Some(steps),
            accumulate: 1,
            clip_grad_norm: None,
            on_nonfinite: Default::default(),
            shuffle: true,
            eval: false,
            cache_chunk: None,
        },
        optim: OptimConfig::Adamw { lr: 3e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.2 },
        param_groups: groups.clone(),
        schedule: ScheduleConfig { warmup_steps: 1, ..Default::default() },
        checkpoint: CheckpointConfig { every, ..Default::default() },
        log: LogConfig { progress: Progress::Quiet, plot: false, tensorboard: false, ..Default::default() },
        settings: Default::default(),
    }
}

fn train(w: usize, groups: &ParamGroupsConfig, steps: usize, out: Option<&Path>, resume: bool) -> candle_core::Result<Run> {
    train_loss(ClipLoss::default(), 3e-3, w, groups, steps, out, resume)
}

fn train_loss(
    loss: ClipLoss,
    lr: f64,
    w: usize,
    groups: &ParamGroupsConfig,
    steps: usize,
    out: Option<&Path>,
    resume: bool,
) -> candle_core::Result<Run> {
    // The tiny folder's weights (transformers' initialisation): the scale's runs to its bounds
    // were tuned from them.
    let model = ClipModelSection { dir: repo().join("data/clip-tiny"), pretrained: true, max_len: None, mean: None, std: None };
    let mut cfg = config(groups, steps, 2);
    cfg.optim = OptimConfig::Adamw { lr, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.2 };
    let runs = run_threads(w, |pg| {
        let objective = Clip::new(&model, loss.clone(), &data(), 5, 12, Device::Cpu)?;
        let mut t = Trainer::new(cfg.clone(), Box::new(objective), pg, out.map(Path::to_path_buf), resume)?;
        let losses = (t.step() + 1..=steps).map(|s| Ok(t.train_until(s)?.last_loss)).collect::<candle_core::Result<Vec<_>>>()?;
        let mut params = BTreeMap::new();
        for (n, v) in t.params().iter().chain(t.frozen_params()) {
            params.insert(n.clone(), v.flatten_all()?.to_vec1::<f64>()?);
        }
        let frozen = t.frozen_params().iter().map(|(n, _)| n.clone()).collect();
        Ok(Run { losses, params, frozen })
    })?;
    Ok(runs.into_iter().next().unwrap())
}

fn assert_close(a: &Run, b: &Run, tol: f64, what: &str) {
    assert_eq!(a.losses.len(), b.losses.len(), "{what}: step counts");
    for (s, (x, y)) in a.losses.iter().zip(&b.losses).enumerate() {
        assert!((x - y).abs() <= tol * y.abs(), "{what} step {}: loss {x} vs {y}", s + 1);
    }
    // The attention key biases' true gradient is 0 (see clip.rs): left out.
    let keep = |p: &BTreeMap<String, Vec<f64>>| -> BTreeMap<String, Vec<f64>> {
        p.iter().filter(|(n, _)| !n.ends_with("self_attn.k_proj.bias")).map(|(n, v)| (n.clone(), v.clone())).collect()
    };
    let (d, name) = max_rel_diff_floor(&keep(&a.params), &keep(&b.params), 1e-2);
    assert!(d <= tol, "{what}: parameters differ by {d:.2e} (relative) in {name}");
}

#[test]
fn a_frozen_tower_keeps_its_values_and_no_state_and_2_ranks_equal_1() {
    let groups = lit_groups();
    let start = train(1, &groups, 0, None, false).unwrap();
    let d = tempfile::tempdir().unwrap();
    let one = train(1, &groups, 4, Some(d.path()), false).unwrap();
    assert!(one.frozen.len() > 10 && one.frozen.iter().all(|n| n.starts_with("text_model.") || n == "text_projection.weight"));
    for (name, v) in &one.params {
        if one.frozen.contains(name) {
            assert_eq!(v, &start.params[name], "frozen {name} moved");
        } else if !name.ends_with("k_proj.bias") {
            assert_ne!(v, &start.params[name], "{name} did not train");
        }
    }
    // The checkpoint holds the frozen parameters, and no optimizer state for them.
    let ck = d.path().join("checkpoints/step_4");
    let model = candle_core::safetensors::load(ck.join("model.safetensors"), &Device::Cpu).unwrap();
    let state = candle_core::safetensors::load(ck.join("optimizer.safetensors"), &Device::Cpu).unwrap();
    assert_eq!(model.len(), one.params.len());
    for name in &one.frozen {
        assert!(model.contains_key(name), "{name} missing from the checkpoint");
        assert!(!state.keys().any(|k| k.starts_with(&format!("{name}/"))), "optimizer state kept for frozen {name}");
    }
    assert!(state.contains_key("logit_scale/exp_avg"), "{:?}", state.keys().take(4).collect::<Vec<_>>());
    let two = train(2, &groups, 4, None, false).unwrap();
    assert_close(&two, &one, 1e-10, "LiT W=2 vs W=1");
}

/// The scale's group takes 10⁵ times a base learning rate of 10⁻⁵ (AdamW's steps of up to 1,
/// the towers' of 10⁻⁵). Under SigLIP's loss with a logit bias of −30 every logit stays far
/// below 0, so only the positives count and they pull the scale up: from ln 10 it goes past
/// ln 100 within the run, and the clamp after each step holds it at exactly ln 100 (without
/// the clamp it ends above; with the old cap in the forward, its gradient past the cap was 0
/// and momentum carried it further every step). Under CLIP's loss on the untrained towers the
/// scale falls, and the clamp holds it at exactly 0.
#[test]
fn the_logit_scale_reaches_ln_100_and_is_held_there_on_the_parameter() {
    let groups = ParamGroupsConfig { exclude_1d: true, groups: vec![GroupConfig { lr_scale: 1e5, ..group(&["logit_scale"]) }] };
    let siglip = ClipLoss { kind: LossKind::SiglipGather, siglip_bias_init: -30.0, ..Default::default() };
    for (loss, bound) in [(siglip, 100f64.ln()), (ClipLoss::default(), 0.0)] {
        let kind = loss.kind;
        let run = train_loss(loss.clone(), 1e-5, 1, &groups, 8, None, false).unwrap();
        let s = run.params["logit_scale"][0];
        assert_eq!(s, bound, "{kind:?}: the scale ends at {s}, not clamped at {bound}");
        assert!(run.losses.iter().all(|l| l.is_finite()), "{:?}", run.losses);
        // On 2 ranks, the same.
        let two = train_loss(loss, 1e-5, 2, &groups, 8, None, false).unwrap();
        assert_close(&two, &run, 1e-10, &format!("{kind:?}, scale at a bound, W=2 vs W=1"));
    }
}

#[test]
fn a_resume_with_the_same_groups_is_exact_and_with_other_groups_is_refused() {
    let groups = lit_groups();
    let whole = train(1, &groups, 4, None, false).unwrap();
    let d = tempfile::tempdir().unwrap();
    train(1, &groups, 2, Some(d.path()), false).unwrap();
    let resumed = train(1, &groups, 4, Some(d.path()), true).unwrap();
    // Steps 3 and 4 after the resume against the uninterrupted run's, bit for bit.
    let tail = Run { losses: whole.losses[2..].to_vec(), params: whole.params.clone(), frozen: whole.frozen.clone() };
    assert_close(&resumed, &tail, 0.0, "resumed at step 2 vs uninterrupted");
    // Another learning-rate scale for the logit scale: refused, naming it.
    let mut other = lit_groups();
    other.groups[1].lr_scale = 100.0;
    let e = train(1, &other, 4, Some(d.path()), true).unwrap_err().to_string();
    assert!(e.contains("parameter groups differ") && e.contains("parameter logit_scale") && e.contains("lr_scale 200"), "{e}");
    // Unfreezing the tower: refused too (its parameters have no optimizer state to resume).
    let unfrozen = ParamGroupsConfig { exclude_1d: true, groups: vec![lit_groups().groups[1].clone()] };
    let e = train(1, &unfrozen, 4, Some(d.path()), true).unwrap_err().to_string();
    assert!(e.contains("parameter groups differ") && e.contains("frozen"), "{e}");
}

#[test]
fn a_pattern_matching_nothing_or_a_parameter_in_two_groups_stops_the_trainer_before_its_first_step() {
    let typo = ParamGroupsConfig { exclude_1d: true, groups: vec![GroupConfig { frozen: true, ..group(&["visual.*"]) }] };
    let e = train(1, &typo, 1, None, false).unwrap_err().to_string();
    assert!(e.contains("param_groups.groups[0].params: pattern `visual.*` matches no parameter"), "{e}");
    let twice =
        ParamGroupsConfig { exclude_1d: true, groups: vec![group(&["*.bias"]), group(&["vision_model.post_layernorm.*"])] };
    let e = train(1, &twice, 1, None, false).unwrap_err().to_string();
    assert!(e.contains("parameter vision_model.post_layernorm.bias is in two groups"), "{e}");
}
