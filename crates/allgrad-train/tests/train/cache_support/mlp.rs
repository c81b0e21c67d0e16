//! Test objectives of the gradient-caching tests: a two-view MLP on keyed random vectors,
//! with keyed dropout (or, to show what the replay check catches, dropout that changes with
//! every call) or a SyncBatchNorm layer, and NT-Xent over the global batch.

use std::ops::Range;

use allgrad_dist::ProcessGroup;
use allgrad_models::batch_norm::{load_running_buffers, running_buffers, BatchNorm, Mode};
use allgrad_models::losses::nt_xent;
use allgrad_models::rng::{normals, stream, uniform};
use allgrad_models::{loss_of_embedded_batch, Batch, EmbeddingObjective, Objective};
use candle_core::{Device, IndexOp, Result, Tensor};
use candle_nn::{Linear, Module, VarBuilder};

const DIM: usize = 6;
const HIDDEN: usize = 12;
const OUT: usize = 5;
/// Samples of the data set.
pub const SAMPLES: usize = 120;

/// What sits between the two linear layers (after the ReLU for dropout, before it for
/// batch norm).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Middle {
    /// Dropout (p = 0.3), masks keyed by (seed, step, global sample index, view).
    KeyedDropout,
    /// Dropout whose masks also depend on how many times the network ran: not replayable.
    UnkeyedDropout,
    /// SyncBatchNorm over both views of the batch (or chunk) together.
    SyncBatchNorm,
}

/// The MLP `DIM -> HIDDEN -> OUT` on two noisy views of each sample.
pub struct TwoViewMlp {
    middle: Middle,
    /// `Some(n)`: the plain loss normalises per chunk of n samples ("ghost" batch norm), the
    /// reference of a cached step with batch norm.
    pub plain_chunk: Option<usize>,
    calls: u64,
    net: Option<(Linear, Option<BatchNorm>, Linear)>,
}

impl TwoViewMlp {
    pub fn new(middle: Middle) -> Self {
        TwoViewMlp { middle, plain_chunk: None, calls: 0, net: None }
    }

    /// Rows `[2n, DIM]`: views 0 and 1 of every sample, sample after sample.
    fn inputs(batch: &Batch, dtype: candle_core::DType) -> Result<Tensor> {
        let mut rows = Vec::new();
        for &i in batch.indices {
            // Each sample has its own centre, so data differ across ranks and chunks.
            let centre = normals(&mut stream(&[batch.seed, 0xCE, i as u64]), DIM);
            for view in 0..2u64 {
                let noise = normals(&mut stream(&[batch.seed, batch.epoch as u64, i as u64, view]), DIM);
                rows.extend(centre.iter().zip(&noise).map(|(c, n)| c + 0.4 * n));
            }
        }
        Tensor::from_vec(rows, (2 * batch.indices.len(), DIM), &Device::Cpu)?.to_dtype(dtype)
    }

    /// The dropout mask `[2n, HIDDEN]` of `batch`.
    fn mask(&self, batch: &Batch, dtype: candle_core::DType) -> Result<Tensor> {
        let p = 0.3;
        let mut mask = Vec::new();
        for &i in batch.indices {
            for view in 0..2u64 {
                let extra = if self.middle == Middle::UnkeyedDropout { self.calls } else { 0 };
                let mut rng = stream(&[batch.seed, batch.step as u64, i as u64, view, 0xD7, extra]);
                mask.extend((0..HIDDEN).map(|_| if uniform(&mut rng, 0.0, 1.0) < p { 0.0 } else { 1.0 / (1.0 - p) }));
            }
        }
        Tensor::from_vec(mask, (2 * batch.indices.len(), HIDDEN), &Device::Cpu)?.to_dtype(dtype)
    }
}

impl EmbeddingObjective for TwoViewMlp {
    fn embed(&mut self, batch: &Batch, rows: Range<usize>, pg: &ProcessGroup) -> Result<Tensor> {
        self.calls += 1;
        let part = batch.part(rows);
        let Some((l1, bn, l2)) = &self.net else { candle_core::bail!("used before build") };
        let x = Self::inputs(&part, l1.weight().dtype())?;
        let mut h = l1.forward(&x)?;
        if let Some(bn) = bn {
            h = bn.forward(&h, Mode { train: true, pg })?;
        }
        h = h.relu()?;
        if self.middle != Middle::SyncBatchNorm {
            h = (h * self.mask(&part, x.dtype())?)?;
        }
        l2.forward(&h)?.reshape((part.indices.len(), 2, OUT))
    }

    fn loss_of_embeddings(&mut self, z: &Tensor, _batch: &Batch, pg: &ProcessGroup) -> Result<Tensor> {
        nt_xent(&z.i((.., 0))?, &z.i((.., 1))?, 0.3, pg)
    }
}

impl Objective for TwoViewMlp {
    fn build(&mut self, vb: VarBuilder) -> Result<()> {
        let bn = (self.middle == Middle::SyncBatchNorm).then(|| BatchNorm::new(HIDDEN, true, vb.pp("bn"))).transpose()?;
        self.net = Some((candle_nn::linear(DIM, HIDDEN, vb.pp("l1"))?, bn, candle_nn::linear(HIDDEN, OUT, vb.pp("l2"))?));
        Ok(())
    }

    fn num_samples(&self) -> usize {
        SAMPLES
    }

    fn loss(&mut self, batch: &Batch, pg: &ProcessGroup) -> Result<Tensor> {
        let Some(n) = self.plain_chunk else { return loss_of_embedded_batch(self, batch, pg) };
        // Per-chunk batch statistics, every chunk with its graph.
        let b = batch.indices.len();
        let parts = (0..b).step_by(n).map(|s| self.embed(batch, s..(s + n).min(b), pg)).collect::<Result<Vec<_>>>()?;
        self.loss_of_embeddings(&Tensor::cat(&parts, 0)?, batch, pg)
    }

    fn embedding(&mut self) -> Option<&mut dyn EmbeddingObjective> {
        Some(self)
    }

    fn buffers(&self) -> Result<Vec<(String, Tensor)>> {
        match &self.net {
            Some((_, Some(bn), _)) => running_buffers(&[bn]),
            _ => Ok(Vec::new()),
        }
    }

    fn load_buffers(&mut self, buffers: &std::collections::HashMap<String, Tensor>) -> Result<()> {
        match &self.net {
            Some((_, Some(bn), _)) => load_running_buffers(&[bn], buffers),
            _ => Ok(()),
        }
    }
}

/// An objective with no embedding split (only `loss`).
pub struct LossOnly(pub TwoViewMlp);

impl Objective for LossOnly {
    fn build(&mut self, vb: VarBuilder) -> Result<()> {
        self.0.build(vb)
    }
    fn num_samples(&self) -> usize {
        SAMPLES
    }
    fn loss(&mut self, batch: &Batch, pg: &ProcessGroup) -> Result<Tensor> {
        self.0.loss(batch, pg)
    }
}
