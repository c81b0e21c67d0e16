//! `loss.tile` through the trainer, in f64: the built-in `vectors` method with the tiled
//! NT-Xent on 1, 2 and 3 ranks, with and without `train.cache_chunk`, takes the same steps
//! (losses and parameters after each step, relative 1e-10) as the untiled plain step on one
//! rank at the same global batch; SimCLR on images likewise on 2 ranks; a queue of past keys
//! (`loss.queue`) trains the same on 1, 2 and 3 ranks, with and without caching, and a run
//! with it resumes bitwise, while resuming it with another global batch is refused naming both
//! sizes; and the config errors of `loss.tile` and `loss.queue` name the key, the value and the
//! losses that have a tiled form. Tolerances through `allgrad_testkit::close`.

use std::path::Path;

use allgrad_dist::run_threads;
use allgrad_testkit::close::{assert_elem_rel, assert_rel};
use allgrad_train::{run, RunConfig};

use crate::common::{assert_params_rel, image_config, params};

const TOL: f64 = 1e-10;

fn vectors_config(loss: &str, sets: &[&str]) -> RunConfig {
    let text = format!(
        "seed: 3\ndtype: f64\nmethod: vectors\n\
         data: {{kind: vectors, samples: 96, dim: 6, clusters: 4, view_noise: 0.4}}\n\
         model: {{kind: mlp, hidden: 12, out: 5}}\nloss: {loss}\n\
         optim: {{kind: lars, lr: 0.3, weight_decay: 1.0e-4}}\n\
         train: {{global_batch: 24, epochs: 1, max_steps: 4, eval: false}}\nlog: {{progress: quiet, plot: false}}\n"
    );
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    RunConfig::parse(&text, Path::new("tiled.yaml"), &sets).unwrap()
}

/// Rank 0's loss after each of 3 steps and its parameters after each step, flattened.
fn vectors_run(cfg: &RunConfig, w: usize) -> (Vec<f64>, Vec<Vec<f64>>) {
    vectors_steps(cfg, w, 3)
}

/// [`vectors_run`] for `steps` steps.
fn vectors_steps(cfg: &RunConfig, w: usize, steps: usize) -> (Vec<f64>, Vec<Vec<f64>>) {
    let mut all = run_threads(w, |pg| {
        cfg.validate(pg.world_size(), Path::new("tiled.yaml")).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let mut t = run::build(cfg, pg, None, false)?;
        let mut losses = Vec::new();
        let mut params = Vec::new();
        for s in 1..=steps {
            losses.push(t.train_until(s)?.last_loss);
            let mut flat = Vec::new();
            for (_, v) in t.params() {
                flat.extend(v.flatten_all()?.to_vec1::<f64>()?);
            }
            params.push(flat);
        }
        Ok((losses, params))
    })
    .unwrap();
    for (r, other) in all.iter().enumerate().skip(1) {
        assert!(other.1 == all[0].1, "rank {r}'s parameters differ from rank 0's");
    }
    all.remove(0)
}

/// The same losses (element-wise) and parameters after each step (norm-wise, all parameters
/// flattened), through `allgrad_testkit::close`.
fn assert_same_run(got: &(Vec<f64>, Vec<Vec<f64>>), want: &(Vec<f64>, Vec<Vec<f64>>), what: &str) {
    assert_elem_rel(&got.0, &want.0, TOL, f64::MIN_POSITIVE, &format!("{what}: losses"));
    for (s, (a, b)) in got.1.iter().zip(&want.1).enumerate() {
        assert_rel(a, b, TOL, &format!("{what}: parameters after step {}", s + 1));
    }
}

