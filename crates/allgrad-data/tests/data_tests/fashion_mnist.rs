//! The Fashion-MNIST subset shipped in `data/fashion-mnist/` opens, matches the values
//! recorded when it was made, and goes through the augmentations and the loader.

use std::path::PathBuf;
use std::sync::Arc;

use allgrad_data::{AugmentConfig, Dataset, IdxDataset, Loader, LoaderConfig, Normalize, Split, TwoViews};
use candle_core::Device;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data/fashion-mnist")
}

#[test]
fn bundled_subset_opens_with_the_recorded_contents() {
    let train = IdxDataset::open_dir(dir(), Split::Train).unwrap();
    let test = IdxDataset::open_dir(dir(), Split::Test).unwrap();
    assert_eq!((train.len(), test.len()), (10_000, 2_000));
    assert_eq!((train.rows(), train.cols(), train.num_classes(), test.num_classes()), (28, 28, 10, 10));
    // Values computed from the original files with Python when the subset was made.
    let first = |ds: &IdxDataset| (0..5).map(|i| ds.label(i).unwrap()).collect::<Vec<_>>();
    assert_eq!(first(&train), [9, 0, 0, 3, 0]);
    assert_eq!(first(&test), [9, 2, 1, 1, 6]);
    let sum = |ds: &IdxDataset, i| ds.get(i).unwrap().pixels.iter().map(|&p| p as u64).sum::<u64>();
    assert_eq!((sum(&train, 0), sum(&test, 0)), (76_247, 33_456));
}

#[test]
fn bundled_subset_through_two_views_and_the_loader() {
    let train = Arc::new(IdxDataset::open_dir(dir(), Split::Train).unwrap());
    let cfg = AugmentConfig { normalize: Normalize { mean: vec![0.2860], std: vec![0.3530] }, ..AugmentConfig::simclr(28) };
    let views = Arc::new(TwoViews::new(cfg).unwrap());
    let plan: Vec<Vec<usize>> = (0..3).map(|b| (0..32).map(|i| (b * 977 + i * 131) % 10_000).collect()).collect();
    let loader =
        Loader::new(train, views, 1, 0, plan, &LoaderConfig { workers: 2, prefetch: 2, ..Default::default() }, &Device::Cpu)
            .unwrap();
    for batch in loader {
        let batch = batch.unwrap();
        assert_eq!(batch.views.len(), 2);
        for v in &batch.views {
            assert_eq!(v.dims(), &[32, 1, 28, 28]);
            let x = v.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            // Normalised [0, 1] values: within [-0.286/0.353, 0.714/0.353].
            assert!(x.iter().all(|v| (-0.82..=2.03).contains(v)));
        }
        assert!(batch.labels.to_vec1::<u32>().unwrap().iter().all(|&l| l < 10));
    }
}
