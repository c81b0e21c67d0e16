//! A batch loader with worker threads and a bounded prefetch queue.
//!
//! The caller gives the batches as lists of global sample indices (from the distributed
//! sampler: this rank's slice of each global batch). Batch `b` is built by worker
//! `b % workers` and the loader hands the batches out in plan order. Every view is keyed by
//! (seed, epoch, global index, view), so the batches are bit-identical for any number of
//! workers, and a sample's views do not depend on which rank or batch position it has.
//!
//! ```
//! use std::sync::Arc;
//! use allgrad_data::{AugmentConfig, Image, InMemory, Loader, LoaderConfig, Normalize, TwoViews};
//! let images = (0..6).map(|i| Image::new(8, 8, 1, vec![i * 40; 64]).unwrap()).collect();
//! let data = Arc::new(InMemory::new(images, vec![0, 1, 0, 1, 0, 1], 2).unwrap());
//! let cfg = AugmentConfig { normalize: Normalize::identity(), ..AugmentConfig::simclr(4) };
//! let views = Arc::new(TwoViews::new(cfg).unwrap());
//! let plan = vec![vec![4, 0, 2], vec![5, 1, 3]];
//! let loader = Loader::new(data, views, 0, 0, plan, &LoaderConfig::default(), &candle_core::Device::Cpu).unwrap();
//! for batch in loader {
//!     let batch = batch.unwrap();
//!     assert_eq!(batch.views[0].dims(), &[3, 1, 4, 4]);
//! }
//! ```

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use std::thread::JoinHandle;

use candle_core::Device;
use serde::{Deserialize, Serialize};

use crate::augment::{Pipeline, ViewKey};
use crate::dataset::Dataset;
use crate::error::{DataError, DataResult};
use crate::host::{to_batch, Batch, HostBatch, HostView, Staging};
use crate::image::{Chw, Decoded};

/// Loader threads and queue.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoaderConfig {
    /// Worker threads building batches; 0 builds each batch on the consuming thread when it
    /// is asked for.
    pub workers: usize,
    /// Batches that may wait, built, in the queue (shared out evenly among the workers,
    /// rounded up); each worker may also hold one more finished batch while it waits for
    /// room.
    pub prefetch: usize,
    /// Decode each JPEG at 1/2, 1/4 or 1/8 of its size when every view of the sample allows it
    /// (its crop box at least that many times the output size in both axes), in the DCT domain
    /// ([`crate::decode_image_shrunk`]); the views are then close to, not equal to, those of a
    /// full decode (docs/data.md gives the error). Off by default: views stay bit for bit those
    /// of a full decode, so runs and checkpoints made before keep their data.
    pub scaled_decode: bool,
}

impl Default for LoaderConfig {
    fn default() -> Self {
        LoaderConfig { workers: 2, prefetch: 4, scaled_decode: false }
    }
}

/// What every worker needs to build any batch.
#[derive(Clone)]
struct Plan {
    dataset: Arc<dyn Dataset>,
    pipeline: Arc<dyn Pipeline>,
    seed: u64,
    epoch: u64,
    batches: Arc<Vec<Vec<usize>>>,
    staging: Staging,
    scaled_decode: bool,
}

impl Plan {
    fn build(&self, b: usize) -> DataResult<HostBatch> {
        let indices = &self.batches[b];
        let mut labels = Vec::with_capacity(indices.len());
        let mut tokens = Vec::new();
        let key = |index: usize, view| ViewKey { seed: self.seed, epoch: self.epoch, index: index as u64, view };
        let samples = indices.iter().map(|&index| {
            let img = if self.scaled_decode {
                self.dataset.get_shrunk(index, &|w, h| self.pipeline.shrink(w, h, key(index, 0)))?
            } else {
                Decoded::whole(self.dataset.get(index)?)
            };
            labels.push(self.dataset.label(index)? as u32);
            if self.pipeline.takes_text() {
                let text = self.dataset.text(index)?.ok_or_else(|| DataError::Text {
                    reason: format!("sample {index} has no text, which the pipeline takes (a caption)"),
                })?;
                tokens.push(self.pipeline.encode_text(&text)?);
            }
            Ok((index, img))
        });
        let views = assemble(samples, indices.len(), self.pipeline.as_ref(), &self.staging, key)?;
        Ok(HostBatch { indices: indices.clone(), views, labels, tokens })
    }
}

