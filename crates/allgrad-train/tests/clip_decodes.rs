//! Where CLIP's images are decoded: a run of `method: clip` on a CSV of JPEG photographs, with
//! gradient caching (each chunk embedded twice), decodes each sample once, on the loader's
//! worker threads: the rank threads that train decode none (allgrad-data's decode counter,
//! `decode_counts`). With no workers, the same run decodes on the rank threads (the counter
//! sees what it is meant to see). A binary of its own: the process-wide count is exact only
//! when no other test decodes at the same time.

use std::path::{Path, PathBuf};

use allgrad_dist::run_threads;
use allgrad_train::{run, RunConfig};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A CSV of 24 pairs over the committed photographs (JPEG), in a temporary folder.
fn pairs(dir: &Path) -> PathBuf {
    let photos = repo().join("crates/allgrad-models/tests/data/clip-images");
    let files = ["wide.jpg", "tall.jpg", "square.jpg", "small.jpg", "gray.jpg"];
    let mut csv = String::from("image,caption\n");
    for i in 0..24 {
        let f = files[i % files.len()];
        csv += &format!("{},a photograph number {i}\n", photos.join(f).display());
    }
    let path = dir.join("pairs.csv");
    std::fs::write(&path, csv).unwrap();
    path
}

/// Decodes by the whole process and by each rank thread in a 2-rank run of 3 steps (global
/// batch 8: the 24 pairs once) with `workers` loader threads and `train.cache_chunk: 2`.
fn decodes(workers: usize) -> (u64, Vec<u64>) {
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "seed: 3\nmethod: clip\n\
         data: {{csv: {}, loader: {{workers: {workers}, prefetch: 2}}}}\n\
         model: {{dir: {}}}\n\
         train: {{global_batch: 8, epochs: 1, max_steps: 3, eval: false, cache_chunk: 2}}\n\
         optim: {{kind: adamw, lr: 1.0e-3}}\n\
         log: {{progress: quiet, plot: false}}\n",
        pairs(dir.path()).display(),
        repo().join("data/clip-tiny").display()
    );
    let cfg = RunConfig::parse(&text, &dir.path().join("clip.yaml"), &[]).unwrap();
    let before = allgrad_data::decode_counts().0;
    let here = run_threads(2, |pg| {
        let start = allgrad_data::decode_counts().1;
        let loss = run::build(&cfg, pg, None, false)?.train()?.last_loss;
        assert!(loss.is_finite());
        Ok(allgrad_data::decode_counts().1 - start)
    })
    .unwrap();
    (allgrad_data::decode_counts().0 - before, here)
}

#[test]
fn clip_decodes_each_sample_once_on_the_loaders_threads_none_on_the_training_threads() {
    let (total, ranks) = decodes(2);
    assert_eq!(ranks, vec![0, 0], "JPEG decodes on the training threads");
    assert_eq!(total, 24, "decodes in 3 steps of 8 pairs with every chunk embedded twice");
    // Control: without workers the rank threads decode their own halves, once per sample.
    let (total, ranks) = decodes(0);
    assert_eq!((total, ranks), (24, vec![12, 12]));
}
