//! The loaders' copies to a GPU (feature `cuda`): batches assembled in pinned host memory and
//! copied on the loader's copy stream, ordered with the device's stream by events, equal bit
//! for bit to the batches of the CPU path, for the indexed loader and the webdataset stream
//! loader, with and without worker threads; and the pinned path is the one that ran.
//!
//! It needs the `cuda` feature and a GPU (`scripts/ci/gpu_ci.sh`). Without either it skips by
//! name, saying why (`allgrad_testkit::skip`), unless ALLGRAD_REQUIRE_GPU=1, which makes that a
//! failure.

use std::sync::Arc;

use allgrad_data::webdataset::{ShardStream, ShardWriter, StreamLoader, WebDatasetOptions};
use allgrad_data::{AugmentConfig, ColorMode, Image, InMemory, Loader, LoaderConfig, Normalize, TwoViews};
use candle_core::{Device, Tensor};

fn gpu() -> Option<Device> {
    if !cfg!(feature = "cuda") {
        allgrad_testkit::skip(allgrad_testkit::Need::Gpu, "this test binary was built without the `cuda` feature");
        return None;
    }
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            allgrad_testkit::skip(allgrad_testkit::Need::Gpu, &format!("no CUDA device ({e})"));
            None
        }
    }
}

fn images() -> Vec<Image> {
    (0..24u32)
        .map(|i| Image::new(37, 29, 3, (0..37 * 29 * 3u32).map(|p| ((p * 7 + i * 53) % 256) as u8).collect()).unwrap())
        .collect()
}

fn views() -> Arc<TwoViews> {
    Arc::new(TwoViews::new(AugmentConfig { normalize: Normalize::identity(), ..AugmentConfig::simclr(16) }).unwrap())
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_device(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
}

/// One batch's indices, views (as bits) and labels.
type FlatBatch = (Vec<usize>, Vec<Vec<u32>>, Vec<u32>);

/// Every batch's indices, views (as bits) and labels.
fn flat(batches: impl Iterator<Item = allgrad_data::DataResult<allgrad_data::Batch>>) -> Vec<FlatBatch> {
    batches
        .map(|b| {
            let b = b.unwrap();
            let labels = b.labels.to_device(&Device::Cpu).unwrap().to_vec1::<u32>().unwrap();
            (b.indices.clone(), b.views.iter().map(bits).collect(), labels)
        })
        .collect()
}

#[test]
fn batches_copied_through_pinned_memory_equal_the_cpu_batches() {
    let Some(gpu) = gpu() else { return };
    let data = Arc::new(InMemory::new(images(), (0..24).map(|i| i % 5).collect(), 5).unwrap());
    let plan: Vec<Vec<usize>> = vec![vec![3, 1, 4, 0], vec![5, 9, 2, 6], vec![8, 7, 11, 10], vec![23, 12]];
    let cpu = flat(Loader::new(data.clone(), views(), 2, 1, plan.clone(), &LoaderConfig::default(), &Device::Cpu).unwrap());
    for workers in [0, 1, 3] {
        let before = allgrad_data::pinned_uploads();
        let cfg = LoaderConfig { workers, prefetch: 2, ..Default::default() };
        let loader = Loader::new(data.clone(), views(), 2, 1, plan.clone(), &cfg, &gpu).unwrap();
        let got: Vec<_> = loader.collect();
        assert!(got.iter().all(|b| b.as_ref().unwrap().views[0].device().is_cuda()));
        assert!(flat(got.into_iter()) == cpu, "{workers} workers: the GPU batches differ from the CPU ones");
        assert_eq!(allgrad_data::pinned_uploads() - before, 8, "4 batches x 2 views through the pinned path");
    }

    // The stream loader: one upload per view, from one part per stream.
    let dir = tempfile::tempdir().unwrap();
    let mut w = ShardWriter::new(dir.path(), "s", 5).unwrap();
    for (i, img) in images().iter().enumerate() {
        w.write(&format!("k{i:03}"), &[("png", &img.to_png().unwrap()), ("cls", (i % 5).to_string().as_bytes())]).unwrap();
    }
    let opts =
        WebDatasetOptions { train: vec!["x".into()], epoch_samples: 24, streams: 4, shuffle_buffer: 3, ..Default::default() };
    let source = Arc::new(ShardStream::new(w.finish().unwrap(), opts, 8, ColorMode::Rgb).unwrap());
    let plan: Vec<Vec<usize>> = (0..3).map(|b| (b * 8..b * 8 + 8).collect()).collect();
    let cfg = LoaderConfig { workers: 2, prefetch: 2, ..Default::default() };
    let cpu = flat(StreamLoader::new(source.clone(), views(), 2, 0, plan.clone(), &cfg, &Device::Cpu).unwrap());
    let before = allgrad_data::pinned_uploads();
    let got = flat(StreamLoader::new(source, views(), 2, 0, plan, &cfg, &gpu).unwrap());
    assert!(got == cpu, "the stream loader's GPU batches differ from its CPU ones");
    assert_eq!(allgrad_data::pinned_uploads() - before, 6, "3 batches x 2 views through the pinned path");
}
