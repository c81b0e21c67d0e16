//! The two-view image method: SimCLR and BarlowTwins are this one method with different
//! losses.
//!
//! - SimCLR ([`TwoViewMethod::simclr`]): NT-Xent over the global batch (each rank's anchors
//!   against every rank's candidates, through the differentiable all_gather), both views in
//!   one batch through the network (batch norm sees 2b samples, as in SimCLR), usually a
//!   2-layer projector.
//! - BarlowTwins ([`TwoViewMethod::barlow_twins`]): the cross-correlation of the two views'
//!   embeddings made the identity over the GLOBAL batch, each view through the network on its
//!   own (batch statistics per view), usually a Linear-BN-ReLU-...-Linear projector. The loss
//!   ([`crate::losses::cross_correlation`]) standardises each embedding dimension with global
//!   batch statistics and sums `z1n^T z2n / N` over ranks, both through the differentiable
//!   all_reduce: every rank computes the same loss, and its gradient reaches every rank's
//!   samples as in one process. The raw all_reduce of the cross-correlation, whose backward is
//!   the identity, would make every gradient 1/W of the truth.
//!
//! Both use SyncBatchNorm when `encoder.sync_bn` is set, and the kNN monitor and linear probe
//! of [`super::evaluation`]. A W-rank run equals a one-rank run at the same global batch
//! (tested in allgrad-train).

use allgrad_dist::ProcessGroup;
use candle_core::{DType, Device, IndexOp, Result, Tensor};
use candle_nn::VarBuilder;

use super::data::ImageData;
use super::projector::ImageModel;
use super::two_view::TwoViewImages;
use crate::batch_norm::Mode;
use crate::losses::LossConfig;
use crate::objective::QueueBuffer;
use crate::{Batch, EmbeddingObjective, Objective};

/// How the two views of a batch pass through the network.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ViewBatch {
    /// Both views in one batch of 2b images (batch norm normalises them together; SimCLR).
    Joint,
    /// Each view on its own (batch statistics per view; BarlowTwins).
    PerView,
}

/// Two augmented views of every image through one encoder and projector, compared by a
/// distributed loss; see the module docs.
pub struct TwoViewMethod {
    images: TwoViewImages,
    loss: LossConfig,
    /// The keys of past batches (`loss.queue`): both views' of a global micro-batch.
    queue: QueueBuffer,
    batch: ViewBatch,
    /// The views of the batch being embedded (its indices, epoch and seed, then the views),
    /// kept between the chunks of a cached step.
    views: Option<(Vec<usize>, usize, u64, Tensor, Tensor)>,
}

impl TwoViewMethod {
    /// Opens the data and prepares the augmentations (parameters come with `build`); `loss`
    /// compares the views' embeddings, `batch` says how the views go through the network.
    pub fn new(
        data: &ImageData,
        model: ImageModel,
        loss: LossConfig,
        batch: ViewBatch,
        device: Device,
        dtype: DType,
    ) -> Result<Self> {
        loss.validate()?;
        let queue = QueueBuffer::new(loss.new_queue()?, 2, "two-view");
        Ok(TwoViewMethod { images: TwoViewImages::new(data, model, device, dtype)?, loss, queue, batch, views: None })
    }

    /// SimCLR: NT-Xent at `temperature`, both views in one batch.
    pub fn simclr(data: &ImageData, model: ImageModel, temperature: f64, device: Device, dtype: DType) -> Result<Self> {
        Self::new(data, model, LossConfig::NtXent { temperature, tile: None, queue: None }, ViewBatch::Joint, device, dtype)
    }

    /// BarlowTwins: the cross-correlation loss (`lambda` weighs the off-diagonal terms,
    /// `scale` multiplies the loss), each view on its own.
    pub fn barlow_twins(
        data: &ImageData,
        model: ImageModel,
        lambda: f64,
        scale: f64,
        device: Device,
        dtype: DType,
    ) -> Result<Self> {
        Self::new(data, model, LossConfig::CrossCorrelation { lambda, scale, tile: None }, ViewBatch::PerView, device, dtype)
    }

    /// The data, views and network.
    pub fn images(&self) -> &TwoViewImages {
        &self.images
    }

