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
use candle_core::{DType, Device, Result, Tensor};
use candle_nn::VarBuilder;

use super::data::ImageData;
use super::projector::ImageModel;
use super::two_view::TwoViewImages;
use crate::batch_norm::Mode;
use crate::losses::LossConfig;
use crate::{Batch, Objective};

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
    batch: ViewBatch,
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
        Ok(TwoViewMethod { images: TwoViewImages::new(data, model, device, dtype)?, loss, batch })
    }

    /// SimCLR: NT-Xent at `temperature`, both views in one batch.
    pub fn simclr(data: &ImageData, model: ImageModel, temperature: f64, device: Device, dtype: DType) -> Result<Self> {
        Self::new(data, model, LossConfig::NtXent { temperature }, ViewBatch::Joint, device, dtype)
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
        Self::new(data, model, LossConfig::CrossCorrelation { lambda, scale }, ViewBatch::PerView, device, dtype)
    }

    /// The data, views and network.
    pub fn images(&self) -> &TwoViewImages {
        &self.images
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

    fn loss(&mut self, batch: &Batch, pg: &ProcessGroup) -> Result<Tensor> {
        let (v1, v2) = self.images.views(batch)?;
        let mode = Mode { train: true, pg };
        let (z1, z2) = match self.batch {
            ViewBatch::Joint => {
                let b = batch.indices.len();
                let z = self.images.embed(&Tensor::cat(&[&v1, &v2], 0)?, mode)?;
                (z.narrow(0, 0, b)?, z.narrow(0, b, b)?)
            }
            ViewBatch::PerView => (self.images.embed(&v1, mode)?, self.images.embed(&v2, mode)?),
        };
        self.loss.compute(&z1, &z2, pg)
    }

    fn evaluate(&mut self, pg: &ProcessGroup) -> Result<Vec<(String, f64)>> {
        self.images.evaluate(pg)
    }

    fn buffers(&self) -> Result<Vec<(String, Tensor)>> {
        self.images.buffers()
    }

    fn load_buffers(&mut self, buffers: &std::collections::HashMap<String, Tensor>) -> Result<()> {
        self.images.load_buffers(buffers)
    }
}