/// The views of `n` samples `(index, image)` through `pipeline`, each view in one buffer of
/// `staging` (the samples' views one after the other); every sample's view must have the
/// first one's shape.
pub(crate) fn assemble(
    samples: impl Iterator<Item = DataResult<(usize, Decoded)>>,
    n: usize,
    pipeline: &dyn Pipeline,
    staging: &Staging,
    key: impl Fn(usize, u64) -> ViewKey,
) -> DataResult<Vec<HostView>> {
    let with_views = samples.map(|sample| {
        let (index, img) = sample?;
        Ok((index, views_of(&img, index, pipeline, &key)?))
    });
    place(with_views, n, staging)
}

/// The views `0..pipeline.num_views()` of sample `index`, decoded as `img`.
pub(crate) fn views_of(
    img: &Decoded,
    index: usize,
    pipeline: &dyn Pipeline,
    key: &impl Fn(usize, u64) -> ViewKey,
) -> DataResult<Vec<Chw>> {
    (0..pipeline.num_views() as u64).map(|v| pipeline.view_shrunk(&img.image, img.full, img.shrink, key(index, v))).collect()
}

/// The views of `n` samples `(index, views)`, each view in one buffer of `staging` (the
/// samples' views one after the other, in the order given); every sample's view must have
/// the first one's shape.
pub(crate) fn place(
    samples: impl Iterator<Item = DataResult<(usize, Vec<Chw>)>>,
    n: usize,
    staging: &Staging,
) -> DataResult<Vec<HostView>> {
    let mut views: Vec<HostView> = Vec::new();
    for (pos, sample) in samples.enumerate() {
        let (index, chws) = sample?;
        for (v, chw) in chws.into_iter().enumerate() {
            if pos == 0 {
                let part = staging.buffer(chw.data.len() * n)?;
                views.push(HostView { parts: vec![part], sample: chw.shape() });
            } else if chw.shape() != views[v].sample {
                return Err(DataError::BatchShape { index, expected: views[v].sample, found: chw.shape() });
            }
            let len = chw.data.len();
            views[v].parts[0].as_mut_slice()?[pos * len..(pos + 1) * len].copy_from_slice(&chw.data);
        }
    }
    Ok(views)
}

/// An iterator over the batches of a plan, built ahead on worker threads. Dropping it stops
/// the workers.
pub struct Loader {
    plan: Plan,
    receivers: Vec<Receiver<DataResult<HostBatch>>>,
    handles: Vec<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
    next: usize,
    device: Device,
    /// With copies to a device: the next batch, its copy started (see [`crate::host`]).
    ahead: Option<DataResult<Batch>>,
}

impl Loader {
    /// Starts building `batches` (lists of global sample indices) of `dataset` through
    /// `pipeline`, with views keyed by `seed` and `epoch`; tensors are created on `device`.
    ///
    /// Fails at once for an empty batch or an index past the dataset's end. Errors while
    /// building a batch (an unreadable file, say) come out of the iterator in that batch's
    /// place; the following batches still come.
    pub fn new(
        dataset: Arc<dyn Dataset>,
        pipeline: Arc<dyn Pipeline>,
        seed: u64,
        epoch: u64,
        batches: Vec<Vec<usize>>,
        cfg: &LoaderConfig,
        device: &Device,
    ) -> DataResult<Self> {
        let len = dataset.len();
        for (b, batch) in batches.iter().enumerate() {
            if batch.is_empty() {
                return Err(DataError::EmptyBatch { batch: b });
            }
            if let Some(&index) = batch.iter().find(|&&i| i >= len) {
                return Err(DataError::IndexOutOfRange { index, len });
            }
        }
        let staging = Staging::for_device(device)?;
        let plan = Plan { dataset, pipeline, seed, epoch, batches: Arc::new(batches), staging, scaled_decode: cfg.scaled_decode };
        let total = plan.batches.len();
        let workers = cfg.workers.min(total);
        let stop = Arc::new(AtomicBool::new(false));
        let mut loader = Loader {
            plan: plan.clone(),
            receivers: Vec::new(),
            handles: Vec::new(),
            stop: stop.clone(),
            next: 0,
            device: device.clone(),
            ahead: None,
        };
        let capacity = cfg.prefetch.div_ceil(workers.max(1));
        for w in 0..workers {
            let (tx, rx) = sync_channel(capacity);
            let (plan, stop) = (plan.clone(), stop.clone());
            let handle = std::thread::Builder::new()
                .name(format!("allgrad-data-{w}"))
                .spawn(move || {
                    for b in (w..total).step_by(workers) {
                        if stop.load(Ordering::Relaxed) || tx.send(plan.build(b)).is_err() {
                            break;
                        }
                    }
                })
                .map_err(|source| DataError::Spawn { worker: w, source })?;
            loader.receivers.push(rx);
            loader.handles.push(handle);
        }
        Ok(loader)
    }

