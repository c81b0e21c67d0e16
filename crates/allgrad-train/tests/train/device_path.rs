//! The training step on the device path ([`allgrad_nn::transfer::set_device_path`]: CPU
//! tensors take the code path CUDA tensors take, and their host traffic is counted as a GPU's
//! would be), with ranks as threads:
//! - a SimCLR step of a ResNet-18 (its batch norms' ReLU, skip add + ReLU and normalised
//!   shortcut tails, SyncBatchNorm, LARS) reads nothing from the device in the forward, the
//!   backward, the gradient sync and the optimizer, and reads the loss and the gradient norm
//!   once, after the update; it uploads only the step's batch (its two views and labels, taken
//!   from the loader's host buffers; the two views built on its own thread without loader
//!   threads), nothing after the forward; and it trains
//!   exactly as the host path does (f64, 1e-10) at W = 1, 2 and 3, and W ranks as one;
//! - a non-finite step is skipped (or stops the run) on the device path as on the host path,
//!   with the update skipped on the device before the one read.

use std::path::Path;

use allgrad_dist::run_threads;
use allgrad_nn::transfer::set_device_path;
use allgrad_nn::HostTraffic;
use allgrad_train::profile::StepProfile;
use allgrad_train::{run, RunConfig};

use crate::common::{self, max_rel_diff, Params};

const NT_XENT: &str = "{kind: nt_xent, temperature: 0.5}";

/// Rank 0's parameters after `steps` steps on `w` thread-ranks, on the device path or not,
/// and every rank's profile of the last step.
fn train(cfg: &RunConfig, w: usize, device: bool, steps: usize) -> (Params, Vec<StepProfile>) {
    let all = run_threads(w, |pg| {
        let was = set_device_path(device);
        let out = (|| {
            let mut t = run::build(cfg, pg, None, false)?;
            t.train_until(steps)?;
            let mut p = Params::new();
            for (n, v) in t.params() {
                p.insert(n.clone(), v.to_dtype(candle_core::DType::F64)?.flatten_all()?.to_vec1::<f64>()?);
            }
            Ok((p, t.last_step_profile().clone()))
        })();
        set_device_path(was);
        out
    })
    .unwrap();
    for (r, (p, _)) in all.iter().enumerate().skip(1) {
        assert!(p == &all[0].0, "rank {r}'s replicated parameters differ from rank 0's");
    }
    let profiles = all.iter().map(|(_, s)| s.clone()).collect();
    (all.into_iter().next().unwrap().0, profiles)
}

fn traffic(p: &StepProfile, region: &str) -> HostTraffic {
    p.region(region).unwrap_or_else(|| panic!("no region {region} in {p:?}")).traffic
}

#[test]
fn a_resnet18_simclr_step_on_the_device_path_reads_once_after_the_update_and_equals_the_host_path() {
    let cfg = common::image_config("simclr", NT_XENT, true, 24, &["dtype=f64", "optim.lr=0.05", "train.max_steps=2"]);
    let one = train(&cfg, 1, true, 2).0;
    for w in [1, 2, 3] {
        let (host, _) = train(&cfg, w, false, 2);
        let (dev, profiles) = train(&cfg, w, true, 2);
        let (d, name) = max_rel_diff(&dev, &host);
        println!("W={w}: device path vs host path {d:.2e} in {name}");
        assert!(d <= 1e-10, "W={w}: the device path differs from the host path by {d:.2e} in {name}");
        let (d, name) = max_rel_diff(&dev, &one);
        assert!(d <= 1e-10, "W={w} differs from W=1 on the device path by {d:.2e} in {name}");
        // The second step's traffic (the first also builds the per-shape constants).
        for (r, p) in profiles.iter().enumerate() {
            let what = format!("W={w} rank {r}");
            for region in ["forward", "backward", "gradient sync", "optimizer"] {
                assert_eq!(traffic(p, region).reads, 0, "{what}: {region} read from the device: {p:?}");
            }
            for region in ["backward", "gradient sync", "optimizer", "read"] {
                assert_eq!(traffic(p, region).uploads, 0, "{what}: {region} uploaded: {p:?}");
            }
            // The batch taken from the loader's host buffers: two views and the labels. (Counted
            // where Candle copies; the per-shape constants were uploaded in the first step.)
            assert_eq!(traffic(p, "forward").uploads, 3, "{what}: the step uploaded other than its batch: {p:?}");
            assert_eq!(traffic(p, "read").reads, 1, "{what}: one batched read of the loss and the norm: {p:?}");
            assert_eq!(p.traffic().reads, 1, "{what}: {p:?}");
        }
    }
}

#[test]
fn views_built_inline_are_the_steps_only_uploads() {
    // Without loader threads the step's own thread uploads the two views' images, and nothing
    // else (NT-Xent's per-shape constants were uploaded once, in the first step; the labels are
    // not made).
    let cfg = common::image_config(
        "simclr",
        NT_XENT,
        true,
        24,
        &["dtype=f64", "optim.lr=0.05", "train.max_steps=2", "data.loader.workers=0"],
    );
    let (_, profiles) = train(&cfg, 2, true, 2);
    for (r, p) in profiles.iter().enumerate() {
        assert_eq!(traffic(p, "forward").uploads, 2, "rank {r}: {p:?}");
        assert_eq!(p.traffic().uploads, 2, "rank {r}: {p:?}");
        assert_eq!(p.traffic().reads, 1, "rank {r}: {p:?}");
    }
}

