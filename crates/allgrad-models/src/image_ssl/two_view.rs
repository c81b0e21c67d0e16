//! The parts shared by the image methods (SimCLR, BarlowTwins): the data and its two
//! augmented views, a ResNet encoder with a projection MLP, and the evaluation of the frozen
//! encoder (kNN monitor and linear probe).
//!
//! The views of the coming batches are built ahead on loader threads (see
//! [`crate::Objective::plan`]) while the model computes; they are keyed by (seed, epoch,
//! global sample index, view), so prefetching changes nothing in the numbers.

use std::path::PathBuf;
use std::sync::Arc;

use allgrad_data::{
    Augment, AugmentConfig, Cifar10, Dataset, FolderOptions, IdxDataset, ImageFolder, Loader, LoaderConfig, Split, TwoViews,
};
use allgrad_dist::ProcessGroup;
use candle_core::{DType, Device, Result, Tensor};
use candle_nn::{Linear, Module, VarBuilder};
use serde::{Deserialize, Serialize};

use crate::batch_norm::{BatchNorm, Mode};
use crate::losses::l2_normalize;
use crate::resnet::{ResNet, ResNetConfig};
use crate::Batch;

/// The `data` section for images.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ImageData {
    /// Directory of the data set.
    pub dir: PathBuf,
    /// Its file format.
    pub format: ImageFormat,
    /// Augmentations making the two training views.
    #[serde(default)]
    pub augment: AugmentConfig,
    /// The kNN monitor.
    #[serde(default)]
    pub knn: KnnConfig,
    /// Threads that build the training views ahead of the model.
    #[serde(default)]
    pub loader: LoaderConfig,
    /// Options of the `folder` format.
    #[serde(default)]
    pub folder: FolderOptions,
}

/// On-disk formats.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ImageFormat {
    /// MNIST-style IDX files (`train-images-idx3-ubyte[.gz]`, ...).
    Idx,
    /// CIFAR-10 binary batches.
    Cifar10,
    /// Image files (PNG, JPEG, ...) in `train/` and `test/`, each with one sub-folder per
    /// class.
    Folder,
}

/// kNN evaluation of the encoder's features: each test image votes among its `k` most
/// similar training images (cosine similarity), weighted by `exp(similarity / temperature)`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct KnnConfig {
    /// Neighbours that vote.
    pub k: usize,
    /// Temperature of the vote weights.
    pub temperature: f64,
    /// Training images in the memory bank (the first ones of the set; 0 = all).
    pub bank: usize,
    /// Test images evaluated (the first ones; 0 = all).
    pub queries: usize,
    /// Full-batch steps of the linear probe trained on the same frozen features (0: no probe).
    pub linear_probe_steps: usize,
}

impl Default for KnnConfig {
    fn default() -> Self {
        KnnConfig { k: 200, temperature: 0.1, bank: 0, queries: 0, linear_probe_steps: 300 }
    }
}

/// The `model` section of the image methods.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct ImageModel {
    /// The encoder.
    pub encoder: ResNetConfig,
    /// The projection head.
    pub projector: ProjectorConfig,
}

/// The projection MLP: `layers` linear layers with ReLU between them (2: SimCLR v1,
/// Linear-ReLU-Linear; 3 or more: batch norm after every hidden layer, as in SimCLR v2 and
/// BarlowTwins' Linear-BN-ReLU-Linear-BN-ReLU-Linear). Its batch norms are synchronised
/// when the encoder's are (`encoder.sync_bn`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ProjectorConfig {
    /// Hidden width (0: the encoder's feature width).
    pub hidden: usize,
    /// Output width.
    pub out: usize,
    /// Number of linear layers, at least 2.
    pub layers: usize,
    /// Whether the linear layers have biases (a bias before a batch norm has no effect).
    pub bias: bool,
}

impl Default for ProjectorConfig {
    fn default() -> Self {
        ProjectorConfig { hidden: 0, out: 128, layers: 2, bias: true }
    }
}

struct Projector {
    layers: Vec<(Linear, Option<BatchNorm>)>,
}

