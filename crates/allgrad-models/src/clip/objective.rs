//! The CLIP / SigLIP objective: two towers embed each rank's pairs, one loss over the global
//! batch trains them. The pairs come from [`PairData`] (decoded, preprocessed and tokenized on
//! the loader's threads), evaluation from [`ClipEvaluation`].

use std::ops::Range;

use allgrad_dist::ProcessGroup;
use candle_core::{Device, IndexOp, Result, Tensor};
use candle_nn::VarBuilder;

use super::config::ClipConfig;
use super::eval::{open_test_set, ClipEvaluation};
use super::folder::{ClipFolder, ClipTokenizer, ClipWeights};
use super::inputs::{ClipInputs, PairData};
use super::loss::{clip_loss, clip_loss_tiled, siglip_loss};
use super::model::ClipModel;
use super::preprocess::ImageProcessor;
use super::ring::{clip_loss_ring, siglip_loss_ring, RingOptions};
use super::settings::{ClipData, ClipEval, ClipLoss, ClipModelSection, LossKind};
use crate::tiled::Tiling;
use crate::{Batch, EmbeddingObjective, Objective};

/// CLIP or SigLIP (`loss.kind`) on image-caption pairs. Parameters: `transformers`' `CLIPModel`
/// names, and `logit_bias` with SigLIP.
pub struct Clip {
    config: ClipConfig,
    /// The pretrained weights until `build` has copied them into the parameters (then
    /// dropped: they are not held for the run).
    weights: Option<ClipWeights>,
    tokenizer: ClipTokenizer,
    processor: ImageProcessor,
    data: PairData,
    loss: ClipLoss,
    /// `loss.tile`, checked.
    tiling: Tiling,
    net: Option<(ClipModel, Option<Tensor>)>,
    device: Device,
    /// The evaluation and its images' preprocessing (the evaluation view).
    eval: Option<(ClipEvaluation, allgrad_data::Preprocess)>,
}

/// The image preprocessing of `model`'s folder, with the section's `mean` and `std` in place
/// of the folder's when given.
pub fn image_processor(model: &ClipModelSection, folder: &ClipFolder) -> Result<ImageProcessor> {
    let mut p = ImageProcessor::of_folder(&folder.dir, &folder.config)?;
    if let Some(m) = &model.mean {
        p.mean = m.clone();
    }
    if let Some(s) = &model.std {
        p.std = s.clone();
    }
    Ok(p)
}

impl Clip {
    /// Reads the model folder (its config, tokenizer, image preprocessing and, when
    /// `pretrained`, weights) and opens the pairs (parameters come with `build`), for global
    /// batches of `global_batch`. `seed` picks each class-captioned sample's template and
    /// name. The sections are those the method's validation checked.
    pub fn new(
        model: &ClipModelSection,
        loss: ClipLoss,
        data: &ClipData,
        seed: u64,
        global_batch: usize,
        device: Device,
    ) -> Result<Self> {
        let folder = ClipFolder::open(&model.dir)?;
        let max_len = model.max_len.unwrap_or(folder.config.text_config.max_position_embeddings);
        let tokenizer = folder.tokenizer(max_len)?;
        let weights = if model.pretrained { Some(folder.weights()?) } else { None };
        let tiling = loss.tiling()?;
        let processor = image_processor(model, &folder)?;
        let channels = folder.config.vision_config.num_channels;
        let inputs = ClipInputs { image: processor.pipeline(channels, data.random_crop)?, tokenizer: tokenizer.clone() };
        let data = PairData::open(data, inputs, seed, global_batch, device.clone())?;
        let config = folder.config;
        Ok(Clip { config, weights, tokenizer, processor, data, loss, tiling, net: None, device, eval: None })
    }

    /// Evaluates zero-shot classification and retrieval (before training and after every
    /// epoch) on `eval.images` or the test split of `data.images` ([`open_test_set`]), the
    /// images through the model's evaluation preprocessing, each rank embedding its share
    /// ([`ClipEvaluation`]).
    pub fn with_evaluation(mut self, data: &ClipData, cfg: &ClipEval) -> Result<Self> {
        let (images, classes) = open_test_set(data, cfg)?;
        let view = self.processor.pipeline(self.config.vision_config.num_channels, None)?;
        let ev = ClipEvaluation::new(images, classes, cfg, &self.tokenizer, self.config.projection_dim)?;
        self.eval = Some((ev, view));
        Ok(self)
    }

    /// The model (after `build`).
    pub fn model(&self) -> Result<&ClipModel> {
        self.net.as_ref().map(|(m, _)| m).ok_or_else(|| candle_core::Error::Msg("clip used before build".into()))
    }

    /// Whether the pretrained weights are still held (they are dropped once `build` has
    /// copied them into the parameters).
    pub fn holds_pretrained_weights(&self) -> bool {
        self.weights.is_some()
    }

    /// How many batches came from the loader's threads (the rest were built when asked for).
    pub fn prefetched(&self) -> usize {
        self.data.prefetched()
    }
}

impl Objective for Clip {
    fn build(&mut self, vb: VarBuilder) -> Result<()> {
        let mut cfg = self.config.clone();
        let siglip = matches!(self.loss.kind, LossKind::SiglipGather | LossKind::SiglipRing);
        if siglip {
            // SigLIP's own initial scale (a checkpoint's value wins when pretrained).
            cfg.logit_scale_init_value = self.loss.siglip_scale_init;
        }
        // The pretrained tensors are copied into the parameters, then dropped. A sigmoid loss
        // learns a logit bias (SigLIP's model has its own; a checkpoint's wins).
        let bias_init = siglip.then_some(self.loss.siglip_bias_init);
        let model = match self.weights.take() {
            Some(w) => w.init_model(&cfg, bias_init, vb.clone())?,
            None => ClipModel::with_bias(&vb, &cfg, bias_init)?,
        };
        let bias = if siglip { model.logit_bias.clone() } else { None };
        self.net = Some((model, bias));
        Ok(())
    }

    fn num_samples(&self) -> usize {
        self.data.num_samples()
    }

    fn plan(&mut self, epoch: usize, seed: u64, batches: &[Vec<usize>]) -> Result<()> {
        self.data.plan(epoch, seed, batches)
    }

    fn sequential(&self) -> bool {
        self.data.sequential()
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

    /// Where this rank's streams of shards stand (`data.shards`), saved in checkpoints.
    fn stream_state(&self) -> Result<Option<allgrad_data::webdataset::StreamState>> {
        self.data.stream_state()
    }

    fn resume_stream(&mut self, state: allgrad_data::webdataset::StreamState) -> Result<()> {
        self.data.resume_stream(state)
    }

    fn evaluate(&mut self, pg: &ProcessGroup) -> Result<Vec<(String, f64)>> {
        let Some((ev, view)) = &self.eval else { return Ok(Vec::new()) };
        ev.run(self.model()?, view, self.tokenizer.pad_id(), pg, &self.device)
    }
}

/// Embeddings `[n, 2, d]`: each pair's image (0) and caption (1), projected, not normalised.
impl EmbeddingObjective for Clip {
    fn embed(&mut self, batch: &Batch, rows: Range<usize>, _pg: &ProcessGroup) -> Result<Tensor> {
        // The whole batch's inputs, built once (on the loader's threads) for every chunk.
        let (images, tokens) = self.data.inputs(batch)?;
        let model = self.model()?;
        let images = images.narrow(0, rows.start, rows.len())?;
        let img = model.vision.forward(&images)?;
        let txt = model.text.forward(&tokens[rows], self.tokenizer.pad_id(), &self.device)?;
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