fn vectors(extra: &[&str]) -> RunConfig {
    let base = "seed: 3\n\
                method: vectors\n\
                data: {kind: vectors, samples: 96, dim: 8, clusters: 4, view_noise: 0.5}\n\
                model: {kind: mlp, hidden: 16, out: 8}\n\
                train: {global_batch: 24, epochs: 2, max_steps: 5}\n\
                log: {progress: quiet, plot: false}\n";
    let sets: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    RunConfig::parse(base, Path::new("test.yaml"), &sets).unwrap()
}

#[test]
fn a_non_finite_step_is_skipped_on_the_device_as_on_the_host_and_read_once() {
    for optim in
        ["optim={kind: sgd, lr: 1.0e30, momentum: 0.9}", "optim={kind: adamw, lr: 1.0e30}", "optim={kind: lars, lr: 1.0e30}"]
    {
        let skip = vectors(&[optim, "train.on_nonfinite=skip", "train.clip_grad_norm=1.0e35"]);
        let run = |device: bool| {
            run_threads(2, |pg| {
                let was = set_device_path(device);
                let out = (|| {
                    let mut t = run::build(&skip, pg, None, false)?;
                    let s = t.train()?;
                    let mut p = Params::new();
                    for (n, v) in t.params() {
                        p.insert(n.clone(), v.to_dtype(candle_core::DType::F64)?.flatten_all()?.to_vec1::<f64>()?);
                    }
                    Ok((s.skipped, s.steps, p, t.last_step_profile().clone()))
                })();
                set_device_path(was);
                out
            })
            .unwrap()
            .remove(0)
        };
        let (host, dev) = (run(false), run(true));
        assert!(dev.0 > 0 && dev.1 == 5, "{optim}: {} skipped of {} steps", dev.0, dev.1);
        assert_eq!((dev.0, dev.1), (host.0, host.1), "{optim}: the device path skipped other steps than the host path");
        for (name, v) in &dev.2 {
            // A skipped update leaves every parameter as it was: the same values as the host's.
            assert!(v.iter().zip(&host.2[name]).all(|(a, b)| a == b || (a.is_nan() && b.is_nan())), "{optim}: {name} differs");
        }
        assert_eq!(dev.3.traffic().reads, 1, "{optim}: the last step read more than its figures: {:?}", dev.3);
    }
    let stop = vectors(&["optim={kind: sgd, lr: 1.0e30}"]);
    let err = run_threads(2, |pg| {
        set_device_path(true);
        Ok(run::build(&stop, pg, None, false)?.train()?)
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("non-finite") && err.contains("at step"), "{err}");
}

#[test]
fn the_profile_times_each_layer_kind_forward_and_backward() {
    // `train --profile` on the CPU: wall-clock regions and the ops' passes by kind.
    let cfg = common::image_config("simclr", NT_XENT, true, 24, &["train.max_steps=2"]);
    let settings = allgrad_train::Settings { profile: true, ..Default::default() };
    let (ops, table) = run_threads(1, |pg| {
        let mut t = run::build_with(&allgrad_train::Registry::builtin(), &cfg, pg, None, false, settings.clone())?;
        t.train_until(2)?;
        Ok((t.last_op_times().to_vec(), t.profile_table()))
    })
    .unwrap()
    .remove(0);
    use allgrad_nn::Pass;
    let get = |kind: &str, pass: Pass| ops.iter().find(|o| o.kind == kind && o.pass == pass).cloned();
    // (This model's ReLUs are fused into its batch norms, its dense layers are Candle's.)
    for kind in ["conv", "batch_norm", "pool"] {
        let (f, b) = (get(kind, Pass::Forward), get(kind, Pass::Backward));
        let (f, b) =
            (f.unwrap_or_else(|| panic!("no {kind} forward in {ops:?}")), b.unwrap_or_else(|| panic!("no {kind} backward")));
        assert!(f.calls > 0 && f.seconds > 0.0 && b.seconds > 0.0, "{f:?} {b:?}");
        assert!(table.contains(&format!("{kind} fwd")) && table.contains(&format!("{kind} bwd")), "{table}");
    }
    // Every convolution and batch norm of the forward has its backward.
    for kind in ["conv", "batch_norm"] {
        assert_eq!(get(kind, Pass::Forward).unwrap().calls, get(kind, Pass::Backward).unwrap().calls, "{kind}: {ops:?}");
    }
    assert!(table.contains("over 1 step(s) (after the first), wall-clock"), "{table}");
    for region in ["forward", "backward", "gradient sync", "optimizer"] {
        assert!(table.lines().any(|l| l.starts_with(region)), "no {region} in {table}");
    }
}
