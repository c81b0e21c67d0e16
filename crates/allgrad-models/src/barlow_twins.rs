//! BarlowTwins on images: a ResNet encoder and a projector MLP (Linear-BN-ReLU-...-Linear,
//! SyncBatchNorm) trained to make the cross-correlation matrix of the two views' embeddings
//! the identity, over the GLOBAL batch.
//!
//! Each view goes through the network on its own (batch statistics per view). The loss
//! ([`cross_correlation`]) standardises each embedding dimension with global batch
//! statistics and sums `z1n^T z2n / N` over ranks, both through the differentiable
//! all_reduce: every rank computes the same loss, and its gradient reaches every rank's
//! samples as in one process. A W-rank run equals a one-rank run at the same global batch
//! (tested); the raw all_reduce of the cross-correlation, whose backward is the identity,
//! would make every gradient 1/W of the truth.

use allgrad_dist::ProcessGroup;
use candle_core::{DType, Device, Result, Tensor};
use candle_nn::VarBuilder;

use crate::batch_norm::Mode;
use crate::image_ssl::{ImageData, ImageModel, TwoViewImages};
use crate::losses::{cross_correlation, LossConfig};
use crate::{Batch, Objective};

/// The BarlowTwins objective; see the module docs.
pub struct BarlowTwins {
    images: TwoViewImages,
    lambda: f64,
    scale: f64,
}

impl BarlowTwins {
    /// Opens the data and prepares the augmentations (parameters come with `build`).
    /// `lambda` weighs the off-diagonal terms, `scale` multiplies the loss.
    pub fn new(data: &ImageData, model: ImageModel, lambda: f64, scale: f64, device: Device, dtype: DType) -> Result<Self> {
        LossConfig::CrossCorrelation { lambda, scale }
            .validate()
            .map_err(|e| candle_core::Error::Msg(format!("BarlowTwins: {e}")))?;
        Ok(BarlowTwins { images: TwoViewImages::new(data, model, device, dtype)?, lambda, scale })
    }
}

impl Objective for BarlowTwins {
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
        let z1 = self.images.embed(&v1, mode)?;
        let z2 = self.images.embed(&v2, mode)?;
        cross_correlation(&z1, &z2, self.lambda, pg)? * self.scale
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
