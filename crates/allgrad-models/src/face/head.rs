//! The class-sharded face-recognition head: cosine logits of the global batch against this
//! rank's class centres, a margin on the target class, the parallel softmax cross-entropy,
//! Partial FC sampling.

use allgrad_dist::{all_gather, ProcessGroup};
use candle_core::{Result, Tensor, D};
use candle_nn::{Init, VarBuilder};
use serde::{Deserialize, Serialize};

use super::margin::MarginConfig;
use super::sampling::sampled_rows;
use super::shard::{initial_centres, RowRange};
use super::softmax::parallel_cross_entropy;
use crate::losses::l2_normalize;
use crate::ModelError;

/// The name of the centres parameter under the head's VarBuilder prefix.
pub const CENTRES: &str = "centres";

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
}

impl HeadConfig {
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
        Ok(FaceHead { cfg, dim, seed, range, centres: None, updated: (usize::MAX, Vec::new()) })
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
    /// initialisation ([`initial_centres`]): the values do not depend on W.
    pub fn build(&mut self, vb: VarBuilder) -> Result<()> {
        let t = vb.get_with_hints((self.range.len, self.dim), CENTRES, Init::Const(0.0))?;
        let init = initial_centres(self.seed, self.range, self.dim, self.cfg.init_std);
        let init = Tensor::from_vec(init, (self.range.len, self.dim), t.device())?.to_dtype(t.dtype())?;
        // The variable's storage is written in place: the store's initial value is replaced.
        t.slice_set(&init, 0, 0)?;
        self.centres = Some(t);
        Ok(())
    }

    /// The centres (after `build`).
    pub fn centres(&self) -> Result<&Tensor> {
        self.centres.as_ref().ok_or_else(|| ModelError::NotBuilt { objective: "face head" }.into())
    }

    /// Which local rows of the centres some loss call of `step` used (None: all, sampling
    /// off). Rows outside take no part in the step: the optimizer must leave them, and their
    /// momentum, untouched.
    pub fn updated_rows(&self, step: usize) -> Option<Vec<bool>> {
        (self.cfg.sample_rate < 1.0).then(|| {
            if self.updated.0 == step {
                self.updated.1.clone()
            } else {
                vec![false; self.range.len]
            }
        })
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
        if let Some(l) = labels.iter().find(|l| **l >= self.cfg.num_classes) {
            return Err(
                ModelError::HeadInput(format!("label {l} is not below head.num_classes = {}", self.cfg.num_classes)).into()
            );
        }
        let all = all_gather(&l2_normalize(emb)?, pg)?;
        let ids: Vec<i64> = labels.iter().map(|l| *l as i64).collect();
        let (ids, _) = pg.all_gather_rows(&ids, b, &[]).map_err(candle_core::Error::wrap)?;
        let labels: Vec<usize> = ids.into_iter().map(|l| l as usize).collect();
        let big_b = labels.len();
        let margin = self.cfg.margin.margin();

        let rows = self.sample(&labels, seed, step);
        let centres = self.centres()?.clone();
        let zero = |t: &Tensor| -> Result<Tensor> { t.sum(D::Minus1)? - t.sum(D::Minus1)? };
        let (logits, target) = if rows.is_empty() {
            // No class of this rank takes part: one column of −∞ (no mass, no gradient), a target
            // of 0, both on the graph so that this rank joins the collectives' backward.
            let z = zero(&all)?;
            ((z.unsqueeze(1)? + f64::NEG_INFINITY)?, z)
        } else {
            let w = if rows.len() == self.range.len {
                centres
            } else {
                centres.index_select(&Tensor::new(rows.as_slice(), centres.device())?, 0)?
            };
            let cos = all.matmul(&l2_normalize(&w)?.t()?)?; // [B, s]
                                                            // Column of each sample's class among the sampled rows (u32::MAX: not here).
            let cols: Vec<u32> = labels
                .iter()
                .map(|l| self.range.local(*l).and_then(|r| rows.binary_search(&(r as u32)).ok()).map_or(u32::MAX, |c| c as u32))
                .collect();
            let has: Vec<f64> = cols.iter().map(|c| f64::from(u8::from(*c != u32::MAX))).collect();
            let dev = cos.device();
            let cols_t = Tensor::from_vec(cols.clone(), (big_b, 1), dev)?;
            let safe =
                Tensor::from_vec(cols.iter().map(|c| if *c == u32::MAX { 0 } else { *c }).collect::<Vec<_>>(), (big_b, 1), dev)?;
            let has = Tensor::from_vec(has, big_b, dev)?.to_dtype(cos.dtype())?;
            let t = cos.gather(&safe, 1)?.squeeze(1)?;
            let target = ((margin.apply(&t)? * margin.s)? * has)?; // [B]
            let onehot = cols_t.broadcast_eq(&Tensor::arange(0u32, rows.len() as u32, dev)?.unsqueeze(0)?)?;
            let logits = onehot.where_cond(&target.unsqueeze(1)?.broadcast_as(cos.shape())?, &(cos * margin.s)?)?;
            (logits, target)
        };
        self.mark(step, &rows);
        parallel_cross_entropy(&logits, &target, pg)
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
