//! Zero-shot classification and image-text retrieval on a labelled test set, split over the
//! ranks: each rank embeds its contiguous share of the test images, of the classes' prompts
//! and of the retrieval captions (in chunks of `eval.batch`), the shares are gathered, and
//! every rank scores the same gathered embeddings, so the figures do not depend on the world
//! size. The images go through the model's evaluation preprocessing (allgrad-data's
//! [`Preprocess`], the view the objective's `preprocessor_config.json` describes). The test
//! set ([`open_test_set`]) is `eval.images` (the test split of an IDX folder, or an image
//! folder with one sub-folder per class), else the test split of `data.images`; its classes
//! are named by `eval.classes`, else by the sub-folders' names (an image folder) or
//! `data.classes` (an IDX split). A run that trains from shards or a CSV evaluates this way too.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use allgrad_data::{Dataset, FolderOptions, IdxDataset, ImageFolder, Preprocess, Split, ViewKey};
use allgrad_dist::ProcessGroup;
use candle_core::{DType, Device, Result, Tensor};

use super::data::ClassCaptions;
use super::folder::ClipTokenizer;
use super::model::ClipModel;
use super::settings::{ClipData, ClipEval};

fn msg(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

/// Rows one rank embedded in an evaluation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EvalShare {
    /// Test images.
    pub images: usize,
    /// Prompts and captions.
    pub texts: usize,
}

/// The evaluation data: the test images captioned with the held-out templates (images,
/// labels and retrieval captions), and every class's prompts, tokenized.
pub struct ClipEvaluation {
    cfg: ClipEval,
    test: ClassCaptions,
    /// Token ids of every class's prompts.
    prompts: Vec<Vec<Vec<u32>>>,
    /// Token ids of the retrieval captions.
    captions: Vec<Vec<u32>>,
    /// Width of the embeddings (a rank with no share still gathers `[0, dim]`).
    dim: usize,
}

/// A labelled test set and each class's names (its name first, then synonyms).
pub type TestSet = (Arc<dyn Dataset>, Vec<Vec<String>>);

/// Whether `dir` holds an IDX test split (`t10k-images-idx3-ubyte`, gzipped or not): then
/// `eval.images` means that split, else an image folder.
pub fn has_idx_test_split(dir: &Path) -> bool {
    ["t10k-images-idx3-ubyte", "t10k-images-idx3-ubyte.gz"].iter().any(|f| dir.join(f).is_file())
}

/// The test images and their classes' names. `eval.images` is either an IDX folder (its test
/// split, named by `eval.classes`, else `data.classes`) or an image folder (one sub-folder per
/// class, named by `eval.classes`, else the sub-folders' names with `_` as a space); without
/// it, the test split of `data.images` (an IDX folder) named by `eval.classes`, else
/// `data.classes`.
pub fn open_test_set(data: &ClipData, cfg: &ClipEval) -> Result<TestSet> {
    let idx = |dir: &Path, key: &str| -> Result<TestSet> {
        let images = IdxDataset::open_dir(dir, Split::Test).map_err(|e| msg(format!("{key}: {e}")))?;
        let names = if cfg.classes.is_empty() { data.classes.clone() } else { cfg.classes.clone() };
        Ok((Arc::new(images), names))
    };
    match (&cfg.images, &data.images) {
        (Some(dir), _) if has_idx_test_split(dir) => idx(dir, "eval.images"),
        (Some(dir), _) => {
            let folder = ImageFolder::open(dir, &FolderOptions::default())
                .map_err(|e| msg(format!("eval.images (an image folder, no IDX test split in it): {e}")))?;
            let names = if cfg.classes.is_empty() {
                folder.classes().iter().map(|c| vec![c.replace('_', " ")]).collect()
            } else if cfg.classes.len() == folder.classes().len() {
                cfg.classes.clone()
            } else {
                candle_core::bail!(
                    "eval.classes has {} lists, {} has {} class sub-folders ({:?})",
                    cfg.classes.len(),
                    Path::new(dir).display(),
                    folder.classes().len(),
                    folder.classes()
                );
            };
            Ok((Arc::new(folder), names))
        }
        (None, Some(dir)) => idx(dir, "data.images"),
        (None, None) => {
            candle_core::bail!("clip: eval needs eval.images (an IDX folder or an image folder) or data.images (an IDX folder)")
        }
    }
}

impl ClipEvaluation {
    /// Tokenizes the prompts (each class's first name in every template) and the retrieval
    /// captions (the first `cfg.retrieval` test images captioned from the templates and every
    /// name). `dim`: the width of the embeddings.
    pub fn new(
        images: Arc<dyn Dataset>,
        classes: Vec<Vec<String>>,
        cfg: &ClipEval,
        tokenizer: &ClipTokenizer,
        dim: usize,
    ) -> Result<Self> {
        if cfg.templates.is_empty() || cfg.batch == 0 {
            candle_core::bail!("clip: eval.templates must not be empty and eval.batch must be at least 1");
        }
        // Checks the class names (one non-empty list per class) and the templates first.
        let test = ClassCaptions::new(images, classes.clone(), cfg.templates.clone(), 1, None)?;
        let tokenize =
            |texts: &mut dyn Iterator<Item = Result<String>>| texts.map(|t| tokenizer.encode(&t?)).collect::<Result<Vec<_>>>();
        let prompts = classes
            .iter()
            .map(|names| tokenize(&mut cfg.templates.iter().map(|t| Ok(t.replace("{}", &names[0])))))
            .collect::<Result<Vec<_>>>()?;
        let n = cfg.retrieval.min(test.len());
        let captions = tokenize(&mut (0..n).map(|i| test.caption(i).map_err(msg)))?;
        Ok(ClipEvaluation { cfg: cfg.clone(), test, prompts, captions, dim })
    }

