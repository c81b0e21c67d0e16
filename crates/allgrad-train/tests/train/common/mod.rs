//! Shared by the image-method tests: a small config on the bundled Fashion-MNIST images, the
//! parameters after training on W thread-ranks, and relative differences.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::Path;

use allgrad_dist::run_threads;
use allgrad_train::{run, RunConfig};

/// A ResNet-18 of width 4 on 12x12 crops, augmentations on, a 3-layer projector; `method`
/// names the method, `loss` is the YAML of its loss section, `sets` are `--set` overrides.
pub fn image_config(method: &str, loss: &str, sync_bn: bool, global_batch: usize, sets: &[&str]) -> RunConfig {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/fashion-mnist");
    let text = format!(
        "seed: 11\n\
         method: {method}\n\
         data:\n  kind: images\n  dir: {}\n  format: idx\n  augment:\n    crop: {{size: 12, scale: [0.3, 1.0], ratio: [0.75, 1.3333]}}\n    \
         color_jitter: {{brightness: 0.4, contrast: 0.4, saturation: 0.0, hue: 0.0, p: 0.8}}\n    normalize: {{mean: [0.286], std: [0.353]}}\n\
         model: {{kind: resnet, encoder: {{depth: 18, width: 4, in_channels: 1, stem: cifar, sync_bn: {sync_bn}}}, projector: {{out: 8, layers: 3}}}}\n\
         loss: {loss}\n\
         optim: {{kind: lars, lr: 0.5, weight_decay: 1.0e-6}}\n\
         train: {{global_batch: {global_batch}, epochs: 1, max_steps: 3, eval: false}}\n\
         log: {{progress: quiet, plot: false}}\n",
        dir.display()
    );
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    RunConfig::parse(&text, Path::new("image-test.yaml"), &sets).unwrap()
}

/// Parameters by name, as f64.
pub type Params = BTreeMap<String, Vec<f64>>;

/// Rank 0's parameters (f64) after training `cfg` on `w` thread-ranks. Every rank ends with
/// bitwise the same replicated parameters (a reduction whose result depended on the rank
/// would break this first).
pub fn params(cfg: &RunConfig, w: usize) -> Params {
    params_at(cfg, w, &[usize::MAX]).remove(0)
}

/// Rank 0's parameters after each of `stops` steps (increasing) of ONE run of `cfg` on `w`
/// thread-ranks: the schedule is that of the whole run, so step k here is step k of it.
pub fn params_at(cfg: &RunConfig, w: usize, stops: &[usize]) -> Vec<Params> {
    let mut all = run_threads(w, |pg| {
        let mut t = run::build(cfg, pg, None, false)?;
        let mut out = Vec::new();
        for &stop in stops {
            t.train_until(stop)?;
            let mut p = Params::new();
            for (n, v) in t.params() {
                p.insert(n.clone(), v.to_dtype(candle_core::DType::F64)?.flatten_all()?.to_vec1::<f64>()?);
            }
            out.push(p);
        }
        Ok(out)
    })
    .unwrap();
    for (r, other) in all.iter().enumerate().skip(1) {
        assert!(other == &all[0], "rank {r}'s replicated parameters differ from rank 0's");
    }
    all.remove(0)
}

/// Each tensor of `a` within `tol` of `b`'s, norm-wise (`allgrad_testkit::close::assert_rel`,
/// reported with `ALLGRAD_TEST_ERRORS=1`): the tolerance checks of W ranks against one.
pub fn assert_params_rel(a: &BTreeMap<String, Vec<f64>>, b: &BTreeMap<String, Vec<f64>>, tol: f64, what: &str) {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>(), "{what}: different parameter sets");
    for (name, y) in b {
        allgrad_testkit::close::assert_rel(&a[name], y, tol, &format!("{what}: {name}"));
    }
}

/// Largest |a - b| / max(floor, largest |b| of the tensor), and where: how far training moved
/// the parameters, or how far apart two runs that should differ are (not a tolerance check:
/// those go through [`assert_params_rel`]).
pub fn max_rel_diff_floor(a: &BTreeMap<String, Vec<f64>>, b: &BTreeMap<String, Vec<f64>>, floor: f64) -> (f64, String) {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>(), "different parameter sets");
    let mut worst = (0f64, String::new());
    for (name, y) in b {
        let x = &a[name];
        let scale = y.iter().fold(floor, |m, v| m.max(v.abs()));
        for (p, q) in x.iter().zip(y) {
            let d = (p - q).abs() / scale;
            if d > worst.0 || d.is_nan() {
                worst = (d, name.clone());
            }
        }
    }
    worst
}

/// [`max_rel_diff_floor`] with a floor of 1e-3.
pub fn max_rel_diff(a: &BTreeMap<String, Vec<f64>>, b: &BTreeMap<String, Vec<f64>>) -> (f64, String) {
    max_rel_diff_floor(a, b, 1e-3)
}
