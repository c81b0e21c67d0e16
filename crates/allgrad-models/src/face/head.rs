//! The class-sharded face-recognition head: cosine logits of the global batch against this
//! rank's class centres, a margin on the target class, the parallel softmax cross-entropy,
//! Partial FC sampling.

use allgrad_dist::{all_gather, ProcessGroup};
use candle_core::{DType, Result, Tensor, Var, D};
use candle_nn::{Init, VarBuilder};
use serde::{Deserialize, Serialize};

use super::margin::MarginConfig;
use super::normalize::unit_rows;
use super::sampling::sampled_rows;
use super::shard::{initial_centres, RowRange};
use super::softmax::{parallel_cross_entropy, parallel_margin_cross_entropy};
use crate::{ModelError, SparseRows};

/// The name of the centres parameter under the head's VarBuilder prefix.
pub const CENTRES: &str = "centres";

/// Elements of the centres drawn at a time when they are set up (8 MiB of f64).
const INIT_BLOCK_ELEMS: usize = 1 << 20;

fn default_rate() -> f64 {
    1.0
}
fn default_std() -> f64 {
    0.01
}

/// The `head` section.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct HeadConfig {
    /// Classes (identities) over all ranks.
    pub num_classes: usize,
    /// The margin on the target logit (default ArcFace, m 0.5, s 64).
    #[serde(default)]
    pub margin: MarginConfig,
    /// Partial FC: the rate at which negative classes are sampled each step (1: all classes).
    #[serde(default = "default_rate")]
    pub sample_rate: f64,
    /// Standard deviation of the initial centres (their direction is what counts).
    #[serde(default = "default_std")]
    pub init_std: f64,
    /// Partial FC: what the optimizer does to the centres a step did not sample.
    #[serde(default)]
    pub unsampled: Unsampled,
    /// With sampling (`sample_rate < 1`): how the centres' gradient is formed and applied.
    /// Without sampling every centre takes part and the gradient is dense either way.
    #[serde(default)]
    pub update: CentreUpdate,
    /// How the centres and their optimizer state are stored.
    #[serde(default)]
    pub storage: CentreStorage,
}

/// The `head.storage` key.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum CentreStorage {
    /// In the run's dtype (`dtype:`).
    #[default]
    Run,
    /// In bf16 (half the memory of f32), with f32 arithmetic: the step reads the centres it
    /// uses into f32, and the optimizer loads each centre and its state, updates them in f32
    /// and stores them back in bf16. Takes `head.update: sparse` (also without sampling); the
    /// trainer also requires `dtype: f32`, SGD or AdamW, and the CPU.
    Bf16,
}

/// The `head.unsampled` key: what happens to the centres a step did not sample.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Unsampled {
    /// They are updated as by a dense optimizer step with a zero gradient in their rows, as
    /// insightface's Partial FC v2 trains them: weight decay and momentum move them every step.
    #[default]
    Decay,
    /// They keep their value and optimizer state (momentum, Adam moments) bit for bit, as if
    /// they were not part of the model that step (Partial FC v1's rule).
    Frozen,
}

/// The `head.update` key: how the centres' gradient is formed when sampling.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum CentreUpdate {
    /// The backward yields the gradient of the sampled centres only, as row ids and rows
    /// ([`crate::Objective::sparse_rows`]); no tensor of all `[c_r, D]` centres' size is formed
    /// for it. The optimizer updates those rows and applies the steps the other rows missed
    /// when they are next sampled, or before a checkpoint or evaluation: the result equals the
    /// dense update.
    #[default]
    Sparse,
    /// The backward yields a dense `[c_r, D]` gradient (zero outside the sampled rows) and the
    /// optimizer passes over every centre each step. The reference the sparse update is tested
    /// against.
    Dense,
}

impl HeadConfig {
    /// `num_classes` classes and every other key at its default.
    pub fn with_classes(num_classes: usize) -> Self {
        HeadConfig {
            num_classes,
            margin: MarginConfig::default(),
            sample_rate: default_rate(),
            init_std: default_std(),
            unsampled: Unsampled::default(),
            update: CentreUpdate::default(),
            storage: CentreStorage::default(),
        }
    }

    /// Checks the values; the error names the key.
    pub fn validate(&self) -> std::result::Result<(), ModelError> {
        let bad = |key, value: f64, expected| ModelError::HeadValue { key, value, expected };
        if self.num_classes == 0 {
            return Err(bad("num_classes", 0.0, "positive"));
        }
        if !(self.sample_rate > 0.0 && self.sample_rate <= 1.0) {
            return Err(bad("sample_rate", self.sample_rate, "in (0, 1]"));
        }
        if !(self.init_std.is_finite() && self.init_std > 0.0) {
            return Err(bad("init_std", self.init_std, "a positive number"));
        }
        if self.storage == CentreStorage::Bf16 && self.update == CentreUpdate::Dense {
            return Err(ModelError::HeadKey {
                key: "storage",
                reason: "bf16 takes head.update: sparse (the centres are read into f32 rows and updated in f32)".into(),
            });
        }
        self.margin.margin().validate()
    }
}

