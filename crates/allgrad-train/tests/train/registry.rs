//! Methods by name: an unknown `method:` lists the registered names; a section a method does
//! not take fails with its key path; a user's own method, registered next to the built-in
//! ones, trains through the `train` command's library entry (`cli::run_with`).

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use allgrad_dist::ProcessGroup;
use allgrad_models::{Batch, Objective};
use allgrad_train::cli::{run_with, TrainArgs};
use allgrad_train::method::{Method, SectionError};
use allgrad_train::{Registry, RunConfig};
use candle_core::{Device, Result, Tensor};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

const VECTORS: &str = "seed: 3\n\
                       method: vectors\n\
                       data: {kind: vectors, samples: 96, dim: 8, clusters: 4, view_noise: 0.5}\n\
                       model: {kind: mlp, hidden: 16, out: 8}\n\
                       train: {global_batch: 24, epochs: 1}\n\
                       log: {progress: quiet, plot: false}\n";

fn parse(sets: &[&str]) -> std::result::Result<RunConfig, allgrad_train::config::ConfigError> {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    RunConfig::parse(VECTORS, Path::new("run.yaml"), &sets)
}

#[test]
fn unknown_method_lists_the_registered_names() {
    let e = parse(&["method=simclear"]).unwrap_err().to_string();
    assert!(e.contains("run.yaml: at `method`: unknown method `simclear`"), "{e}");
    assert!(e.contains("barlowtwins, clip, face, simclr, simcse, vectors"), "{e}");
    // A user's registry lists its own names too.
    let mut mine = Registry::builtin();
    mine.register("points", Points::default());
    let e = mine.parse(VECTORS, Path::new("run.yaml"), &["method=pionts".into()]).unwrap_err().to_string();
    assert!(e.contains("barlowtwins, clip, face, points, simclr, simcse, vectors"), "{e}");
}

#[test]
fn a_missing_method_is_an_error_naming_the_key() {
    let text = VECTORS.replace("method: vectors\n", "");
    let e = RunConfig::parse(&text, Path::new("run.yaml"), &[]).unwrap_err().to_string();
    assert!(e.contains("missing field `method`"), "{e}");
}

#[test]
fn wrong_loss_data_or_model_for_a_method_fails_with_the_key_path() {
    let image = "method: simclr\n\
                 data: {kind: images, dir: data/fashion-mnist, format: idx}\n\
                 model: {kind: resnet}\n\
                 loss: {kind: cross_correlation}\n\
                 train: {global_batch: 8, epochs: 1}\n";
    let cfg = RunConfig::parse(image, Path::new("img.yaml"), &[]).unwrap();
    let e = cfg.validate(1, Path::new("img.yaml")).unwrap_err().to_string();
    assert_eq!(e, "img.yaml: at `loss.kind`: method `simclr` takes loss.kind `nt_xent`, got `cross_correlation`");
    // The same sections are BarlowTwins'.
    let cfg = RunConfig::parse(image, Path::new("img.yaml"), &["method=barlowtwins".into()]).unwrap();
    cfg.validate(1, Path::new("img.yaml")).unwrap();
    // And the method's default loss when the section is left out.
    let no_loss = image.replace("loss: {kind: cross_correlation}\n", "");
    for m in ["simclr", "barlowtwins"] {
        let cfg = RunConfig::parse(&no_loss, Path::new("img.yaml"), &[format!("method={m}")]).unwrap();
        cfg.validate(1, Path::new("img.yaml")).unwrap();
    }
    // Image data or a ResNet for the vectors method.
    let e = parse(&["data={kind: images, dir: x, format: idx}"]).unwrap().validate(1, Path::new("run.yaml")).unwrap_err();
    assert!(e.to_string().contains("at `data.kind`: method `vectors` takes data.kind `vectors`, got `images`"), "{e}");
    let e = parse(&["model={kind: resnet}"]).unwrap().validate(1, Path::new("run.yaml")).unwrap_err();
    assert!(e.to_string().contains("at `model.kind`: method `vectors` takes model.kind `mlp`, got `resnet`"), "{e}");
    // A value check of the method's loss names its key.
    let e = parse(&["loss={kind: nt_xent, temperature: -1}"]).unwrap().validate(1, Path::new("run.yaml")).unwrap_err();
    assert!(e.to_string().contains("loss.temperature must be positive, got -1"), "{e}");
}

