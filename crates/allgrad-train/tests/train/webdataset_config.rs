//! `data.format: webdataset` in a run config: its keys are checked once, at validation,
//! against the global batch and the world size, with messages that name the file, the key
//! path and the numbers; `face` refuses the format.

use std::path::{Path, PathBuf};

use allgrad_train::Registry;

fn config(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs").join(name)
}

/// The error of validating `file` with `sets` on `world` ranks, or `None` when it passes.
fn check(file: &str, sets: &[&str], world: usize) -> Option<String> {
    let methods = Registry::builtin();
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let cfg = methods.load(&config(file), &sets).unwrap();
    methods.validate(&cfg, world, &config(file)).err().map(|e| e.to_string())
}

#[test]
fn webdataset_keys_are_checked_against_the_batch_and_the_world() {
    // configs/simclr.yaml has train.global_batch 128.
    let shards = "data.webdataset={train: ['train-{000..009}.tar'], epoch_samples: 1024, streams: 4}";
    assert_eq!(check("simclr.yaml", &["data.format=webdataset", shards], 2), None);
    let e = check("simclr.yaml", &["data.format=webdataset", shards, "train.global_batch=96"], 3).unwrap();
    assert!(e.contains("simclr.yaml") && e.contains("data.webdataset.streams"), "{e}");
    assert!(e.contains("webdataset.streams = 4 is not a multiple of the world size 3"), "{e}");
    let e = check("simclr.yaml", &["data.format=webdataset", shards, "data.webdataset.streams=3"], 1).unwrap();
    assert!(e.contains("train.global_batch = 128 is not divisible by webdataset.streams = 3"), "{e}");
    let e = check("simclr.yaml", &["data.format=webdataset", shards, "data.webdataset.epoch_samples=0"], 1).unwrap();
    assert!(e.contains("data.webdataset.epoch_samples") && e.contains("required"), "{e}");
    let tested = "data.webdataset.test=['val-0.tar']";
    let e = check("simclr.yaml", &["data.format=webdataset", shards, tested, "data.knn.bank=0"], 1).unwrap();
    assert!(e.contains("data.knn.bank") && e.contains("every training shard"), "{e}");
    assert_eq!(check("simclr.yaml", &["data.format=webdataset", shards, tested, "data.knn.bank=512"], 1), None);
    let e = check("barlowtwins.yaml", &["data.format=webdataset"], 1).unwrap();
    assert!(e.contains("data.webdataset.train") && e.contains("lists no shards"), "{e}");
    let e = check("face.yaml", &["data.format=webdataset"], 1).unwrap();
    assert!(e.contains("data.format") && e.contains("face reads idx, cifar10 or folder"), "{e}");
}
