//! Evaluation of the frozen encoder: a weighted kNN vote (the monitor) and a linear probe,
//! on L2-normalised features of the un-augmented images.

use std::sync::Arc;

use allgrad_data::Dataset;
use allgrad_dist::ProcessGroup;
use candle_core::{DType, Result, Tensor};

use super::data::data_err;
use super::two_view::TwoViewImages;
use crate::batch_norm::Mode;
use crate::losses::l2_normalize;

impl TwoViewImages {
    /// Encoder features (eval mode, L2-normalised) of the first `n` images of `set`.
    fn features(&self, set: &Arc<dyn Dataset>, n: usize, pg: &ProcessGroup) -> Result<(Tensor, Vec<usize>)> {
        let enc = self.encoder()?;
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
        if pg.rank() != 0 || self.test.is_empty() {
            return Ok(Vec::new()); // webdataset without test shards: no monitor
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
    use candle_core::Device;

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
}
