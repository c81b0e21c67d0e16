//! Gradient caching for the two-view image method (ResNet-18 of width 4 with SyncBatchNorm
//! on the bundled Fashion-MNIST, augmentations on, views built ahead on loader threads), in
//! f64: with one chunk per micro-batch the batch statistics are the whole batch's and a cached
//! run equals the plain run, on 1 and 2 ranks (SimCLR and BarlowTwins); with smaller chunks
//! each chunk's replay reproduces its augmentations (the trainer checks every chunk) and the
//! run differs from the plain one only through per-chunk batch statistics.

use crate::common::{assert_params_rel, image_config, max_rel_diff, params};

const NT_XENT: &str = "{kind: nt_xent, temperature: 0.5}";
const BARLOW: &str = "{kind: cross_correlation, lambda: 0.01}";

fn config(method: &str, loss: &str, sets: &[&str]) -> allgrad_train::RunConfig {
    let mut all = vec!["dtype=f64", "optim.lr=0.05", "train.max_steps=2"];
    all.extend_from_slice(sets);
    image_config(method, loss, true, 16, &all)
}

#[test]
fn cached_image_run_with_one_chunk_per_micro_batch_equals_the_plain_run() {
    for (method, loss) in [("simclr", NT_XENT), ("barlowtwins", BARLOW)] {
        let plain = params(&config(method, loss, &[]), 1);
        for (w, chunk) in [(1, "train.cache_chunk=16"), (2, "train.cache_chunk=8")] {
            assert_params_rel(&params(&config(method, loss, &[chunk]), w), &plain, 1e-10, &format!("{method} W={w} {chunk}"));
        }
    }
}

#[test]
fn cached_image_run_with_small_chunks_passes_every_replay_check_and_differs_from_the_plain_run() {
    // Chunks of 3 of the 8 samples per rank: the replay check (which fails a run whose replay
    // differs: grad_cache.rs's unkeyed-dropout test) passes on every chunk, so the run
    // completes; and the per-chunk batch statistics change the result. That the difference is
    // exactly per-chunk normalisation is checked against a plain step normalising per chunk
    // on the MLP (grad_cache.rs), where the plain loss can normalise that way.
    let plain = params(&config("simclr", NT_XENT, &[]), 2);
    let cached = params(&config("simclr", NT_XENT, &["train.cache_chunk=3"]), 2);
    let (d, name) = max_rel_diff(&cached, &plain);
    assert!(d > 1e-6 && d.is_finite(), "per-chunk batch norm changed nothing ({d:.2e} in {name})");
}