#[test]
fn a_top_level_key_no_one_owns_lists_the_method_and_trainer_keys() {
    let e = parse(&["head={classes: 10}"]).unwrap_err().to_string();
    assert!(e.contains("unknown field `head`") && e.contains("`data`, `model`, `loss`"), "{e}");
    assert!(e.contains("method `vectors`") && e.contains("checkpoint"), "{e}");
}

/// A user's method with its own section (`points: {count}`), counting the losses it computes.
#[derive(Default)]
struct Points {
    losses: Arc<AtomicUsize>,
}

#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct PointsSections {
    points: PointsData,
}

#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct PointsData {
    count: usize,
}

struct PointsObjective {
    count: usize,
    w: Option<Tensor>,
    losses: Arc<AtomicUsize>,
}

impl Objective for PointsObjective {
    fn build(&mut self, vb: VarBuilder) -> Result<()> {
        self.w = Some(vb.get_with_hints((2, 2), "w", candle_nn::Init::Const(1.0))?);
        Ok(())
    }
    fn num_samples(&self) -> usize {
        self.count
    }
    fn loss(&mut self, batch: &Batch, _pg: &ProcessGroup) -> Result<Tensor> {
        self.losses.fetch_add(1, Ordering::SeqCst);
        let x: Vec<f32> = batch.indices.iter().flat_map(|&i| [i as f32 / 10.0, 1.0]).collect();
        let x = Tensor::from_vec(x, (batch.indices.len(), 2), &Device::Cpu)?;
        x.matmul(self.w.as_ref().expect("built"))?.sqr()?.mean_all()
    }
}

impl Method for Points {
    type Sections = PointsSections;
    fn validate(&self, s: &PointsSections, run: &RunConfig, _w: usize) -> std::result::Result<(), SectionError> {
        if s.points.count < run.train.global_batch {
            return Err(SectionError::new("points.count", format!("{} points, fewer than one batch", s.points.count)));
        }
        Ok(())
    }
    fn objective(&self, s: PointsSections, _run: &RunConfig, _d: &Device) -> Result<Box<dyn Objective>> {
        Ok(Box::new(PointsObjective { count: s.points.count, w: None, losses: self.losses.clone() }))
    }
}

#[test]
fn a_user_registered_method_trains_through_the_train_library_entry() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("points.yaml");
    std::fs::write(
        &config,
        "method: points\npoints: {count: 32}\noptim: {kind: sgd, lr: 0.01}\ntrain: {global_batch: 8, epochs: 2}\n\
         log: {progress: quiet, plot: false}\n",
    )
    .unwrap();
    let points = Points::default();
    let losses = points.losses.clone();
    let mut registry = Registry::builtin();
    registry.register("points", points);
    let args = |set: &[&str]| TrainArgs {
        config: Some(config.clone()),
        set: set.iter().map(|s| s.to_string()).collect(),
        output_dir: Some(dir.path().join("run")),
        resume: false,
        stop_after: None,
        print_config: false,
        list_methods: false,
        profile: false,
    };
    let out = run_with(&registry, &args(&[])).unwrap();
    assert_eq!((out.summary.steps, out.total_steps, out.world_size), (8, 8, 1));
    assert_eq!(losses.load(Ordering::SeqCst), 8, "the method's loss ran once per step");
    assert!(out.summary.last_loss.is_finite() && out.summary.last_loss > 0.0, "{:?}", out.summary);
    assert!(dir.path().join("run/config.yaml").exists());
    // Its own section is validated through the same entry, with the key path.
    let e = run_with(&registry, &args(&["points.count=4"])).unwrap_err();
    assert_eq!(e.exit_code(), 2);
    assert!(e.to_string().contains("at `points.count`: 4 points, fewer than one batch"), "{e}");
    // The built-in registry does not know it.
    let e = run_with(&Registry::builtin(), &args(&[])).unwrap_err().to_string();
    assert!(e.contains("unknown method `points`"), "{e}");
}
