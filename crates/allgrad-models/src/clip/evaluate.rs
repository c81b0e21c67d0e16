//! Zero-shot classification and image-text retrieval of a CLIP model on the test split of a
//! labelled image data set captioned from its class names: the evaluation, standing on its
//! own beside the training data and the objective.

use std::ops::Range;
use std::sync::Arc;

use allgrad_data::{Dataset, IdxDataset, Preprocess, Split, ViewKey};
use allgrad_dist::ProcessGroup;
use candle_core::{DType, Device, Result, Tensor};

use super::data::ClassCaptions;
use super::folder::ClipTokenizer;
use super::model::ClipModel;
use super::settings::{ClipData, ClipEval};
use crate::ModelError;

/// The evaluation data: the test split captioned with the held-out templates (images, labels
/// and retrieval captions), the prompts of every class, and the evaluation view of images.
pub struct ClipEvaluation {
    cfg: ClipEval,
    test: ClassCaptions,
    view: Preprocess,
    tokenizer: ClipTokenizer,
    /// Token ids of every class's prompts.
    prompts: Vec<Vec<Vec<u32>>>,
    /// Token ids of the retrieval captions.
    captions: Vec<Vec<u32>>,
}

fn tokenize(tokenizer: &ClipTokenizer, texts: impl Iterator<Item = Result<String>>) -> Result<Vec<Vec<u32>>> {
    texts.map(|t| tokenizer.encode(&t?)).collect()
}

/// Fraction of rows of `scores` (`[n, m]`) whose `target(i)` is among their `k` highest.
fn recall_at(scores: &[Vec<f32>], target: impl Fn(usize) -> usize, k: usize) -> f64 {
    let hits = scores
        .iter()
        .enumerate()
        .filter(|(i, row)| {
            let t = row[target(*i)];
            // Ties count against the target: ranked after every equal score.
            row.iter().filter(|s| **s >= t).count() <= k
        })
        .count();
    hits as f64 / scores.len().max(1) as f64
}

fn cosines(a: &Tensor, b: &Tensor) -> Result<Vec<Vec<f32>>> {
    let a = crate::losses::l2_normalize(a)?;
    let b = crate::losses::l2_normalize(b)?;
    a.matmul(&b.t()?)?.to_vec2::<f32>()
}

impl ClipEvaluation {
    /// The test split of `eval.images` or `data.images` with `cfg`'s templates (checked by the
    /// method's validation), images through `view` (the evaluation preprocessing).
    pub fn new(data: &ClipData, cfg: &ClipEval, tokenizer: &ClipTokenizer, view: Preprocess) -> Result<Self> {
        let (dir, classes) = cfg.source(data);
        let Some(dir) = dir else {
            candle_core::bail!("clip: eval needs eval.images or data.images (a test split and class names)")
        };
        let images = Arc::new(IdxDataset::open_dir(dir, Split::Test).map_err(ModelError::Data)?);
        let test = ClassCaptions::new(images, classes.to_vec(), cfg.templates.clone(), 1, None)?;
        let prompts = classes
            .iter()
            .map(|names| tokenize(tokenizer, cfg.templates.iter().map(|t| Ok(t.replace("{}", &names[0])))))
            .collect::<Result<Vec<_>>>()?;
        let n = cfg.retrieval.min(test.len());
        let captions = tokenize(tokenizer, (0..n).map(|i| test.caption(i).map_err(|e| ModelError::Data(e).into())))?;
        Ok(ClipEvaluation { cfg: cfg.clone(), test, view, tokenizer: tokenizer.clone(), prompts, captions })
    }

    /// The images of test samples `indices` as the vision tower's input.
    fn images(&self, indices: Range<usize>, device: &Device) -> Result<Tensor> {
        let mut all = Vec::new();
        let mut shape = (0, 0, 0);
        let n = indices.len();
        for i in indices {
            let img = self.test.get(i).map_err(ModelError::Data)?;
            let chw = self.view.apply(&img, ViewKey { seed: 0, epoch: 0, index: i as u64, view: 0 }).map_err(ModelError::Data)?;
            shape = chw.shape();
            all.extend(chw.data);
        }
        Tensor::from_vec(all, (n, shape.0, shape.1, shape.2), device)
    }

    /// Embeddings of `n` items, rank r embedding its contiguous share in chunks of `batch`,
    /// gathered (no gradient): every rank gets all `n` rows.
    fn embed_shared(
        &self,
        n: usize,
        dim: usize,
        device: &Device,
        pg: &ProcessGroup,
        f: impl Fn(Range<usize>) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let (w, r) = (pg.world_size(), pg.rank());
        let (lo, hi) = (n * r / w, n * (r + 1) / w);
        let batch = self.cfg.batch.max(1);
        let mut parts = Vec::new();
        for s in (lo..hi).step_by(batch) {
            parts.push(f(s..(s + batch).min(hi))?.detach());
        }
        let mine = if parts.is_empty() {
            Tensor::zeros((0, dim), DType::F32, device)?
        } else {
            Tensor::cat(&parts, 0)?.to_dtype(DType::F32)?
        };
        pg.all_gather(&mine)
    }

    /// Zero-shot top-1 accuracy (`zero_shot_top1`) and retrieval recall at 1 and 5 in both
    /// directions, of `model` on `device`, the images embedded in shares over the ranks.
    pub fn evaluate(&self, model: &ClipModel, dim: usize, device: &Device, pg: &ProcessGroup) -> Result<Vec<(String, f64)>> {
        let pad = self.tokenizer.pad_id();
        let embed_texts = |ids: &[Vec<u32>]| model.text.forward(ids, pad, device);
        let embed_images = |r: Range<usize>| model.vision.forward(&self.images(r, device)?);
        let mut out = Vec::new();
        let test = &self.test;
        if self.cfg.zero_shot > 0 {
            let n = self.cfg.zero_shot.min(test.len());
            let img = self.embed_shared(n, dim, device, pg, embed_images)?;
            // One direction per class: its prompts' normalised embeddings averaged.
            let mut classes = Vec::new();
            for p in &self.prompts {
                let t = crate::losses::l2_normalize(&embed_texts(p)?.detach().to_dtype(DType::F32)?)?;
                classes.push(t.mean(0)?);
            }
            let classes = Tensor::stack(&classes, 0)?;
            let scores = cosines(&img, &classes)?;
            let correct = (0..n).filter(|&i| {
                let row = &scores[i];
                let best = (0..row.len()).max_by(|a, b| row[*a].total_cmp(&row[*b])).unwrap_or(0);
                test.label(i).map(|l| l == best).unwrap_or(false)
            });
            out.push(("zero_shot_top1".to_string(), correct.count() as f64 / n.max(1) as f64));
        }
        let n = self.captions.len();
        if n > 0 {
            let img = self.embed_shared(n, dim, device, pg, embed_images)?;
            let txt = self.embed_shared(n, dim, device, pg, |r| embed_texts(&self.captions[r]))?;
            let i2t = cosines(&img, &txt)?;
            let t2i = cosines(&txt, &img)?;
            for k in [1, 5] {
                out.push((format!("image_to_text_r@{k}"), recall_at(&i2t, |i| i, k)));
                out.push((format!("text_to_image_r@{k}"), recall_at(&t2i, |i| i, k)));
            }
        }
        Ok(out)
    }
}
