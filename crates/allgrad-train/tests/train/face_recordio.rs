//! The face method on RecordIO data (`data.kind: recordio`) with a verification `.bin`
//! (`eval.verification`), through the trainer: 2 and 3 ranks end 3 SGD steps of a small
//! ResNet with the same losses and parameters as 1 rank (f64, 1e-10); the `.bin` figures,
//! computed with each rank embedding its share of the images, are the same on 1, 2 and 3
//! ranks; a `.bin` that is not a verification set stops the run at start, naming the file.

use std::collections::BTreeMap;
use std::path::Path;

use allgrad_dist::run_threads;
use allgrad_train::{run, RunConfig};
use serde_pickle::Value;

use allgrad_testkit::close::{assert_elem_rel, assert_rel};

use crate::face_support::{identity_png, train, write_recordio};

/// A gray 8x8 PNG of identity `class`, variant `k`.
fn png(class: u32, k: u32) -> Vec<u8> {
    identity_png(8, class, k)
}

/// `dir/train.{rec,idx}` and `property`: 36 records, 6 identities; `dir/pairs.bin`: 12 pairs
/// of identities 6..9 (held out), alternately the same and different.
fn write_data(dir: &Path) {
    write_recordio(dir, 8);
    let mut bins = Vec::new();
    let mut issame = Vec::new();
    for p in 0..12u32 {
        let a = 6 + p % 3;
        let b = if p % 2 == 0 { a } else { 6 + (p + 1) % 3 };
        bins.push(Value::Bytes(png(a, p)));
        bins.push(Value::Bytes(png(b, p + 7)));
        issame.push(Value::Bool(a == b));
    }
    let pickle = serde_pickle::value_to_vec(&Value::Tuple(vec![Value::List(bins), Value::List(issame)]), Default::default());
    std::fs::write(dir.join("pairs.bin"), pickle.unwrap()).unwrap();
}

fn config(dir: &Path, bin: &str) -> RunConfig {
    let text = format!(
        "seed: 3\n\
         dtype: f64\n\
         method: face\n\
         data:\n  kind: recordio\n  dir: {dir}\n  color: gray\n\
         \x20 augment: {{crop: {{size: 8, scale: [0.6, 1.0], ratio: [0.8, 1.25]}}, flip: {{p: 0.5}}, \
         color_jitter: {{p: 0.0}}, grayscale: {{p: 0.0}}, blur: {{p: 0.0}}, normalize: {{mean: [0.5], std: [0.25]}}}}\n\
         model: {{kind: resnet, encoder: {{depth: 18, width: 4, in_channels: 1, stem: cifar, sync_bn: true}}, embedding: 8}}\n\
         head: {{num_classes: 6, margin: {{kind: arcface, s: 16}}, sample_rate: 1.0}}\n\
         eval: {{verification: [{bin}], batch: 5}}\n\
         optim: {{kind: sgd, lr: 0.1, momentum: 0.9, weight_decay: 0.0005}}\n\
         train: {{global_batch: 12, epochs: 1, max_steps: 3, eval: false}}\n\
         checkpoint: {{every: 0}}\n\
         log: {{progress: quiet, plot: false}}\n",
        dir = dir.display(),
        bin = dir.join(bin).display(),
    );
    RunConfig::parse(&text, Path::new("face-recordio-test.yaml"), &[]).unwrap()
}

#[test]
fn recordio_face_training_on_2_and_3_ranks_equals_1_rank_f64() {
    let dir = tempfile::tempdir().unwrap();
    write_data(dir.path());
    let cfg = config(dir.path(), "pairs.bin");
    let stops = [1, 2, 3];
    let one = train(&cfg, 1, None, false, &stops);
    assert!(one.losses.iter().all(|l| l.is_finite() && *l > 0.0), "{:?}", one.losses);
    // The biases of the first embedding batch norm and of the FC layer get a gradient of
    // exactly zero in exact arithmetic (the second batch norm subtracts any per-feature
    // constant), so they hold rounding noise of ~1e-17: compared in absolute terms. Every
    // other parameter norm-wise at 1e-10.
    let noise_only = ["backbone.embedding.bn1.bias", "backbone.embedding.fc.bias"];
    for w in [2, 3] {
        let run = train(&cfg, w, None, false, &stops);
        let what = format!("recordio W={w} vs W=1");
        assert_elem_rel(&run.losses, &one.losses, 1e-10, f64::MIN_POSITIVE, &format!("{what}: losses"));
        assert_eq!(run.params.keys().collect::<Vec<_>>(), one.params.keys().collect::<Vec<_>>(), "{what}");
        for (n, want) in &one.params {
            if noise_only.contains(&n.as_str()) {
                let worst = run.params[n].iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
                assert!(worst <= 1e-12, "{what}: {n} differs by {worst}");
            } else {
                assert_rel(&run.params[n], want, 1e-10, &format!("{what}: {n}"));
            }
        }
    }
    // The run trained: the loss moved.
    assert!(one.losses[2] != one.losses[0], "{:?}", one.losses);
}

/// The evaluation's figures of rank 0 after `steps` steps on `w` ranks.
fn figures(cfg: &RunConfig, w: usize, steps: usize) -> BTreeMap<String, f64> {
    let mut cfg = cfg.clone();
    cfg.train.eval = true;
    let per_rank = run_threads(w, |pg| {
        let mut t = run::build(&cfg, pg, None, false)?;
        Ok(t.train_until(steps)?.eval)
    })
    .unwrap();
    per_rank[0].iter().cloned().collect()
}

#[test]
fn bin_verification_split_over_ranks_gives_the_figures_of_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    write_data(dir.path());
    let cfg = config(dir.path(), "pairs.bin");
    let one = figures(&cfg, 1, 3);
    let acc = one["pairs_acc"];
    assert!((0.0..=1.0).contains(&acc) && one["pairs_std"] >= 0.0, "{one:?}");
    for w in [2, 3] {
        assert_eq!(figures(&cfg, w, 3), one, "W={w} vs W=1");
    }
}

#[test]
fn a_bin_that_is_not_a_verification_set_stops_the_run_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    write_data(dir.path());
    let bins = Value::List((0..3).map(|k| Value::Bytes(png(1, k))).collect());
    let odd = serde_pickle::value_to_vec(&Value::Tuple(vec![bins, Value::List(vec![Value::Bool(true)])]), Default::default());
    std::fs::write(dir.path().join("odd.bin"), odd.unwrap()).unwrap();
    let cfg = config(dir.path(), "odd.bin");
    let err = run_threads(1, |pg| Ok(run::build(&cfg, pg, None, false).map(|_| ())?)).unwrap_err().to_string();
    assert!(err.contains("odd.bin") && err.contains("odd number"), "{err}");
}