    /// Number of batches in the plan.
    pub fn num_batches(&self) -> usize {
        self.plan.batches.len()
    }
}

impl Loader {
    /// The next batch of the plan as tensors.
    fn take(&mut self) -> Option<DataResult<Batch>> {
        let b = self.next;
        if b >= self.num_batches() {
            return None;
        }
        self.next += 1;
        let host = if self.receivers.is_empty() {
            self.plan.build(b)
        } else {
            let w = b % self.receivers.len();
            match self.receivers[w].recv() {
                Ok(r) => r,
                Err(_) => {
                    self.next = self.num_batches(); // the plan cannot be completed
                    Err(DataError::WorkerLost { worker: w, batch: b })
                }
            }
        };
        Some(host.and_then(|h| to_batch(h, &self.device)))
    }
}

impl Iterator for Loader {
    type Item = DataResult<Batch>;

    fn next(&mut self) -> Option<Self::Item> {
        if !self.plan.staging.copies_ahead() {
            return self.take();
        }
        // To a device: hand out this batch once the next one's copy has been started.
        let current = self.ahead.take().or_else(|| self.take())?;
        if current.is_ok() {
            self.ahead = self.take();
        }
        Some(current)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.num_batches() - self.next + self.ahead.is_some() as usize;
        (left, Some(left))
    }
}

impl ExactSizeIterator for Loader {}

impl Drop for Loader {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Dropping the receivers makes any blocked send fail, so every worker returns.
        self.receivers.clear();
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::augment::{AugmentConfig, Normalize, TwoViews};
    use crate::dataset::InMemory;
    use crate::image::Image;
    use std::sync::atomic::AtomicUsize;

    /// 11 gray 9x7 images with varied content, labels i % 3.
    fn data() -> InMemory {
        let images = (0..11u32)
            .map(|i| Image::new(9, 7, 1, (0..63u32).map(|p| ((p * 7 + i * 31) % 256) as u8).collect()).unwrap())
            .collect();
        InMemory::new(images, (0..11).map(|i| i % 3).collect(), 3).unwrap()
    }

    fn views() -> Arc<TwoViews> {
        let cfg = AugmentConfig { normalize: Normalize { mean: vec![0.5], std: vec![0.25] }, ..AugmentConfig::simclr(5) };
        Arc::new(TwoViews::new(cfg).unwrap())
    }

    /// An uneven plan in shuffled order.
    fn plan() -> Vec<Vec<usize>> {
        vec![vec![3, 7, 1], vec![10, 0, 5], vec![2, 9, 4], vec![8, 6]]
    }

    /// Indices, flattened views and labels of one batch.
    type Flat = (Vec<usize>, Vec<Vec<f32>>, Vec<u32>);

