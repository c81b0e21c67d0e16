//! The CLIP / SigLIP objective: two towers embed each rank's pairs, one loss over the global
//! batch trains them; evaluation by zero-shot classification and retrieval.

use std::ops::Range;
use std::sync::Arc;

use allgrad_data::{IdxDataset, Split};
use allgrad_dist::ProcessGroup;
use candle_core::{Device, IndexOp, Result, Tensor};
use candle_nn::VarBuilder;

use super::data::{ClassCaptions, CsvPairs, PairSource, Pixels};
use super::eval::{open_test_set, ClipEvaluation};
use super::folder::{ClipFolder, ClipTokenizer, ClipWeights};
use super::loss::{clip_loss, clip_loss_tiled, siglip_loss};
use super::model::ClipModel;
use super::ring::{clip_loss_ring, siglip_loss_ring, RingOptions};
use super::settings::{ClipData, ClipEval, ClipLoss, ClipModelSection, LossKind};
use crate::tiled::Tiling;
use crate::{Batch, EmbeddingObjective, Objective};

/// OpenAI CLIP's per-channel mean and standard deviation of RGB inputs.
pub const OPENAI_MEAN: [f32; 3] = [0.481_454_66, 0.457_827_5, 0.408_210_73];
/// See [`OPENAI_MEAN`].
pub const OPENAI_STD: [f32; 3] = [0.268_629_54, 0.261_302_6, 0.275_777_1];

/// CLIP or SigLIP (`loss.kind`) on image-caption pairs. Parameters: `transformers`' `CLIPModel`
/// names, and `logit_bias` with SigLIP.
pub struct Clip {
    folder: ClipFolder,
    weights: Option<ClipWeights>,
    tokenizer: ClipTokenizer,
    source: Arc<dyn PairSource>,
    /// Every pair's caption as token ids.
    tokens: Vec<Vec<u32>>,
    pixels: Pixels,
    loss: ClipLoss,
    /// `loss.tile`, checked.
    tiling: Tiling,
    net: Option<(ClipModel, Option<Tensor>)>,
    device: Device,
    eval: Option<ClipEvaluation>,
}

fn tokenize(tokenizer: &ClipTokenizer, texts: impl Iterator<Item = Result<String>>) -> Result<Vec<Vec<u32>>> {
    texts.map(|t| tokenizer.encode(&t?)).collect()
}

impl Clip {
    /// Reads the model folder and the pairs, tokenizes every caption (parameters come with
    /// `build`). `seed` picks each class-captioned sample's template and name.
    pub fn new(model: &ClipModelSection, loss: ClipLoss, data: &ClipData, seed: u64, device: Device) -> Result<Self> {
        let folder = ClipFolder::open(&model.dir)?;
        let max_len = model.max_len.unwrap_or(folder.config.text_config.max_position_embeddings);
        let tokenizer = folder.tokenizer(max_len)?;
        let weights = if model.pretrained { Some(folder.weights()?) } else { None };
        let tiling = loss.tiling()?;
        let source: Arc<dyn PairSource> = match (&data.csv, &data.images) {
            (Some(csv), None) => Arc::new(CsvPairs::open(csv)?),
            (None, Some(dir)) => {
                let images =
                    Arc::new(IdxDataset::open_dir(dir, Split::Train).map_err(|e| candle_core::Error::Msg(e.to_string()))?);
                Arc::new(ClassCaptions::new(images, data.classes.clone(), data.templates.clone(), seed, data.limit)?)
            }
            _ => candle_core::bail!("clip: data needs exactly one of `csv` and `images`"),
        };
        let n = source.len().min(data.limit.unwrap_or(usize::MAX));
        let tokens = tokenize(&tokenizer, (0..n).map(|i| source.caption(i)))?;
        let v = &folder.config.vision_config;
        let (mean, std) = match v.num_channels {
            3 => (OPENAI_MEAN.to_vec(), OPENAI_STD.to_vec()),
            c => (vec![0.5; c], vec![0.5; c]),
        };
        let pixels = Pixels {
            channels: v.num_channels,
            size: v.image_size,
            mean: model.mean.clone().unwrap_or(mean),
            std: model.std.clone().unwrap_or(std),
        };
        if pixels.mean.len() != v.num_channels
            || pixels.std.len() != v.num_channels
            || pixels.std.iter().any(|s| !(s.is_finite() && *s > 0.0))
        {
            candle_core::bail!("clip: model.mean and model.std need {} entries each, std positive", v.num_channels);
        }
        Ok(Clip { folder, weights, tokenizer, source, tokens, pixels, loss, tiling, net: None, device, eval: None })
    }

    /// Evaluates zero-shot classification and retrieval (before training and after every
    /// epoch) on the test split of `data.images` or the image folder `eval.images`, each rank
    /// embedding its share ([`ClipEvaluation`]).
    pub fn with_evaluation(mut self, data: &ClipData, cfg: &ClipEval) -> Result<Self> {
        let (images, classes) = open_test_set(data, cfg)?;
        let dim = self.folder.config.projection_dim;
        self.eval = Some(ClipEvaluation::new(images, classes, cfg, &self.tokenizer, dim)?);
        Ok(self)
    }