    /// `zero_shot_top1`, `image_to_text_r@1` / `@5` and `text_to_image_r@1` / `@5` of `model`
    /// (the same on every rank and for every world size).
    pub fn run(
        &self,
        model: &ClipModel,
        view: &Preprocess,
        pad_id: u32,
        pg: &ProcessGroup,
        device: &Device,
    ) -> Result<Vec<(String, f64)>> {
        Ok(self.run_counted(model, view, pad_id, pg, device)?.0)
    }

    /// [`ClipEvaluation::run`], with the rows this rank embedded.
    pub fn run_counted(
        &self,
        model: &ClipModel,
        view: &Preprocess,
        pad_id: u32,
        pg: &ProcessGroup,
        device: &Device,
    ) -> Result<(Vec<(String, f64)>, EvalShare)> {
        let mut share = EvalShare::default();
        let mut out = Vec::new();
        let (b, test) = (self.cfg.batch, &self.test);
        let images = |r: Range<usize>, share: &mut EvalShare| -> Result<Tensor> {
            share.images += r.len();
            let idx: Vec<usize> = r.collect();
            model.vision.forward(&batch_of(view, test, &idx, device)?)
        };
        if self.cfg.zero_shot > 0 {
            let n = self.cfg.zero_shot.min(test.len());
            let img = self.embed_shared(n, b, pg, device, |r| images(r, &mut share))?;
            // One direction per class: its prompts' normalised embeddings averaged. The
            // prompts of all classes are one list, split over the ranks like the images.
            let flat: Vec<Vec<u32>> = self.prompts.iter().flatten().cloned().collect();
            let txt = self.embed_shared(flat.len(), b, pg, device, |r| {
                share.texts += r.len();
                model.text.forward(&flat[r], pad_id, device)
            })?;
            let txt = crate::losses::l2_normalize(&txt)?;
            let mut classes = Vec::with_capacity(self.prompts.len());
            let mut at = 0;
            for p in &self.prompts {
                classes.push(txt.narrow(0, at, p.len())?.mean(0)?);
                at += p.len();
            }
            let scores = cosines(&img, &Tensor::stack(&classes, 0)?)?;
            let mut correct = 0usize;
            for (i, row) in scores.iter().enumerate() {
                let best = (0..row.len()).max_by(|a, b| row[*a].total_cmp(&row[*b])).unwrap_or(0);
                correct += usize::from(test.label(i).map_err(msg)? == best);
            }
            out.push(("zero_shot_top1".to_string(), correct as f64 / n.max(1) as f64));
        }
        let n = self.captions.len();
        if n > 0 {
            let img = self.embed_shared(n, b, pg, device, |r| images(r, &mut share))?;
            let txt = self.embed_shared(n, b, pg, device, |r| {
                share.texts += r.len();
                model.text.forward(&self.captions[r], pad_id, device)
            })?;
            let i2t = cosines(&img, &txt)?;
            let t2i = cosines(&txt, &img)?;
            for k in [1, 5] {
                out.push((format!("image_to_text_r@{k}"), recall_at(&i2t, |i| i, k)));
                out.push((format!("text_to_image_r@{k}"), recall_at(&t2i, |i| i, k)));
            }
        }
        Ok((out, share))
    }

    /// Embeddings of `n` items, rank r embedding its contiguous share in chunks of `batch`,
    /// gathered (no gradient): every rank gets all `n` rows, in order.
    fn embed_shared(
        &self,
        n: usize,
        batch: usize,
        pg: &ProcessGroup,
        device: &Device,
        mut f: impl FnMut(Range<usize>) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let (w, r) = (pg.world_size(), pg.rank());
        let (lo, hi) = (n * r / w, n * (r + 1) / w);
        let mut parts = Vec::new();
        for s in (lo..hi).step_by(batch.max(1)) {
            parts.push(f(s..(s + batch).min(hi))?.detach().to_dtype(DType::F32)?);
        }
        let mine = if parts.is_empty() { Tensor::zeros((0, self.dim), DType::F32, device)? } else { Tensor::cat(&parts, 0)? };
        pg.all_gather(&mine)
    }
}

/// The images of `indices` through `view` (the evaluation preprocessing) as `[n, c, h, w]` f32.
fn batch_of(view: &Preprocess, test: &ClassCaptions, indices: &[usize], device: &Device) -> Result<Tensor> {
    let mut all = Vec::new();
    let mut shape = (view.channels, 0, 0);
    for &i in indices {
        let img = test.get(i).map_err(msg)?;
        let chw = view.apply(&img, ViewKey { seed: 0, epoch: 0, index: i as u64, view: 0 }).map_err(msg)?;
        shape = (chw.channels, chw.height, chw.width);
        all.extend(chw.data);
    }
    Tensor::from_vec(all, (indices.len(), shape.0, shape.1, shape.2), device)
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
