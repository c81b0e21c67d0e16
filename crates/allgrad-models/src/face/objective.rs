//! The face method as an [`Objective`]: a backbone, the class-sharded head, the data, and
//! open-set verification as its evaluation.

use std::collections::HashMap;
use std::path::PathBuf;

use allgrad_dist::ProcessGroup;
use candle_core::{DType, Device, Result, Tensor};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use super::backbone::{Backbone, FaceModel, Pass};
use super::data::{FaceData, Source};
use super::head::{FaceHead, HeadConfig};
use super::shard::RowRange;
use super::verification::{flip_sum_normalised, insightface_accuracy, verify};
use crate::batch_norm::{load_running_buffers, running_buffers, Mode};
use crate::losses::l2_normalize;
use crate::{Batch, ModelError, Objective, SparseRows};
use allgrad_data::{ColorMode, VerificationBin, ViewKey};

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

/// One embedding per image, in file order.
pub type Embeddings = Vec<Vec<f32>>;

/// The `eval` section: the benchmarks' verification `.bin` files, scored as insightface does
/// ([`super::verification::insightface_accuracy`]) at every evaluation.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EvalConfig {
    /// The `.bin` files (`lfw.bin`, `cfp_fp.bin`, ...); each gives the metrics `<stem>_acc`
    /// and `<stem>_std`.
    pub verification: Vec<PathBuf>,
    /// Images per forward pass (each rank embeds its share of a file's images in such batches).
    pub batch: usize,
}

impl Default for EvalConfig {
    fn default() -> Self {
        EvalConfig { verification: Vec::new(), batch: 64 }
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
    bins: Vec<VerificationBin>,
    eval_batch: usize,
    color: ColorMode,
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
        Self::with_eval(data, model, head, verify, EvalConfig::default(), seed, device, dtype)
    }

    /// As [`FaceObjective::new`], with the `.bin` files of `eval` read (and checked) now.
    #[allow(clippy::too_many_arguments)]
    pub fn with_eval(
        data: &FaceData,
        model: FaceModel,
        head: HeadConfig,
        verify: VerifyConfig,
        eval: EvalConfig,
        seed: u64,
        device: Device,
        dtype: DType,
    ) -> Result<Self> {
        model.validate()?;
        head.validate()?;
        if !eval.verification.is_empty() && matches!(data, FaceData::Synthetic(_)) {
            return Err(ModelError::HeadInput("eval.verification needs image data (data.kind images or recordio)".into()).into());
        }
        if eval.batch == 0 {
            return Err(ModelError::HeadInput("eval.batch must be positive".into()).into());
        }
        let bins = eval.verification.iter().map(VerificationBin::open).collect::<std::result::Result<Vec<_>, _>>();
        let bins = bins.map_err(ModelError::Data)?;
        let source = Source::open(data, head.num_classes, seed)?;
        Ok(FaceObjective {
            model,
            head_cfg: head,
            verify,
            source,
            seed,
            device,
            dtype,
            head: None,
            backbone: None,
            bins,
            eval_batch: eval.batch,
            color: data.color(),
        })
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

    /// The raw embeddings of `.bin` `b`'s images and of their mirror images, every image's in
    /// file order: each rank embeds a contiguous share and all ranks gather them.
    pub fn bin_embeddings(&self, b: usize, pg: &ProcessGroup) -> Result<(Embeddings, Embeddings)> {
        let bin = &self.bins[b];
        let eval = self.source.eval().ok_or(ModelError::NotBuilt { objective: "face (image data)" })?;
        let backbone = self.backbone()?;
        let (n, w, r) = (bin.num_images(), pg.world_size(), pg.rank());
        let (lo, hi) = (r * n / w, (r + 1) * n / w);
        let dim = self.model.embedding();
        let (mut plain, mut flipped) = (Vec::new(), Vec::new());
        let indices: Vec<usize> = (lo..hi).collect();
        for part in indices.chunks(self.eval_batch) {
            let (mut x, mut xf) = (Vec::new(), Vec::new());
            let mut shape = (0, 0, 0);
            for &i in part {
                let img = bin.image(i, self.color).map_err(ModelError::Data)?;
                let v = eval.apply(&img, ViewKey { seed: 0, epoch: 0, index: i as u64, view: 0 }).map_err(ModelError::Data)?;
                if shape != (0, 0, 0) && shape != v.shape() {
                    return Err(ModelError::HeadInput(format!(
                        "{}: image {i} is {:?} (C, H, W), image {} is {shape:?}: a .bin's images must share one size",
                        bin.path().display(),
                        v.shape(),
                        part[0]
                    ))
                    .into());
                }
                shape = v.shape();
                x.extend_from_slice(&v.data);
                // The mirror image: each row reversed.
                xf.extend(v.data.chunks(shape.2).flat_map(|row| row.iter().rev().copied()));
            }
            let pass = Pass { mode: Mode { train: false, pg }, seed: self.seed, step: 0, indices: part };
            for (data, out) in [(x, &mut plain), (xf, &mut flipped)] {
                let t = Tensor::from_vec(data, (part.len(), shape.0, shape.1, shape.2), &self.device)?.to_dtype(self.dtype)?;
                out.extend(backbone.forward(&t, pass)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
            }
        }
        let gather = |v: &[f32]| -> Result<Vec<Vec<f32>>> {
            let (all, _) = pg.all_gather_rows(v, v.len() / dim, &[dim]).map_err(candle_core::Error::wrap)?;
            Ok(all.chunks(dim).map(<[f32]>::to_vec).collect())
        };
        Ok((gather(&plain)?, gather(&flipped)?))
    }

    /// The `.bin` files' figures under insightface's protocol (every rank embeds its share;
    /// rank 0 returns them and logs insightface's line, `[lfw]Accuracy-Flip: 0.99500+-0.00300`).
    pub fn bin_verification(&self, pg: &ProcessGroup) -> Result<Vec<(String, f64)>> {
        let mut out = Vec::new();
        for (b, bin) in self.bins.iter().enumerate() {
            let (plain, flipped) = self.bin_embeddings(b, pg)?;
            if pg.rank() != 0 {
                continue;
            }
            let acc = insightface_accuracy(&flip_sum_normalised(&plain, &flipped), bin.issame(), 10);
            let name = bin.path().file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
            tracing::info!("[{name}]Accuracy-Flip: {:.5}+-{:.5}", acc.accuracy, acc.std);
            out.push((format!("{name}_acc"), acc.accuracy));
            out.push((format!("{name}_std"), acc.std));
        }
        Ok(out)
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
        let mut out = self.verification(pg)?;
        out.extend(self.bin_verification(pg)?);
        Ok(out)
    }

    fn buffers(&self) -> Result<Vec<(String, Tensor)>> {
        running_buffers(&self.backbone()?.batch_norms())
    }

    fn load_buffers(&mut self, buffers: &HashMap<String, Tensor>) -> Result<()> {
        load_running_buffers(&self.backbone()?.batch_norms(), buffers)
    }
}
