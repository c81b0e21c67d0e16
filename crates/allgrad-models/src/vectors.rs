//! A small built-in method: an MLP trained contrastively on seeded synthetic vectors.
//!
//! The data are `samples` vectors in `dim` dimensions drawn around `clusters` random centres;
//! each step sees two noisy views of every sample, keyed by (seed, epoch, sample, view). It
//! trains in seconds, which makes it the objective of smoke runs, examples and the trainer's
//! W-ranks-equal-1-rank tests.

use allgrad_dist::ProcessGroup;
use candle_core::{DType, Device, IndexOp, Result, Tensor};
use candle_nn::{Linear, VarBuilder};
use serde::{Deserialize, Serialize};

use crate::error::fail;
use crate::losses::LossConfig;
use crate::objective::QueueBuffer;
use crate::rng::{normals, stream};
use crate::{Batch, EmbeddingObjective, ModelError, Objective};

/// The synthetic data set.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct VectorData {
    /// Number of training vectors.
    pub samples: usize,
    /// Dimension of each vector.
    pub dim: usize,
    /// Number of cluster centres.
    pub clusters: usize,
    /// Standard deviation of the noise that makes the two views of a sample.
    pub view_noise: f64,
}

impl Default for VectorData {
    fn default() -> Self {
        VectorData { samples: 1024, dim: 32, clusters: 8, view_noise: 0.3 }
    }
}

/// The MLP encoder `dim -> hidden -> out`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct VectorModel {
    /// Hidden width.
    pub hidden: usize,
    /// Embedding dimension.
    pub out: usize,
}

impl Default for VectorModel {
    fn default() -> Self {
        VectorModel { hidden: 64, out: 16 }
    }
}

/// The objective; see the module docs.
pub struct VectorContrastive {
    data: VectorData,
    model: VectorModel,
    loss: LossConfig,
    /// The keys of past batches (`loss.queue`): both views' of a global micro-batch.
    queue: QueueBuffer,
    centres: Vec<f64>,
    layers: Option<(Linear, Linear)>,
    device: Device,
    dtype: DType,
}

impl VectorContrastive {
    /// A new objective; `seed` fixes the data set.
    pub fn new(data: VectorData, model: VectorModel, loss: LossConfig, seed: u64, device: Device, dtype: DType) -> Result<Self> {
        if data.samples == 0 || data.dim == 0 || data.clusters == 0 || model.hidden == 0 || model.out == 0 {
            let (samples, dim, clusters, hidden, out) = (data.samples, data.dim, data.clusters, model.hidden, model.out);
            return fail(ModelError::VectorSizes { samples, dim, clusters, hidden, out });
        }
        let centres = normals(&mut stream(&[seed, 0xC3A7]), data.clusters * data.dim).into_iter().map(|v| 2.0 * v).collect();
        let queue = QueueBuffer::new(loss.new_queue()?, 2, "vectors");
        Ok(VectorContrastive { data, model, loss, queue, centres, layers: None, device, dtype })
    }

    /// View `view` of sample `index` at `epoch`.
    fn view(&self, seed: u64, epoch: usize, index: usize, view: u64) -> Vec<f64> {
        let d = self.data.dim;
        let c = index % self.data.clusters;
        let own = normals(&mut stream(&[seed, 0x5A, index as u64]), d);
        let noise = normals(&mut stream(&[seed, epoch as u64, index as u64, view]), d);
        (0..d).map(|k| self.centres[c * d + k] + 0.5 * own[k] + self.data.view_noise * noise[k]).collect()
    }

    fn views(&self, batch: &Batch, view: u64) -> Result<Tensor> {
        let rows: Vec<f64> = batch.indices.iter().flat_map(|&i| self.view(batch.seed, batch.epoch, i, view)).collect();
        Tensor::from_vec(rows, (batch.indices.len(), self.data.dim), &self.device)?.to_dtype(self.dtype)
    }

    fn encode(&self, x: &Tensor) -> Result<Tensor> {
        let (l1, l2) = self.layers.as_ref().ok_or(ModelError::NotBuilt { objective: "vectors" })?;
        let dense = allgrad_nn::linear_module;
        dense(l2, &dense(l1, x)?.relu()?)
    }
}

/// Embeddings `[n, 2, out]`: both views of each sample.
impl EmbeddingObjective for VectorContrastive {
    fn embed(&mut self, batch: &Batch, rows: std::ops::Range<usize>, _pg: &ProcessGroup) -> Result<Tensor> {
        let part = batch.part(rows);
        let z1 = self.encode(&self.views(&part, 1)?)?;
        let z2 = self.encode(&self.views(&part, 2)?)?;
        Tensor::stack(&[z1, z2], 1)
    }

    fn loss_of_embeddings(&mut self, z: &Tensor, _batch: &Batch, pg: &ProcessGroup) -> Result<Tensor> {
        self.loss.compute_queued(&z.i((.., 0))?, &z.i((.., 1))?, self.queue.queue(), pg)
    }
}

impl Objective for VectorContrastive {
    fn build(&mut self, vb: VarBuilder) -> Result<()> {
        let l1 = candle_nn::linear(self.data.dim, self.model.hidden, vb.pp("encoder.0"))?;
        let l2 = candle_nn::linear(self.model.hidden, self.model.out, vb.pp("encoder.1"))?;
        self.layers = Some((l1, l2));
        Ok(())
    }

    fn num_samples(&self) -> usize {
        self.data.samples
    }

    fn loss(&mut self, batch: &Batch, pg: &ProcessGroup) -> Result<Tensor> {
        crate::loss_of_embedded_batch(self, batch, pg)
    }

    fn embedding(&mut self) -> Option<&mut dyn EmbeddingObjective> {
        Some(self)
    }

    fn expect_batch(&mut self, global_micro_batch: usize) -> Result<()> {
        self.queue.expect_batch(global_micro_batch)
    }

    /// The queue of past keys (`loss.queue`), when it holds any.
    fn buffers(&self) -> Result<Vec<(String, Tensor)>> {
        self.queue.buffers()
    }

    fn load_buffers(&mut self, buffers: &std::collections::HashMap<String, Tensor>) -> Result<()> {
        self.queue.load_buffers(buffers)
    }

    fn evaluate(&mut self, _pg: &ProcessGroup) -> Result<Vec<(String, f64)>> {
        // Top-1 retrieval of the positive among 256 fixed samples' second views.
        let n = self.data.samples.min(256);
        let idx: Vec<usize> = (0..n).collect();
        let b = Batch { indices: &idx, epoch: usize::MAX, step: 0, seed: 0xE7A1 };
        let z1 = crate::losses::l2_normalize(&self.encode(&self.views(&b, 1)?)?)?;
        let z2 = crate::losses::l2_normalize(&self.encode(&self.views(&b, 2)?)?)?;
        let best = z1.matmul(&z2.t()?)?.argmax(1)?.to_vec1::<u32>()?;
        let hits = best.iter().enumerate().filter(|(i, j)| *i == **j as usize).count();
        Ok(vec![("retrieval_top1".into(), hits as f64 / n as f64)])
    }
}