    /// The model (after `build`).
    pub fn model(&self) -> Result<&ClipModel> {
        self.net.as_ref().map(|(m, _)| m).ok_or_else(|| candle_core::Error::Msg("clip used before build".into()))
    }

    /// The images of pairs `indices` as `[n, c, s, s]` f32.
    fn images(&self, source: &dyn PairSource, indices: &[usize]) -> Result<Tensor> {
        let p = &self.pixels;
        let mut all = Vec::with_capacity(indices.len() * p.channels * p.size * p.size);
        for &i in indices {
            all.extend(p.chw(&source.image(i)?)?);
        }
        Tensor::from_vec(all, (indices.len(), p.channels, p.size, p.size), &self.device)
    }

    fn embed_images(&self, source: &dyn PairSource, indices: &[usize]) -> Result<Tensor> {
        self.model()?.vision.forward(&self.images(source, indices)?)
    }

    fn embed_texts(&self, ids: &[Vec<u32>]) -> Result<Tensor> {
        self.model()?.text.forward(ids, self.tokenizer.pad_id(), &self.device)
    }
}

impl Objective for Clip {
    fn build(&mut self, vb: VarBuilder) -> Result<()> {
        let mut cfg = self.folder.config.clone();
        let siglip = matches!(self.loss.kind, LossKind::SiglipGather | LossKind::SiglipRing);
        if siglip {
            // SigLIP's own initial scale (a checkpoint's value wins when pretrained).
            cfg.logit_scale_init_value = self.loss.siglip_scale_init;
        }
        // A sigmoid loss learns a logit bias (SigLIP's model has its own; a checkpoint's wins).
        let bias_init = siglip.then_some(self.loss.siglip_bias_init);
        let model = match &self.weights {
            Some(w) => w.init_model(&cfg, bias_init, vb.clone())?,
            None => ClipModel::with_bias(&vb, &cfg, bias_init)?,
        };
        let bias = if siglip { model.logit_bias.clone() } else { None };
        self.net = Some((model, bias));
        Ok(())
    }

    fn num_samples(&self) -> usize {
        self.tokens.len()
    }

    /// `logit_scale` in `[0, ln 100]` after every step, as OpenCLIP clamps it (for SigLIP's
    /// loss on these towers too: OpenCLIP's training loop clamps every model's scale).
    fn clamp_after_step(&self, name: &str) -> Option<(f64, f64)> {
        (name == "logit_scale").then(|| (0.0, super::loss::MAX_LOGIT_SCALE.ln()))
    }

    fn loss(&mut self, batch: &Batch, pg: &ProcessGroup) -> Result<Tensor> {
        crate::loss_of_embedded_batch(self, batch, pg)
    }

    fn embedding(&mut self) -> Option<&mut dyn EmbeddingObjective> {
        Some(self)
    }

    fn evaluate(&mut self, pg: &ProcessGroup) -> Result<Vec<(String, f64)>> {
        let Some(ev) = &self.eval else { return Ok(Vec::new()) };
        ev.run(self.model()?, &self.pixels, self.tokenizer.pad_id(), pg, &self.device)
    }
}

/// Embeddings `[n, 2, d]`: each pair's image (0) and caption (1), projected, not normalised.
impl EmbeddingObjective for Clip {
    fn embed(&mut self, batch: &Batch, rows: Range<usize>, _pg: &ProcessGroup) -> Result<Tensor> {
        let part = batch.part(rows);
        let ids =
            part.indices
                .iter()
                .map(|&i| {
                    self.tokens.get(i).cloned().ok_or_else(|| {
                        candle_core::Error::Msg(format!("clip: pair {i} out of range ({} pairs)", self.tokens.len()))
                    })
                })
                .collect::<Result<Vec<_>>>()?;
        let img = self.embed_images(self.source.as_ref(), part.indices)?;
        let txt = self.embed_texts(&ids)?;
        Tensor::stack(&[&img, &txt], 1)
    }

    fn loss_of_embeddings(&mut self, z: &Tensor, _batch: &Batch, pg: &ProcessGroup) -> Result<Tensor> {
        let z = &allgrad_nn::autocast::full(z)?;
        let (img, txt) = (z.i((.., 0))?, z.i((.., 1))?);
        let (model, bias) = self.net.as_ref().ok_or_else(|| candle_core::Error::Msg("clip used before build".into()))?;
        let s = &model.logit_scale;
        match (self.loss.kind, self.tiling.tile(), bias) {
            (LossKind::Clip, None, _) => clip_loss(&img, &txt, s, pg),
            (LossKind::Clip, Some(tile), _) => clip_loss_tiled(&img, &txt, s, tile, pg),
            (LossKind::SiglipGather, _, Some(b)) => siglip_loss(&img, &txt, s, b, pg),
            (LossKind::ClipRing, tile, _) => clip_loss_ring(&img, &txt, s, RingOptions { tile, ..Default::default() }, pg),
            (LossKind::SiglipRing, tile, Some(b)) => {
                siglip_loss_ring(&img, &txt, s, b, RingOptions { tile, ..Default::default() }, pg)
            }
            _ => candle_core::bail!("clip: SigLIP without its logit bias (built for another loss)"),
        }
    }
}
