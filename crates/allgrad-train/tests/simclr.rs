//! SimCLR on the bundled Fashion-MNIST images: 2 ranks x local batch 16 (and 4 x 8) end a
//! few steps with the same parameters as 1 rank x 32 (f64 to 1e-9; f32 to 1e-4 over four
//! LARS steps), augmentations on, SyncBatchNorm on (its statistics, and their gradients, come
//! from the global batch). A plain (per-rank) BatchNorm run shows
//! the difference SyncBatchNorm makes.

mod common;

use common::{image_config, max_rel_diff, max_rel_diff_floor, params};

const NT_XENT: &str = "{kind: nt_xent, temperature: 0.5}";

fn config_with(sync_bn: bool, sets: &[&str]) -> allgrad_train::RunConfig {
    image_config("simclr", NT_XENT, sync_bn, 32, sets)
}

#[test]
fn two_ranks_with_sync_batch_norm_equal_one_rank_in_f64() {
    // f64 isolates the semantics from rounding: the runs agree to ~1e-14 after 4 steps.
    let sets = ["dtype=f64", "train.max_steps=4"];
    let cfg = config_with(true, &sets);
    let one = params(&cfg, 1);
    let (d, name) = max_rel_diff(&params(&cfg, 2), &one);
    assert!(d <= 1e-9, "largest relative difference {d:.2e} in {name}");
    // Plain BatchNorm normalises each rank's 16 samples on their own: not the same run.
    let (d_plain, _) = max_rel_diff(&params(&config_with(false, &sets), 2), &one);
    assert!(d_plain > 1e-3, "per-rank BatchNorm unexpectedly matched ({d_plain:.2e})");
}

#[test]
fn two_ranks_with_sync_batch_norm_equal_one_rank_in_f32() {
    // In f32 the runs differ by the rounding of reductions split differently over ranks;
    // four LARS steps (the method's optimizer) keep them within ~1e-5. Parameters that start
    // at 0 (batch-norm biases) are compared against a scale of at least 1.
    let cfg = config_with(true, &["train.max_steps=4"]);
    let one = params(&cfg, 1);
    for w in [2, 4] {
        let (d, name) = max_rel_diff_floor(&params(&cfg, w), &one, 1.0);
        assert!(d <= 1e-4, "W={w}: largest relative difference {d:.2e} in {name}");
    }
}

#[test]
fn views_built_ahead_on_loader_threads_train_exactly_like_views_built_inline() {
    // Prefetching changes only when the views are built: the parameters are bit-identical.
    let sets = ["train.max_steps=2"];
    let ahead = params(&config_with(true, &[sets[0], "data.loader={workers: 2, prefetch: 3}"]), 2);
    let inline = params(&config_with(true, &[sets[0], "data.loader.workers=0"]), 2);
    let (d, name) = max_rel_diff(&ahead, &inline);
    assert!(d == 0.0, "prefetched and inline views trained differently: {d:.2e} in {name}");
}
