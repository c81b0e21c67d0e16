//! Two augmented views of image batches through a ResNet encoder and a projector: what the
//! two-view method computes its loss on.

use std::sync::Arc;

use allgrad_data::webdataset::{ShardStream, StreamLoader, StreamState};
use allgrad_data::{Augment, AugmentConfig, Dataset, Loader, LoaderConfig, Split, TwoViews};
use candle_core::{DType, Device, Result, Tensor};
use candle_nn::VarBuilder;

use super::data::{data_err, ImageData, KnnConfig};
use super::projector::{ImageModel, Projector};
use crate::batch_norm::Mode;
use crate::resnet::ResNet;
use crate::{Batch, ModelError};

/// The loader building the coming batches: over an indexed data set, or over a stream.
enum Ahead {
    Indexed(Loader),
    Stream(StreamLoader),
}

impl Ahead {
    fn next(&mut self) -> Option<allgrad_data::DataResult<allgrad_data::Batch>> {
        match self {
            Ahead::Indexed(l) => l.next(),
            Ahead::Stream(l) => l.next(),
        }
    }
}

/// The data, its two views, the encoder and the projector; see the module docs.
pub struct TwoViewImages {
    model: ImageModel,
    /// The training set for the indexed formats; the kNN bank (only) for `webdataset`.
    pub(super) train: Arc<dyn Dataset>,
    pub(super) test: Arc<dyn Dataset>,
    /// `webdataset`: the training stream (set by [`TwoViewImages::set_global_batch`]).
    stream: Option<Arc<ShardStream>>,
    data: ImageData,
    views: Arc<TwoViews>,
    pub(super) eval_view: Augment,
    pub(super) knn: KnnConfig,
    loader_cfg: LoaderConfig,
    loader: Option<Ahead>,
    prefetched: usize,
    device: Device,
    dtype: DType,
    net: Option<(ResNet, Projector)>,
}

impl TwoViewImages {
    /// Opens the data and prepares the augmentations (parameters come with `build`).
    pub fn new(data: &ImageData, model: ImageModel, device: Device, dtype: DType) -> Result<Self> {
        let aug_err = ModelError::Augment;
        let views = TwoViews::new(data.augment.clone()).map_err(aug_err)?;
        let eval_view = Augment::new(AugmentConfig::eval(data.augment.normalize.clone())).map_err(aug_err)?;
        model.projector.validate()?;
        Ok(TwoViewImages {
            model,
            train: data.open(Split::Train)?,
            test: data.open(Split::Test)?,
            stream: None,
            data: data.clone(),
            views: Arc::new(views),
            eval_view,
            knn: data.knn.clone(),
            loader_cfg: data.loader.clone(),
            loader: None,
            prefetched: 0,
            device,
            dtype,
            net: None,
        })
    }

    /// Creates the encoder (`encoder.*`, from `model.init_from` when given) and projector
    /// (`projector.*`) parameters.
    pub fn build(&mut self, vb: VarBuilder) -> Result<()> {
        let enc = crate::resnet_io::build_resnet(&self.model.encoder, self.model.init_from.as_ref(), vb.pp("encoder"))?;
        let proj = Projector::new(&self.model.projector, enc.feature_dim(), self.model.encoder.sync_bn, vb.pp("projector"))?;
        self.net = Some((enc, proj));
        Ok(())
    }

    /// The global batch the run takes: the `webdataset` format lays its streams out by it
    /// (and opens its training stream here). Nothing for the other formats.
    pub fn set_global_batch(&mut self, global_batch: usize) -> Result<()> {
        self.stream = self.data.stream(global_batch)?;
        Ok(())
    }

    /// Whether the training samples are a stream: batch indices are then positions in the
    /// epoch, which the trainer must ask for in order.
    pub fn is_stream(&self) -> bool {
        self.data.format == super::ImageFormat::Webdataset
    }