/// The head on one rank: centres `[c_r, D]` of the classes in its [`RowRange`], created by
/// [`FaceHead::build`] and marked sharded by the objective. See the module docs of
/// [`crate::face`].
pub struct FaceHead {
    cfg: HeadConfig,
    dim: usize,
    seed: u64,
    range: RowRange,
    centres: Option<Tensor>,
    /// Rows sampled at some loss call of `updated.0` (the step).
    updated: (usize, Vec<bool>),
    /// The rows the last loss call read through a leaf of its own (the sparse update).
    sparse: Option<SparseRows>,
    /// The sampled rows of the last [`FaceHead::rows_to_read`]: its step, the global batch's
    /// labels and the rows.
    planned: Option<(usize, Vec<usize>, Vec<u32>)>,
}

impl FaceHead {
    /// A head of embedding width `dim` for rank `rank` of `world` (validated config; at least
    /// one class per rank).
    pub fn new(cfg: HeadConfig, dim: usize, seed: u64, rank: usize, world: usize) -> Result<Self> {
        cfg.validate()?;
        if cfg.num_classes < world || dim == 0 {
            return Err(ModelError::HeadInput(format!(
                "{} classes over {world} ranks with embedding width {dim}: every rank needs a class and the width must be positive",
                cfg.num_classes
            ))
            .into());
        }
        let range = RowRange::split(cfg.num_classes, rank, world);
        Ok(FaceHead { cfg, dim, seed, range, centres: None, updated: (usize::MAX, Vec::new()), sparse: None, planned: None })
    }

    /// The classes this rank holds.
    pub fn range(&self) -> RowRange {
        self.range
    }

    /// The configuration.
    pub fn config(&self) -> &HeadConfig {
        &self.cfg
    }

    /// Creates `centres` `[c_r, D]` through `vb` and fills it with the per-class
    /// initialisation ([`initial_centres`]): the values do not depend on W. The rows are
    /// drawn and written a block at a time, so setting up takes little more memory than the
    /// centres themselves.
    pub fn build(&mut self, vb: VarBuilder) -> Result<()> {
        let dtype = if self.cfg.storage == CentreStorage::Bf16 { DType::BF16 } else { vb.dtype() };
        let t = vb.get_with_hints_dtype((self.range.len, self.dim), CENTRES, Init::Const(0.0), dtype)?;
        let block = (INIT_BLOCK_ELEMS / self.dim.max(1)).max(1);
        for first in (0..self.range.len).step_by(block) {
            let rows =
                RowRange { start: self.range.start + first, len: block.min(self.range.len - first), total: self.range.total };
            let init = initial_centres(self.seed, rows, self.dim, self.cfg.init_std);
            let init = Tensor::from_vec(init, (rows.len, self.dim), t.device())?.to_dtype(t.dtype())?;
            // The variable's storage is written in place: the store's initial value is replaced.
            t.slice_set(&init, 0, first)?;
        }
        self.centres = Some(t);
        Ok(())
    }

    /// The centres (after `build`).
    pub fn centres(&self) -> Result<&Tensor> {
        self.centres.as_ref().ok_or_else(|| ModelError::NotBuilt { objective: "face head" }.into())
    }

    /// With sampling and `head.unsampled: frozen`, which local rows of the centres some loss
    /// call of `step` used: rows outside take no part in the step, and the optimizer must
    /// leave them, and their momentum, untouched. `None` otherwise (every row may change).
    pub fn updated_rows(&self, step: usize) -> Option<Vec<bool>> {
        (self.cfg.sample_rate < 1.0 && self.cfg.unsampled == Unsampled::Frozen).then(|| self.sampled_rows(step))
    }

    /// Which local rows of the centres some loss call of `step` used (all without sampling).
    pub fn sampled_rows(&self, step: usize) -> Vec<bool> {
        if self.cfg.sample_rate >= 1.0 {
            return vec![true; self.range.len];
        }
        if self.updated.0 == step {
            self.updated.1.clone()
        } else {
            vec![false; self.range.len]
        }
    }

    /// The rows the last loss call read through a leaf of their own, and that leaf (with
    /// sampling and `head.update: sparse`; `None` otherwise): see
    /// [`crate::Objective::sparse_rows`].
    pub fn sparse_rows(&self) -> Option<SparseRows> {
        self.sparse.clone()
    }

    /// The local rows of the centres that [`FaceHead::loss`] on `labels` (this rank's) at
    /// `step` will read: the sampled rows (with sampling and `head.update: sparse`), `None`
    /// otherwise. A collective (the global batch's labels are gathered): every rank calls it
    /// before the loss call it plans, which then reuses the sampled rows.
    pub fn rows_to_read(&mut self, labels: &[usize], seed: u64, step: usize, pg: &ProcessGroup) -> Result<Option<Vec<u32>>> {
        if !self.reads_rows() {
            return Ok(None);
        }
        self.check_labels(labels)?;
        let labels = Self::gather_labels(labels, pg)?;
        let rows = self.sample(&labels, seed, step);
        self.planned = Some((step, labels, rows.clone()));
        Ok(Some(rows))
    }