impl Projector {
    fn forward(&self, x: &Tensor, mode: Mode) -> Result<Tensor> {
        let mut h = x.clone();
        let n = self.layers.len();
        for (i, (lin, bn)) in self.layers.iter().enumerate() {
            h = lin.forward(&h)?;
            if let Some(bn) = bn {
                h = bn.forward(&h, mode)?;
            }
            if i + 1 < n {
                h = h.relu()?;
            }
        }
        Ok(h)
    }
}

/// Two augmented views of image batches through an encoder and a projector; see the
/// module docs. The methods add their loss on top.
pub struct TwoViewImages {
    model: ImageModel,
    train: Arc<dyn Dataset>,
    test: Arc<dyn Dataset>,
    views: Arc<TwoViews>,
    eval_view: Augment,
    knn: KnnConfig,
    loader_cfg: LoaderConfig,
    loader: Option<Loader>,
    prefetched: usize,
    device: Device,
    dtype: DType,
    net: Option<(ResNet, Projector)>,
}

fn open(data: &ImageData, split: Split) -> Result<Arc<dyn Dataset>> {
    let err = |e: allgrad_data::DataError| candle_core::Error::Msg(format!("data.dir {}: {e}", data.dir.display()));
    Ok(match data.format {
        ImageFormat::Idx => Arc::new(IdxDataset::open_dir(&data.dir, split).map_err(err)?),
        ImageFormat::Cifar10 => Arc::new(Cifar10::open_dir(&data.dir, split).map_err(err)?),
        ImageFormat::Folder => {
            let sub = match split {
                Split::Train => "train",
                Split::Test => "test",
            };
            Arc::new(ImageFolder::open(data.dir.join(sub), &data.folder).map_err(err)?)
        }
    })
}

fn data_err(e: allgrad_data::DataError) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

impl TwoViewImages {
    /// Opens the data and prepares the augmentations (parameters come with `build`).
    pub fn new(data: &ImageData, model: ImageModel, device: Device, dtype: DType) -> Result<Self> {
        let aug_err = |e: allgrad_data::DataError| candle_core::Error::Msg(format!("data.augment: {e}"));
        let views = TwoViews::new(data.augment.clone()).map_err(aug_err)?;
        let eval_view = Augment::new(AugmentConfig::eval(data.augment.normalize.clone())).map_err(aug_err)?;
        let p = &model.projector;
        if p.layers < 2 || p.out == 0 {
            candle_core::bail!("model.projector: layers must be at least 2 and out positive (got {} and {})", p.layers, p.out);
        }
        Ok(TwoViewImages {
            model,
            train: open(data, Split::Train)?,
            test: open(data, Split::Test)?,
            views: Arc::new(views),
            eval_view,
            knn: data.knn.clone(),
            loader_cfg: data.loader.clone(),
            loader: None,
            prefetched: 0,
            device,
            dtype,
            net: None,
        })
    }

    /// Creates the encoder (`encoder.*`) and projector (`projector.*`) parameters.
    pub fn build(&mut self, vb: VarBuilder) -> Result<()> {
        let enc = ResNet::new(&self.model.encoder, vb.pp("encoder"))?;
        let p = &self.model.projector;
        let hidden = if p.hidden == 0 { enc.feature_dim() } else { p.hidden };
        let mut layers = Vec::new();
        let mut cin = enc.feature_dim();
        for i in 0..p.layers {
            let last = i + 1 == p.layers;
            let cout = if last { p.out } else { hidden };
            let vbl = vb.pp(format!("projector.{i}"));
            let bn =
                (p.layers >= 3 && !last).then(|| BatchNorm::new(cout, self.model.encoder.sync_bn, vbl.pp("bn"))).transpose()?;
            let linear = if p.bias {
                candle_nn::linear(cin, cout, vbl.pp("linear"))?
            } else {
                candle_nn::linear_no_bias(cin, cout, vbl.pp("linear"))?
            };
            layers.push((linear, bn));
            cin = cout;
        }
        self.net = Some((enc, Projector { layers }));
        Ok(())
    }

    /// Training images.
    pub fn num_samples(&self) -> usize {
        self.train.len()
    }