#[test]
fn tiled_vectors_method_on_1_2_3_ranks_with_and_without_caching_equals_the_untiled_one_rank_run() {
    let plain = vectors_run(&vectors_config("{kind: nt_xent, temperature: 0.2}", &[]), 1);
    let moved = plain.1[2].iter().zip(&plain.1[0]).fold(0f64, |m, (a, b)| m.max((a - b).abs()));
    assert!(moved > 1e-4, "the steps moved no parameter ({moved:e})");
    // Global batch 24: local 24, 12, 8 samples (48, 24, 16 anchors against 48 candidates);
    // tiles that divide neither, and one larger than the logits.
    for tile in [5, 64] {
        let loss = format!("{{kind: nt_xent, temperature: 0.2, tile: {tile}}}");
        for w in [1, 2, 3] {
            assert_same_run(&vectors_run(&vectors_config(&loss, &[]), w), &plain, &format!("tile {tile}, W={w}"));
            // GradCache + tiles: chunks of 5 samples (not dividing the local batch).
            let cached = vectors_run(&vectors_config(&loss, &["train.cache_chunk=5"]), w);
            assert_same_run(&cached, &plain, &format!("tile {tile}, cache_chunk 5, W={w}"));
        }
    }
}

#[test]
fn tiled_simclr_on_two_ranks_equals_the_untiled_one_rank_run() {
    // f64 at lr 0.05, where the training map does not amplify rounding (see simclr.rs).
    let sets = ["dtype=f64", "optim.lr=0.05", "train.max_steps=2"];
    let one = params(&image_config("simclr", "{kind: nt_xent, temperature: 0.5}", true, 16, &sets), 1);
    let tiled = params(&image_config("simclr", "{kind: nt_xent, temperature: 0.5, tile: 6}", true, 16, &sets), 2);
    assert_params_rel(&tiled, &one, TOL, "tiled on 2 ranks vs untiled on 1");
}

#[test]
fn a_queue_of_past_keys_trains_the_same_on_1_2_3_ranks_with_and_without_caching() {
    let queued = "{kind: nt_xent, temperature: 0.2, tile: 5, queue: 2}";
    // 4 steps: the queue is empty at step 1, holds 1 batch at step 2, 2 at step 3, and at step
    // 4 the 2 newest (the first was dropped).
    let one = vectors_steps(&vectors_config(queued, &[]), 1, 4);
    let without = vectors_steps(&vectors_config("{kind: nt_xent, temperature: 0.2, tile: 5}", &[]), 1, 4);
    assert!((one.0[0] - without.0[0]).abs() <= TOL * without.0[0], "step 1: an empty queue changed the loss");
    assert!((one.0[1] - without.0[1]).abs() > 1e-3, "step 2: the queued negatives did not change the loss");
    for w in [2, 3] {
        assert_same_run(&vectors_steps(&vectors_config(queued, &[]), w, 4), &one, &format!("queue, W={w}"));
        let cached = vectors_steps(&vectors_config(queued, &["train.cache_chunk=5"]), w, 4);
        assert_same_run(&cached, &one, &format!("queue, cache_chunk 5, W={w}"));
    }
}

/// Parameters and buffers (the queue) of rank 0 after a run on 2 ranks that checkpoints into
/// `dir`: to `stop`, then (when `resume_to` is given) resumed from the checkpoint to it.
fn state_after(cfg: &RunConfig, dir: &Path, stop: usize, resume_to: Option<usize>) -> Vec<(String, Vec<u64>)> {
    run_threads(2, |pg| {
        let mut t = run::build(cfg, pg.clone(), Some(dir.to_path_buf()), false)?;
        t.train_until(stop)?;
        if let Some(end) = resume_to {
            drop(t);
            t = run::build(cfg, pg, Some(dir.to_path_buf()), true)?;
            assert_eq!(t.step(), stop, "resumed at another step");
            t.train_until(end)?;
        }
        let mut out = Vec::new();
        let params = t.params().iter().map(|(n, v)| (n.clone(), v.as_tensor().clone()));
        for (name, v) in params.chain(t.buffers()?) {
            out.push((name, v.flatten_all()?.to_vec1::<f64>()?.iter().map(|x| x.to_bits()).collect()));
        }
        Ok(out)
    })
    .unwrap()
    .remove(0)
}