    /// Whether the loss reads the centres it uses through a leaf of their own (row-sparse
    /// gradients, [`FaceHead::sparse_rows`]): with `head.update: sparse` and sampling, or bf16
    /// storage.
    pub fn reads_rows(&self) -> bool {
        self.cfg.update == CentreUpdate::Sparse && (self.cfg.sample_rate < 1.0 || self.cfg.storage == CentreStorage::Bf16)
    }

    fn check_labels(&self, labels: &[usize]) -> Result<()> {
        if let Some(l) = labels.iter().find(|l| **l >= self.cfg.num_classes) {
            return Err(
                ModelError::HeadInput(format!("label {l} is not below head.num_classes = {}", self.cfg.num_classes)).into()
            );
        }
        Ok(())
    }

    /// The labels of the global batch, in rank order.
    fn gather_labels(labels: &[usize], pg: &ProcessGroup) -> Result<Vec<usize>> {
        let ids: Vec<i64> = labels.iter().map(|l| *l as i64).collect();
        let (ids, _) = pg.all_gather_rows(&ids, labels.len(), &[]).map_err(candle_core::Error::wrap)?;
        Ok(ids.into_iter().map(|l| l as usize).collect())
    }

    /// The loss of the global batch (the same on every rank): `emb` `[b, D]` this rank's
    /// embeddings (unnormalised), `labels` their global class ids, `step` keys the sampling.
    pub fn loss(&mut self, emb: &Tensor, labels: &[usize], seed: u64, step: usize, pg: &ProcessGroup) -> Result<Tensor> {
        // bf16 embeddings (autocast): the logits and the loss in f32.
        let emb = &allgrad_nn::autocast::full(emb)?;
        let (b, d) = emb.dims2()?;
        if d != self.dim || labels.len() != b {
            return Err(ModelError::HeadInput(format!(
                "embeddings {:?} with {} labels; the head takes [b, {}] with b labels",
                emb.dims(),
                labels.len(),
                self.dim
            ))
            .into());
        }
        self.check_labels(labels)?;
        let all = all_gather(&unit_rows(emb)?, pg)?;
        let labels = Self::gather_labels(labels, pg)?;
        let big_b = labels.len();
        let margin = self.cfg.margin.margin();

        let rows = match self.planned.take() {
            Some((s, l, rows)) if s == step && l == labels => rows,
            _ => self.sample(&labels, seed, step),
        };
        let centres = self.centres()?.clone();
        let sparse = self.reads_rows();
        self.sparse = sparse.then(|| SparseRows { rows: rows.clone(), leaf: None });
        let loss = if rows.is_empty() {
            // No class of this rank takes part: one column of −∞ (no mass, no gradient), a target
            // of 0, both on the graph so that this rank joins the collectives' backward.
            let z = (all.sum(D::Minus1)? - all.sum(D::Minus1)?)?;
            parallel_cross_entropy(&(z.unsqueeze(1)? + f64::NEG_INFINITY)?, &z, pg)?
        } else {
            let w = if sparse {
                // The sampled rows as a leaf of their own: the backward forms their gradient
                // only, never one of the centres' full size.
                let picked = centres.detach().index_select(&Tensor::new(rows.as_slice(), centres.device())?, 0)?;
                // In the embeddings' dtype (f32 rows of bf16 centres).
                let leaf = Var::from_tensor(&picked.to_dtype(emb.dtype())?)?.into_inner();
                self.sparse = Some(SparseRows { rows: rows.clone(), leaf: Some(leaf.clone()) });
                leaf
            } else if rows.len() == self.range.len {
                centres
            } else {
                centres.index_select(&Tensor::new(rows.as_slice(), centres.device())?, 0)?
            };
            let cos = all.matmul(&unit_rows(&w)?.t()?)?; // [B, s]
                                                         // Column of each sample's class among the sampled rows (u32::MAX: not here).
            let cols: Vec<u32> = labels
                .iter()
                .map(|l| self.range.local(*l).and_then(|r| rows.binary_search(&(r as u32)).ok()).map_or(u32::MAX, |c| c as u32))
                .collect();
            debug_assert_eq!(cols.len(), big_b);
            parallel_margin_cross_entropy(&cos, &cols, margin, pg)?
        };
        self.mark(step, &rows);
        Ok(loss)
    }

    fn sample(&self, labels: &[usize], seed: u64, step: usize) -> Vec<u32> {
        if self.cfg.sample_rate >= 1.0 {
            return (0..self.range.len as u32).collect();
        }
        sampled_rows(self.range, labels, seed, step as u64, self.cfg.sample_rate)
    }

    fn mark(&mut self, step: usize, rows: &[u32]) {
        if self.cfg.sample_rate >= 1.0 {
            return;
        }
        if self.updated.0 != step {
            self.updated = (step, vec![false; self.range.len]);
        }
        for r in rows {
            self.updated.1[*r as usize] = true;
        }
    }
}