    /// Starts building the views of `batches` (this rank's coming micro-batches of `epoch`,
    /// in order) on the loader's threads. Replaces any earlier plan.
    pub fn plan(&mut self, epoch: usize, seed: u64, batches: &[Vec<usize>]) -> Result<()> {
        self.loader = None; // stops the old workers first
        if self.loader_cfg.workers == 0 || batches.is_empty() {
            return Ok(());
        }
        let pipeline: Arc<dyn allgrad_data::Pipeline> = self.views.clone();
        let loader =
            Loader::new(self.train.clone(), pipeline, seed, epoch as u64, batches.to_vec(), &self.loader_cfg, &self.device)
                .map_err(data_err)?;
        self.loader = Some(loader);
        Ok(())
    }

    /// The two views of `batch`, `[b, C, H, W]` each: from the loader when it built this
    /// batch, otherwise built here.
    pub fn views(&mut self, batch: &Batch) -> Result<(Tensor, Tensor)> {
        if let Some(loader) = &mut self.loader {
            match loader.next() {
                Some(Ok(b)) if b.indices == batch.indices => {
                    self.prefetched += 1;
                    return Ok((b.views[0].to_dtype(self.dtype)?, b.views[1].to_dtype(self.dtype)?));
                }
                Some(Err(e)) => return Err(data_err(e)),
                _ => {
                    tracing::debug!("the loader's plan does not match the batch asked for; building it inline");
                    self.loader = None;
                }
            }
        }
        let b = batch.indices.len();
        let (mut first, mut second) = (Vec::with_capacity(b), Vec::with_capacity(b));
        for &i in batch.indices {
            let img = self.train.get(i).map_err(data_err)?;
            let [v1, v2] = self.views.apply(&img, batch.seed, batch.epoch as u64, i as u64).map_err(data_err)?;
            first.push(v1);
            second.push(v2);
        }
        Ok((self.stack(first)?, self.stack(second)?))
    }

    /// How many batches [`TwoViewImages::views`] took from the loader (the rest it built
    /// itself).
    pub fn prefetched(&self) -> usize {
        self.prefetched
    }

    /// Projector outputs of the encoder's features of `x`.
    pub fn embed(&self, x: &Tensor, mode: Mode) -> Result<Tensor> {
        let (enc, proj) = self.net()?;
        proj.forward(&enc.forward(x, mode)?, mode)
    }

    fn net(&self) -> Result<&(ResNet, Projector)> {
        self.net.as_ref().ok_or_else(|| candle_core::Error::Msg("image objective used before build".into()))
    }

    fn stack(&self, views: Vec<allgrad_data::Chw>) -> Result<Tensor> {
        let (c, h, w) = (views[0].channels, views[0].height, views[0].width);
        let n = views.len();
        let data: Vec<f32> = views.into_iter().flat_map(|v| v.data).collect();
        Tensor::from_vec(data, (n, c, h, w), &self.device)?.to_dtype(self.dtype)
    }

    /// Encoder features (eval mode, L2-normalised) of the first `n` images of `set`.
    fn features(&self, set: &Arc<dyn Dataset>, n: usize, pg: &ProcessGroup) -> Result<(Tensor, Vec<usize>)> {
        let (enc, _) = self.net()?;
        let mode = Mode { train: false, pg };
        let mut feats = Vec::new();
        let mut labels = Vec::with_capacity(n);
        for start in (0..n).step_by(256) {
            let mut views = Vec::new();
            for i in start..(start + 256).min(n) {
                let img = set.get(i).map_err(data_err)?;
                let key = allgrad_data::ViewKey { seed: 0, epoch: 0, index: i as u64, view: 0 };
                views.push(self.eval_view.apply(&img, key).map_err(data_err)?);
                labels.push(set.label(i).map_err(data_err)?);
            }
            feats.push(l2_normalize(&enc.forward(&self.stack(views)?, mode)?)?.detach());
        }
        Ok((Tensor::cat(&feats, 0)?, labels))
    }