    fn stream(&self) -> Result<&Arc<ShardStream>> {
        self.stream.as_ref().ok_or_else(|| {
            candle_core::Error::Msg("the webdataset stream needs the run's global batch (TwoViewImages::set_global_batch)".into())
        })
    }

    /// Where this rank's training streams stand (`webdataset`; `None` for the other formats).
    pub fn stream_state(&self) -> Result<Option<StreamState>> {
        self.stream.as_ref().map(|s| s.state().map_err(data_err)).transpose()
    }

    /// Resumes the training stream from a saved position (see [`ShardStream::resume_from`]).
    pub fn resume_stream(&mut self, state: StreamState) -> Result<()> {
        self.stream()?.resume_from(state).map_err(data_err)
    }

    /// Training samples per epoch (`webdataset.epoch_samples` for a stream).
    pub fn num_samples(&self) -> usize {
        match (&self.stream, self.is_stream()) {
            (Some(s), _) => s.epoch_samples(),
            (None, true) => self.data.webdataset.epoch_samples,
            (None, false) => self.train.len(),
        }
    }

    /// Starts building the views of `batches` (this rank's coming micro-batches of `epoch`,
    /// in order) on the loader's threads. Replaces any earlier plan. A stream is always
    /// planned (with no workers its batches are built when asked for, in order).
    pub fn plan(&mut self, epoch: usize, seed: u64, batches: &[Vec<usize>]) -> Result<()> {
        self.loader = None; // stops the old workers first
        if batches.is_empty() {
            return Ok(());
        }
        let pipeline: Arc<dyn allgrad_data::Pipeline> = self.views.clone();
        let (plan, cfg) = (batches.to_vec(), &self.loader_cfg);
        self.loader = Some(if self.is_stream() {
            let stream = self.stream()?.clone();
            Ahead::Stream(StreamLoader::new(stream, pipeline, seed, epoch as u64, plan, cfg, &self.device).map_err(data_err)?)
        } else if cfg.workers == 0 {
            return Ok(());
        } else {
            Ahead::Indexed(
                Loader::new(self.train.clone(), pipeline, seed, epoch as u64, plan, cfg, &self.device).map_err(data_err)?,
            )
        });
        Ok(())
    }

    /// The two views of `batch`, `[b, C, H, W]` each: from the loader when it built this
    /// batch, otherwise built here.
    pub fn views(&mut self, batch: &Batch) -> Result<(Tensor, Tensor)> {
        if let Some(loader) = &mut self.loader {
            match loader.next() {
                Some(Ok(b)) if b.indices == batch.indices => {
                    self.prefetched += 1;
                    return Ok((b.views[0].to_dtype(self.dtype)?, b.views[1].to_dtype(self.dtype)?));
                }
                Some(Err(e)) => return Err(data_err(e)),
                _ => {
                    tracing::debug!("the loader's plan does not match the batch asked for; building it inline");
                    self.loader = None;
                }
            }
        }
        if self.is_stream() {
            // Unplanned: the stream read from the epoch's start to this batch, here.
            let pipeline: Arc<dyn allgrad_data::Pipeline> = self.views.clone();
            let cfg = LoaderConfig { workers: 0, prefetch: 0, ..Default::default() };
            let stream = self.stream()?.clone();
            let plan = vec![batch.indices.to_vec()];
            let mut once = StreamLoader::new(stream, pipeline, batch.seed, batch.epoch as u64, plan, &cfg, &self.device)
                .map_err(data_err)?;
            let b = once.next().ok_or_else(|| candle_core::Error::Msg("the stream gave no batch".into()))?.map_err(data_err)?;
            return Ok((b.views[0].to_dtype(self.dtype)?, b.views[1].to_dtype(self.dtype)?));
        }
        let b = batch.indices.len();
        let (mut first, mut second) = (Vec::with_capacity(b), Vec::with_capacity(b));
        for &i in batch.indices {
            let img = self.train.get(i).map_err(data_err)?;
            let [v1, v2] = self.views.apply(&img, batch.seed, batch.epoch as u64, i as u64).map_err(data_err)?;
            first.push(v1);
            second.push(v2);
        }
        Ok((self.stack(first)?, self.stack(second)?))
    }

