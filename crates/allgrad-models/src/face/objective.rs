//! The face method as an [`Objective`]: a backbone, the class-sharded head, the data, and
//! open-set verification as its evaluation.

use std::collections::HashMap;

use allgrad_dist::ProcessGroup;
use candle_core::{DType, Device, Result, Tensor};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use super::backbone::{Backbone, FaceModel, Pass};
use super::data::{FaceData, Source};
use super::head::{FaceHead, HeadConfig};
use super::shard::RowRange;
use super::verification::verify;
use crate::batch_norm::{load_running_buffers, running_buffers, Mode};
use crate::losses::l2_normalize;
use crate::{Batch, ModelError, Objective, SparseRows};

/// The name of the sharded centres parameter.
pub const CENTRES_PARAM: &str = "head.centres";

/// The `verify` section: which held-out images the verification uses.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct VerifyConfig {
    /// Held-out identities used (the first ones; 0: all).
    pub identities: usize,
    /// Images per identity used (the first ones of each).
    pub per_identity: usize,
}

impl Default for VerifyConfig {
    fn default() -> Self {
        VerifyConfig { identities: 0, per_identity: 4 }
    }
}

/// Face recognition: see [`crate::face`].
pub struct FaceObjective {
    model: FaceModel,
    head_cfg: HeadConfig,
    verify: VerifyConfig,
    source: Source,
    seed: u64,
    device: Device,
    dtype: DType,
    head: Option<FaceHead>,
    backbone: Option<Backbone>,
}

impl FaceObjective {
    /// Opens the data (parameters come with `bind` and `build`).
    pub fn new(
        data: &FaceData,
        model: FaceModel,
        head: HeadConfig,
        verify: VerifyConfig,
        seed: u64,
        device: Device,
        dtype: DType,
    ) -> Result<Self> {
        model.validate()?;
        head.validate()?;
        let source = Source::open(data, head.num_classes, seed)?;
        Ok(FaceObjective { model, head_cfg: head, verify, source, seed, device, dtype, head: None, backbone: None })
    }

    fn head(&mut self) -> Result<&mut FaceHead> {
        self.head.as_mut().ok_or_else(|| ModelError::NotBuilt { objective: "face (bind)" }.into())
    }

    fn backbone(&self) -> Result<&Backbone> {
        self.backbone.as_ref().ok_or_else(|| ModelError::NotBuilt { objective: "face" }.into())
    }

    /// The head (after `bind`).
    pub fn face_head(&self) -> Option<&FaceHead> {
        self.head.as_ref()
    }

    /// Verification figures of the held-out identities (images only; rank 0 computes, the
    /// others return nothing).
    pub fn verification(&self, pg: &ProcessGroup) -> Result<Vec<(String, f64)>> {
        let Some(test) = self.source.test() else { return Ok(Vec::new()) };
        if pg.rank() != 0 {
            return Ok(Vec::new());
        }
        // The first `per_identity` images of each of the first `identities` identities.
        let mut count: HashMap<usize, usize> = HashMap::new();
        let mut chosen = Vec::new();
        let limit = if self.verify.identities == 0 { usize::MAX } else { self.verify.identities };
        for i in 0..test.len() {
            let l = test.label(i).map_err(ModelError::Data)?;
            let seen = count.len();
            let c = count.entry(l).or_insert(0);
            if (*c > 0 || seen < limit) && *c < self.verify.per_identity {
                *c += 1;
                chosen.push(i);
            }
        }
        let backbone = self.backbone()?;
        let mut emb = Vec::with_capacity(chosen.len());
        let mut labels = Vec::with_capacity(chosen.len());
        for part in chosen.chunks(256) {
            let Some((x, ls)) = self.source.test_batch(part, &self.device, self.dtype)? else { return Ok(Vec::new()) };
            let pass = Pass { mode: Mode { train: false, pg }, seed: self.seed, step: 0, indices: part };
            let e = l2_normalize(&backbone.forward(&x, pass)?)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
            emb.extend(e);
            labels.extend(ls);
        }
        let v = verify(&emb, &labels, self.seed);
        Ok(vec![("verify_acc".into(), v.accuracy), ("tpr_at_far_1e-3".into(), v.tpr_at_far_1e3)])
    }
}

impl Objective for FaceObjective {
    fn bind(&mut self, pg: &ProcessGroup) -> Result<()> {
        let dim = self.model.embedding();
        self.head = Some(FaceHead::new(self.head_cfg.clone(), dim, self.seed, pg.rank(), pg.world_size())?);
        Ok(())
    }

    fn build(&mut self, vb: VarBuilder) -> Result<()> {
        self.backbone = Some(Backbone::new(&self.model, self.source.in_dim(), vb.pp("backbone"))?);
        self.head()?.build(vb.pp("head"))
    }

    fn num_samples(&self) -> usize {
        self.source.len()
    }

    fn loss(&mut self, batch: &Batch, pg: &ProcessGroup) -> Result<Tensor> {
        let (x, labels) = self.source.batch(batch.indices, batch.seed, batch.epoch, &self.device, self.dtype)?;
        let classes = self.head_cfg.num_classes;
        if let Some((i, l)) = batch.indices.iter().zip(&labels).find(|(_, l)| **l >= classes) {
            return Err(ModelError::HeadInput(format!(
                "training sample {i} has label {l}, not below head.num_classes = {classes}: raise head.num_classes to the \
                 data's identity count"
            ))
            .into());
        }
        let pass = Pass { mode: Mode { train: true, pg }, seed: batch.seed, step: batch.step, indices: batch.indices };
        let emb = self.backbone()?.forward(&x, pass)?;
        self.head()?.loss(&emb, &labels, batch.seed, batch.step, pg)
    }

    fn is_sharded(&self, name: &str) -> bool {
        name == CENTRES_PARAM
    }

    fn shard_rows(&self, name: &str) -> Option<RowRange> {
        (name == CENTRES_PARAM).then(|| self.head.as_ref().map(|h| h.range())).flatten()
    }

    fn updated_rows(&self, name: &str, step: usize) -> Option<Vec<bool>> {
        if name != CENTRES_PARAM {
            return None;
        }
        self.head.as_ref().and_then(|h| h.updated_rows(step))
    }

    fn rows_to_read(&mut self, name: &str, batch: &Batch, pg: &ProcessGroup) -> Result<Option<Vec<u32>>> {
        if name != CENTRES_PARAM {
            return Ok(None);
        }
        let labels = self.source.labels(batch.indices)?;
        self.head()?.rows_to_read(&labels, batch.seed, batch.step, pg)
    }

    fn sparse_rows(&self, name: &str) -> Option<SparseRows> {
        if name != CENTRES_PARAM {
            return None;
        }
        self.head.as_ref().and_then(|h| h.sparse_rows())
    }

    fn has_sparse_rows(&self, name: &str) -> bool {
        name == CENTRES_PARAM && self.head.as_ref().is_some_and(|h| h.reads_rows())
    }

    fn evaluate(&mut self, pg: &ProcessGroup) -> Result<Vec<(String, f64)>> {
        self.verification(pg)
    }

    fn buffers(&self) -> Result<Vec<(String, Tensor)>> {
        running_buffers(&self.backbone()?.batch_norms())
    }

    fn load_buffers(&mut self, buffers: &HashMap<String, Tensor>) -> Result<()> {
        load_running_buffers(&self.backbone()?.batch_norms(), buffers)
    }
}