    /// kNN top-1 (and the linear probe's top-1 when configured) of the frozen encoder's
    /// features, on rank 0 (the other ranks return nothing).
    pub fn evaluate(&self, pg: &ProcessGroup) -> Result<Vec<(String, f64)>> {
        if pg.rank() != 0 {
            return Ok(Vec::new());
        }
        let bank_n = if self.knn.bank == 0 { self.train.len() } else { self.knn.bank.min(self.train.len()) };
        let query_n = if self.knn.queries == 0 { self.test.len() } else { self.knn.queries.min(self.test.len()) };
        let (bank, bank_labels) = self.features(&self.train.clone(), bank_n, pg)?;
        let (queries, query_labels) = self.features(&self.test.clone(), query_n, pg)?;
        let classes = self.train.num_classes().max(self.test.num_classes());
        let acc = knn_accuracy(&queries, &bank, &bank_labels, &query_labels, classes, self.knn.k, self.knn.temperature)?;
        let mut out = vec![("knn_top1".into(), acc)];
        if self.knn.linear_probe_steps > 0 {
            let probe = linear_probe(&bank, &bank_labels, &queries, &query_labels, classes, self.knn.linear_probe_steps)?;
            out.push(("linear_top1".into(), probe));
        }
        Ok(out)
    }
}

/// Top-1 accuracy of a weighted kNN vote (features L2-normalised, rows = samples).
pub fn knn_accuracy(
    queries: &Tensor,
    bank: &Tensor,
    bank_labels: &[usize],
    query_labels: &[usize],
    classes: usize,
    k: usize,
    temperature: f64,
) -> Result<f64> {
    let k = k.clamp(1, bank_labels.len().max(1));
    let mut hits = 0usize;
    for start in (0..query_labels.len()).step_by(512) {
        let n = (query_labels.len() - start).min(512);
        let sim = queries.narrow(0, start, n)?.matmul(&bank.t()?)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        for (row, truth) in sim.iter().zip(&query_labels[start..start + n]) {
            let mut idx: Vec<usize> = (0..row.len()).collect();
            idx.select_nth_unstable_by(k - 1, |a, b| row[*b].total_cmp(&row[*a]));
            let mut votes = vec![0f64; classes];
            for &j in &idx[..k] {
                votes[bank_labels[j]] += (row[j] as f64 / temperature).exp();
            }
            let best = votes.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(c, _)| c).unwrap_or(0);
            hits += usize::from(best == *truth);
        }
    }
    Ok(hits as f64 / query_labels.len().max(1) as f64)
}