    fn collect(workers: usize, prefetch: usize) -> Vec<Flat> {
        let cfg = LoaderConfig { workers, prefetch, ..Default::default() };
        let loader = Loader::new(Arc::new(data()), views(), 11, 2, plan(), &cfg, &Device::Cpu).unwrap();
        assert_eq!(loader.len(), 4);
        loader
            .map(|b| {
                let b = b.unwrap();
                let views = b.views.iter().map(|v| v.flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect();
                (b.indices, views, b.labels.to_vec1::<u32>().unwrap())
            })
            .collect()
    }

    #[test]
    fn batches_are_identical_for_any_number_of_workers() {
        let one = collect(1, 2);
        assert_eq!(one, collect(3, 2));
        assert_eq!(one, collect(0, 0));
        assert_eq!(one, collect(3, 0));
        assert_eq!(one, collect(8, 1));
        // In plan order, labels matching, views distinct.
        let idx: Vec<Vec<usize>> = one.iter().map(|b| b.0.clone()).collect();
        assert_eq!(idx, plan());
        assert_eq!(one[3].2, vec![2, 0]);
        assert_ne!(one[0].1[0], one[0].1[1]);
    }

    #[test]
    fn a_sample_does_not_depend_on_its_batch_or_position() {
        // Sample 7 alone, or second in another batch: the same views.
        let cfg = LoaderConfig { workers: 2, prefetch: 2, ..Default::default() };
        let run = |plan: Vec<Vec<usize>>| {
            let l = Loader::new(Arc::new(data()), views(), 11, 2, plan, &cfg, &Device::Cpu).unwrap();
            l.map(|b| b.unwrap()).collect::<Vec<_>>()
        };
        let alone = run(vec![vec![7]]);
        let mixed = run(vec![vec![1, 2], vec![5, 7, 3]]);
        for v in 0..2 {
            let a = alone[0].views[v].get(0).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let b = mixed[1].views[v].get(1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(a, b);
        }
        assert_eq!(mixed[1].views[0].dims(), &[3, 1, 5, 5]);
    }

    #[test]
    fn bad_plans_fail_at_once_and_bad_samples_in_place() {
        let cfg = LoaderConfig::default();
        let err = Loader::new(Arc::new(data()), views(), 0, 0, vec![vec![0], vec![]], &cfg, &Device::Cpu).err().unwrap();
        assert!(matches!(err, DataError::EmptyBatch { batch: 1 }));
        let err = Loader::new(Arc::new(data()), views(), 0, 0, vec![vec![0, 11]], &cfg, &Device::Cpu).err().unwrap();
        assert!(matches!(err, DataError::IndexOutOfRange { index: 11, len: 11 }));
        // Mixed image sizes without a crop: that batch is an error, the others come.
        let mut images: Vec<Image> = (0..4).map(|_| Image::new(2, 2, 1, vec![9; 4]).unwrap()).collect();
        images[2] = Image::new(3, 2, 1, vec![9; 6]).unwrap();
        let ds = Arc::new(InMemory::new(images, vec![0; 4], 1).unwrap());
        let eval = Arc::new(crate::augment::Augment::new(AugmentConfig::eval(Normalize::identity())).unwrap());
        let out: Vec<_> =
            Loader::new(ds, eval, 0, 0, vec![vec![0, 1], vec![1, 2], vec![3]], &cfg, &Device::Cpu).unwrap().collect();
        assert!(out[0].is_ok() && out[2].is_ok());
        assert!(matches!(out[1], Err(DataError::BatchShape { index: 2, expected: (1, 2, 2), found: (1, 2, 3) })));
    }

    /// Counts reads, to see how far the workers run ahead.
    struct Counting(InMemory, AtomicUsize);

    impl Dataset for Counting {
        fn len(&self) -> usize {
            self.0.len()
        }
        fn get(&self, i: usize) -> DataResult<Image> {
            self.1.fetch_add(1, Ordering::SeqCst);
            self.0.get(i)
        }
        fn label(&self, i: usize) -> DataResult<usize> {
            self.0.label(i)
        }
        fn num_classes(&self) -> usize {
            self.0.num_classes()
        }
    }

    #[test]
    fn prefetch_is_bounded_and_drop_stops_the_workers() {
        let ds = Arc::new(Counting(data(), AtomicUsize::new(0)));
        let plan: Vec<Vec<usize>> = (0..40).map(|b| vec![b % 11]).collect();
        // 2 workers, prefetch 2: one queued and one waiting batch per worker at most.
        let cfg = LoaderConfig { workers: 2, prefetch: 2, ..Default::default() };
        let mut loader = Loader::new(ds.clone(), views(), 0, 0, plan, &cfg, &Device::Cpu).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(ds.1.load(Ordering::SeqCst) <= 4, "{} batches built ahead", ds.1.load(Ordering::SeqCst));
        assert!(loader.next().unwrap().is_ok());
        drop(loader); // must not hang
        assert!(ds.1.load(Ordering::SeqCst) <= 7);
    }
}