#[test]
fn a_run_with_a_queue_resumes_bitwise() {
    let cfg = vectors_config("{kind: nt_xent, temperature: 0.2, tile: 7, queue: 2}", &[]);
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let straight = state_after(&cfg, a.path(), 4, None);
    let resumed = state_after(&cfg, b.path(), 2, Some(4));
    let names: Vec<&str> = straight.iter().map(|(n, _)| n.as_str()).collect();
    assert!(names.contains(&"loss.queue"), "the queue is not among the buffers: {names:?}");
    assert_eq!(straight.len(), resumed.len());
    for ((n, x), (m, y)) in straight.iter().zip(&resumed) {
        assert_eq!(n, m);
        assert!(x == y, "{n} differs after resuming");
    }
}

#[test]
fn resuming_a_queue_with_another_global_batch_is_refused_naming_both_sizes() {
    let queued = "{kind: nt_xent, temperature: 0.2, tile: 7, queue: 2}";
    let dir = tempfile::tempdir().unwrap();
    state_after(&vectors_config(queued, &[]), dir.path(), 2, None);
    // The saved queue holds batches of 2 x 24 keys; global batch 12 pushes 2 x 12.
    let other = vectors_config(queued, &["train.global_batch=12"]);
    let outcomes =
        run_threads(2, |pg| Ok(run::build(&other, pg, Some(dir.path().to_path_buf()), true).err().map(|e| e.to_string())))
            .unwrap();
    for (rank, msg) in outcomes.iter().enumerate() {
        let msg = msg.as_deref().unwrap_or_else(|| panic!("rank {rank} resumed a queue of another batch size"));
        assert!(msg.contains("holds batches of 48 keys, but this run's batches have 24"), "rank {rank}: {msg}");
    }
}

#[test]
fn a_tile_of_zero_or_on_a_loss_without_a_tiled_form_is_refused_naming_the_key() {
    let validate = |cfg: RunConfig| cfg.validate(2, Path::new("tiled.yaml")).unwrap_err().to_string();
    let e = validate(vectors_config("{kind: nt_xent, tile: 0}", &[]));
    assert!(e.starts_with("tiled.yaml: at `loss.tile`: loss.tile = 0") && e.contains("at least 1"), "{e}");
    let e = validate(vectors_config("{kind: cross_correlation, lambda: 0.01, tile: 256}", &[]));
    assert!(e.starts_with("tiled.yaml: at `loss.tile`: the cross_correlation loss has no tiled form"), "{e}");
    assert!(e.contains("nt_xent (methods simclr and vectors)") && e.contains("info_nce"), "{e}");
    let e = validate(image_config("barlowtwins", "{kind: cross_correlation, tile: 64}", true, 16, &[]));
    assert!(e.contains("at `loss.tile`: the cross_correlation loss has no tiled form"), "{e}");
    let e = validate(image_config("simclr", "{kind: nt_xent, tile: 0}", true, 16, &[]));
    assert!(e.contains("at `loss.tile`: loss.tile = 0"), "{e}");
    let e = RunConfig::parse(&vectors_config("{kind: nt_xent}", &[]).to_yaml(), Path::new("t.yaml"), &["loss.tile=-4".into()])
        .unwrap_err()
        .to_string();
    // A bad `--set` value names its key and blames the command line, not the config file.
    assert!(e.contains("--set loss.tile=-4: at `loss.tile`") && e.contains("integer `-4`, expected usize"), "{e}");
    assert!(e.contains("the value comes from the command line"), "{e}");
    let e = validate(vectors_config("{kind: nt_xent, queue: 3}", &[]));
    assert!(e.starts_with("tiled.yaml: at `loss.queue`: loss.queue = 3 needs loss.tile"), "{e}");
    let e = validate(vectors_config("{kind: nt_xent, tile: 8, queue: 0}", &[]));
    assert!(e.starts_with("tiled.yaml: at `loss.queue`: loss.queue = 0"), "{e}");
    // A valid tile survives the round trip through the resolved config.
    let cfg = vectors_config("{kind: nt_xent, tile: 4096}", &[]);
    assert!(cfg.to_yaml().contains("tile: 4096"), "{}", cfg.to_yaml());
    cfg.validate(2, Path::new("tiled.yaml")).unwrap();
}
