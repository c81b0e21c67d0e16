//! SimCLR on images: a ResNet encoder and a projection MLP trained with NT-Xent over the
//! global batch (each rank's anchors against every rank's candidates, through the
//! differentiable all_gather), with SyncBatchNorm and a kNN monitor on the frozen encoder.

use allgrad_dist::ProcessGroup;
use candle_core::{DType, Device, Result, Tensor};
use candle_nn::VarBuilder;

use crate::batch_norm::Mode;
use crate::image_ssl::{ImageData, ImageModel, TwoViewImages};
use crate::losses::nt_xent;
use crate::{Batch, Objective};

/// The SimCLR objective; see the module docs.
pub struct SimClr {
    images: TwoViewImages,
    temperature: f64,
}

impl SimClr {
    /// Opens the data and prepares the augmentations (parameters come with `build`).
    pub fn new(data: &ImageData, model: ImageModel, temperature: f64, device: Device, dtype: DType) -> Result<Self> {
        Ok(SimClr { images: TwoViewImages::new(data, model, device, dtype)?, temperature })
    }
}

impl Objective for SimClr {
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
        let b = batch.indices.len();
        let (v1, v2) = self.images.views(batch)?;
        // Both views in one batch: batch norm sees 2b samples, as in SimCLR.
        let z = self.images.embed(&Tensor::cat(&[&v1, &v2], 0)?, Mode { train: true, pg })?;
        nt_xent(&z.narrow(0, 0, b)?, &z.narrow(0, b, b)?, self.temperature, pg)
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