    /// The run's global batch: a `webdataset` stream lays its samples out by it (see
    /// [`TwoViewImages::set_global_batch`]); needed before training on that format.
    pub fn with_global_batch(mut self, global_batch: usize) -> Result<Self> {
        self.images.set_global_batch(global_batch)?;
        Ok(self)
    }
}

/// Embeddings `[n, 2, d]`: the projections of both views of each sample. Under gradient
/// caching the network sees one chunk at a time, so batch norm normalises with the chunk's
/// statistics (SimCLR: both views of the chunk together; BarlowTwins: each view of the chunk
/// on its own), in both passes alike: a cached step differs from a plain one by exactly
/// that (see `allgrad_train::grad_cache`). The views of the whole batch are built once (on
/// the loader's threads when planned) and kept for its chunks.
impl EmbeddingObjective for TwoViewMethod {
    fn embed(&mut self, batch: &Batch, chunk: std::ops::Range<usize>, pg: &ProcessGroup) -> Result<Tensor> {
        let same = |v: &(Vec<usize>, usize, u64, Tensor, Tensor)| v.0 == batch.indices && v.1 == batch.epoch && v.2 == batch.seed;
        let views = match self.views.take() {
            Some(v) if same(&v) => v,
            old => {
                drop(old); // free the old views first
                let (v1, v2) = self.images.views(batch)?;
                (batch.indices.to_vec(), batch.epoch, batch.seed, v1, v2)
            }
        };
        let (v1, v2) = (views.3.narrow(0, chunk.start, chunk.len())?, views.4.narrow(0, chunk.start, chunk.len())?);
        self.views = Some(views);
        let mode = Mode { train: true, pg };
        let (z1, z2) = match self.batch {
            ViewBatch::Joint => {
                let b = chunk.len();
                let z = self.images.embed(&Tensor::cat(&[&v1, &v2], 0)?, mode)?;
                (z.narrow(0, 0, b)?, z.narrow(0, b, b)?)
            }
            ViewBatch::PerView => (self.images.embed(&v1, mode)?, self.images.embed(&v2, mode)?),
        };
        Tensor::stack(&[z1, z2], 1)
    }

    fn loss_of_embeddings(&mut self, z: &Tensor, _batch: &Batch, pg: &ProcessGroup) -> Result<Tensor> {
        self.loss.compute_queued(&z.i((.., 0))?, &z.i((.., 1))?, self.queue.queue(), pg)
    }
}

impl Objective for TwoViewMethod {
    fn build(&mut self, vb: VarBuilder) -> Result<()> {
        self.images.build(vb)
    }

    fn num_samples(&self) -> usize {
        self.images.num_samples()
    }

    fn plan(&mut self, epoch: usize, seed: u64, batches: &[Vec<usize>]) -> Result<()> {
        self.images.plan(epoch, seed, batches)
    }

    fn sequential(&self) -> bool {
        self.images.is_stream()
    }

    fn loss(&mut self, batch: &Batch, pg: &ProcessGroup) -> Result<Tensor> {
        let loss = crate::loss_of_embedded_batch(self, batch, pg);
        self.views = None;
        loss
    }

    fn embedding(&mut self) -> Option<&mut dyn EmbeddingObjective> {
        Some(self)
    }

    fn evaluate(&mut self, pg: &ProcessGroup) -> Result<Vec<(String, f64)>> {
        self.images.evaluate(pg)
    }

    fn expect_batch(&mut self, global_micro_batch: usize) -> Result<()> {
        self.queue.expect_batch(global_micro_batch)
    }

    /// The batch norms' running statistics, and the queue of past keys (`loss.queue`).
    fn buffers(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = self.images.buffers()?;
        self.queue.save_into(&mut out)?;
        Ok(out)
    }

    fn stream_state(&self) -> Result<Option<allgrad_data::webdataset::StreamState>> {
        self.images.stream_state()
    }

    fn resume_stream(&mut self, state: allgrad_data::webdataset::StreamState) -> Result<()> {
        self.images.resume_stream(state)
    }

    fn load_buffers(&mut self, buffers: &std::collections::HashMap<String, Tensor>) -> Result<()> {
        let rest = self.queue.load_from(buffers)?;
        self.images.load_buffers(&rest)
    }
}