    /// How many batches [`TwoViewImages::views`] took from the loader (the rest it built
    /// itself).
    pub fn prefetched(&self) -> usize {
        self.prefetched
    }

    /// Projector outputs of the encoder's features of `x`.
    pub fn embed(&self, x: &Tensor, mode: Mode) -> Result<Tensor> {
        let (enc, proj) = self.net()?;
        proj.forward(&enc.forward(x, mode)?, mode)
    }

    /// The encoder (after `build`).
    pub fn encoder(&self) -> Result<&ResNet> {
        Ok(&self.net()?.0)
    }

    /// The running statistics of every batch norm (encoder, then projector) as buffers; see
    /// [`crate::batch_norm::running_buffers`].
    pub fn buffers(&self) -> Result<Vec<(String, Tensor)>> {
        crate::batch_norm::running_buffers(&self.batch_norms()?)
    }

    /// Restores [`TwoViewImages::buffers`].
    pub fn load_buffers(&self, buffers: &std::collections::HashMap<String, Tensor>) -> Result<()> {
        crate::batch_norm::load_running_buffers(&self.batch_norms()?, buffers)
    }

    fn batch_norms(&self) -> Result<Vec<&crate::batch_norm::BatchNorm>> {
        let (enc, proj) = self.net()?;
        Ok(enc.batch_norms().into_iter().chain(proj.batch_norms()).collect())
    }

    fn net(&self) -> Result<&(ResNet, Projector)> {
        self.net.as_ref().ok_or_else(|| ModelError::NotBuilt { objective: "image" }.into())
    }

    /// Images (`[n, C, H, W]`, this method's device and dtype) from their views.
    pub(super) fn stack(&self, views: Vec<allgrad_data::Chw>) -> Result<Tensor> {
        let (c, h, w) = (views[0].channels, views[0].height, views[0].width);
        let n = views.len();
        let data: Vec<f32> = views.into_iter().flat_map(|v| v.data).collect();
        allgrad_nn::transfer::upload(data, (n, c, h, w), &self.device)?.to_dtype(self.dtype)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::image_ssl::{ImageFormat, ImageModel};
    use allgrad_data::FolderOptions;

    #[test]
    fn planned_batches_come_from_the_loader_and_equal_views_built_inline() {
        let data = |workers| ImageData {
            dir: std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/fashion-mnist"),
            format: ImageFormat::Idx,
            augment: AugmentConfig { normalize: allgrad_data::Normalize::identity(), ..AugmentConfig::simclr(12) },
            knn: KnnConfig::default(),
            loader: LoaderConfig { workers, prefetch: 2, ..Default::default() },
            folder: FolderOptions::default(),
            webdataset: Default::default(),
        };
        let plan = vec![vec![3, 1, 4], vec![1, 5, 9]];
        let run = |workers| {
            let mut images = TwoViewImages::new(&data(workers), ImageModel::default(), Device::Cpu, DType::F32).unwrap();
            images.plan(2, 7, &plan).unwrap();
            let views: Vec<(Tensor, Tensor)> =
                plan.iter().map(|idx| images.views(&Batch { indices: idx, epoch: 2, step: 0, seed: 7 }).unwrap()).collect();
            (views, images.prefetched())
        };
        let ((ahead, n_ahead), (inline, n_inline)) = (run(2), run(0));
        assert_eq!((n_ahead, n_inline), (2, 0), "batches taken from the loader");
        for ((a1, a2), (b1, b2)) in ahead.iter().zip(&inline) {
            assert_eq!(a1.dims(), &[3, 1, 12, 12]);
            for (a, b) in [(a1, b1), (a2, b2)] {
                let diff = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                assert_eq!(diff, 0.0, "prefetched views differ from inline ones");
            }
        }
    }
}