/// Top-1 test accuracy of a linear classifier (multinomial logistic regression) trained on
/// frozen features: the features are standardised with the training set's statistics, then
/// `steps` full-batch gradient steps with momentum minimise the cross-entropy.
pub fn linear_probe(
    train: &Tensor,
    train_labels: &[usize],
    test: &Tensor,
    test_labels: &[usize],
    classes: usize,
    steps: usize,
) -> Result<f64> {
    let train = train.to_dtype(DType::F32)?;
    let test = test.to_dtype(DType::F32)?;
    let mean = train.mean_keepdim(0)?;
    let std = (train.broadcast_sub(&mean)?.sqr()?.mean_keepdim(0)? + 1e-6)?.sqrt()?;
    let standardise = |f: &Tensor| f.broadcast_sub(&mean)?.broadcast_div(&std);
    let (xtr, xte) = (standardise(&train)?, standardise(&test)?);
    let d = xtr.dim(1)?;
    let dev = xtr.device().clone();
    let y = Tensor::from_vec(train_labels.iter().map(|l| *l as u32).collect::<Vec<_>>(), train_labels.len(), &dev)?;
    let w = candle_core::Var::zeros((d, classes), DType::F32, &dev)?;
    let b = candle_core::Var::zeros(classes, DType::F32, &dev)?;
    let (mut vw, mut vb) = (w.as_tensor().zeros_like()?, b.as_tensor().zeros_like()?);
    let (lr, momentum) = (0.5, 0.9);
    for _ in 0..steps {
        let logits = xtr.matmul(w.as_tensor())?.broadcast_add(b.as_tensor())?;
        let grads = allgrad_nn::cross_entropy(&logits, &y)?.backward()?;
        let (gw, gb) = (grads.get(&w).cloned().unwrap_or(vw.zeros_like()?), grads.get(&b).cloned().unwrap_or(vb.zeros_like()?));
        vw = ((vw * momentum)? + gw)?;
        vb = ((vb * momentum)? + gb)?;
        w.set(&(w.as_tensor() - (&vw * lr)?)?)?;
        b.set(&(b.as_tensor() - (&vb * lr)?)?)?;
    }
    let pred = xte.matmul(w.as_tensor())?.broadcast_add(b.as_tensor())?.argmax(1)?.to_vec1::<u32>()?;
    let hits = pred.iter().zip(test_labels).filter(|(p, t)| **p as usize == **t).count();
    Ok(hits as f64 / test_labels.len().max(1) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Features: a noisy one-hot of the class in 6 dims, with a distractor dimension.
    fn features(n: usize, seed: u64) -> (Tensor, Vec<usize>) {
        let noise = crate::rng::normals(&mut crate::rng::stream(&[seed]), n * 6);
        let labels: Vec<usize> = (0..n).map(|i| i % 4).collect();
        let v: Vec<f32> = (0..n)
            .flat_map(|i| (0..6).map(move |j| (i, j)))
            .map(|(i, j)| f32::from(u8::from(j == labels[i])) * 2.0 + 0.3 * noise[i * 6 + j] as f32)
            .collect();
        (Tensor::from_vec(v, (n, 6), &Device::Cpu).unwrap(), labels)
    }

    #[test]
    fn linear_probe_learns_separable_classes_and_knn_votes_by_neighbours() {
        let (tr, ytr) = features(400, 1);
        let (te, yte) = features(200, 2);
        let probe = linear_probe(&tr, &ytr, &te, &yte, 4, 200).unwrap();
        assert!(probe > 0.95, "linear probe accuracy {probe}");
        let norm = |t: &Tensor| l2_normalize(t).unwrap();
        let knn = knn_accuracy(&norm(&te), &norm(&tr), &ytr, &yte, 4, 20, 0.1).unwrap();
        assert!(knn > 0.95, "kNN accuracy {knn}");
        // Labels independent of the features leave nothing to learn: about chance (1/4).
        let random: Vec<usize> = (0..ytr.len()).map(|i| (i.wrapping_mul(2_654_435_761) >> 7) % 4).collect();
        let chance = linear_probe(&tr, &random, &te, &yte, 4, 200).unwrap();
        assert!(chance < 0.45, "probe trained on random labels scored {chance}");
    }

    #[test]
    fn planned_batches_come_from_the_loader_and_equal_views_built_inline() {
        let data = |workers| ImageData {
            dir: std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/fashion-mnist"),
            format: ImageFormat::Idx,
            augment: AugmentConfig { normalize: allgrad_data::Normalize::identity(), ..AugmentConfig::simclr(12) },
            knn: KnnConfig::default(),
            loader: LoaderConfig { workers, prefetch: 2 },
            folder: FolderOptions::default(),
        };
        let plan = vec![vec![3, 1, 4], vec![1, 5, 9]];
        let run = |workers| {
            let mut images = TwoViewImages::new(&data(workers), ImageModel::default(), Device::Cpu, DType::F32).unwrap();
            images.plan(2, 7, &plan).unwrap();
            let views: Vec<(Tensor, Tensor)> =
                plan.iter().map(|idx| images.views(&Batch { indices: idx, epoch: 2, step: 0, seed: 7 }).unwrap()).collect();
            (views, images.prefetched())
        };
        let ((ahead, n_ahead), (inline, n_inline)) = (run(2), run(0));
        assert_eq!((n_ahead, n_inline), (2, 0), "batches taken from the loader");
        for ((a1, a2), (b1, b2)) in ahead.iter().zip(&inline) {
            assert_eq!(a1.dims(), &[3, 1, 12, 12]);
            for (a, b) in [(a1, b1), (a2, b2)] {
                let diff = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                assert_eq!(diff, 0.0, "prefetched views differ from inline ones");
            }
        }
    }
}
