//! The SimCSE objective: a BERT encoder trained with InfoNCE over the global batch.

use allgrad_dist::ProcessGroup;
use candle_core::{DType, Device, IndexOp, Result, Tensor};
use candle_nn::VarBuilder;

use super::config::{SimCseData, SimCseLoss, SimCseModel};
use super::evaluation::{Evaluator, SimCseEval};
use super::info_nce::{info_nce, info_nce_hard_negatives, info_nce_hard_negatives_tiled, info_nce_tiled, info_nce_tiled_queued};
use crate::bert::{BertConfig, BertFolder, BertModel, BertTokenizer, Checkpoint, Dense, DropoutKey, Pooling, TokenBatch};
use crate::objective::QueueBuffer;
use crate::tiled::Tiling;
use crate::{Batch, EmbeddingObjective, Objective};

/// SimCSE (Gao et al., 2021). Unsupervised data: every sentence is encoded twice in one
/// batch (views 0 and 1, different dropout masks) and anchors (view 0) are scored against the
/// second views of the whole global batch. Supervised data: anchor, positive and hard negative
/// (views 0, 1, 2), the candidates being the positives and hard negatives of every rank.
///
/// Dropout masks are keyed by (seed, step, global sample index, view, layer, site, position):
/// W ranks train exactly like one process at the same global batch, dropout on.
/// Parameters: `bert.*` (Hugging Face names under a `bert.` prefix) and, with the MLP head,
/// `head.dense.*`.
pub struct SimCse {
    model_cfg: SimCseModel,
    loss_cfg: SimCseLoss,
    bert_cfg: BertConfig,
    checkpoint: Option<Checkpoint>,
    /// Token ids of every sample's sentences (one, or three for triplets).
    tokens: Vec<Vec<Vec<u32>>>,
    pad_id: u32,
    supervised: bool,
    /// `loss.tile` and `loss.queue`, checked.
    tiling: Tiling,
    /// The keys of past batches (`loss.queue`): a global micro-batch's positives, and with
    /// supervised data its hard negatives after them.
    queue: QueueBuffer,
    net: Option<(BertModel, Option<Dense>)>,
    device: Device,
    /// The benchmarks and the evaluation tokenizer (its own `max_len`), when configured.
    eval: Option<(Evaluator, BertTokenizer)>,
}

impl SimCse {
    /// Reads the model folder and tokenizes the data (parameters come with `build`).
    pub fn new(model: SimCseModel, loss: SimCseLoss, data: SimCseData, device: Device, dtype: DType) -> Result<Self> {
        if !(loss.temperature > 0.0 && loss.temperature.is_finite()) {
            candle_core::bail!("simcse: loss.temperature must be positive, got {}", loss.temperature);
        }
        if !loss.hard_negative_weight.is_finite() {
            candle_core::bail!("simcse: loss.hard_negative_weight must be finite, got {}", loss.hard_negative_weight);
        }
        let tiling = loss.tiling()?;
        let queue = tiling.new_queue()?;
        if data.is_empty() {
            candle_core::bail!("simcse: the training data is empty");
        }
        let _ = dtype; // parameters take the trainer's dtype through the VarBuilder
        let bert_cfg = BertConfig::from_file(&model.dir.join("config.json"))?;
        let checkpoint = if model.pretrained { Some(BertFolder::open(&model.dir)?.checkpoint) } else { None };
        if model.max_len > bert_cfg.max_position_embeddings {
            candle_core::bail!(
                "simcse: model.max_len {} exceeds max_position_embeddings {} of {}",
                model.max_len,
                bert_cfg.max_position_embeddings,
                model.dir.display()
            );
        }
        let tokenizer = BertTokenizer::from_file(&model.dir.join("tokenizer.json"), model.max_len)?;
        let encode = |s: &str| tokenizer.encode(s);
        let (tokens, supervised) = match &data {
            SimCseData::Sentences(s) => (s.iter().map(|t| Ok(vec![encode(t)?])).collect::<Result<Vec<_>>>()?, false),
            SimCseData::Triplets(t) => {
                (t.iter().map(|[a, p, n]| Ok(vec![encode(a)?, encode(p)?, encode(n)?])).collect::<Result<Vec<_>>>()?, true)
            }
        };
        Ok(SimCse {
            model_cfg: model,
            loss_cfg: loss,
            bert_cfg,
            checkpoint,
            tokens,
            pad_id: tokenizer.pad_id(),
            supervised,
            tiling,
            queue: QueueBuffer::new(queue, if supervised { 2 } else { 1 }, "simcse"),
            net: None,
            device,
            eval: None,
        })
    }

    /// Evaluates with `cfg`'s benchmarks (before training and after every epoch), on the
    /// pooled embeddings without the MLP head, dropout off, sequences up to `cfg.max_len`.
    pub fn with_evaluation(mut self, cfg: &SimCseEval) -> Result<Self> {
        let evaluator = Evaluator::load(cfg)?;
        let max_len = cfg.max_len.min(self.bert_cfg.max_position_embeddings);
        let tokenizer = BertTokenizer::from_file(&self.model_cfg.dir.join("tokenizer.json"), max_len)?;
        self.eval = (!evaluator.is_empty()).then_some((evaluator, tokenizer));
        Ok(self)
    }

    /// The encoder (after `build`).
    pub fn encoder(&self) -> Result<&BertModel> {
        self.net.as_ref().map(|(m, _)| m).ok_or_else(|| candle_core::Error::Msg("simcse used before build".into()))
    }

    /// Training embeddings `[rows, hidden]` (pooling, then the MLP head when configured) of
    /// `batch` with dropout keyed by `key`.
    fn train_embeddings(&self, batch: &TokenBatch, key: &DropoutKey) -> Result<Tensor> {
        let (model, head) = self.net.as_ref().ok_or_else(|| candle_core::Error::Msg("simcse used before build".into()))?;
        let z = model.embed(batch, self.model_cfg.pooling, Some(key))?;
        match head {
            Some(h) => h.forward(&z)?.tanh(),
            None => Ok(z),
        }
    }
}

impl Objective for SimCse {
    fn build(&mut self, vb: VarBuilder) -> Result<()> {
        let with_pooler = self.model_cfg.pooling == Pooling::Cls;
        let model = match &self.checkpoint {
            Some(ck) => {
                if with_pooler && !ck.has_pooler() {
                    candle_core::bail!("simcse: pooling cls needs the pooler, absent from {}", self.model_cfg.dir.display());
                }
                ck.init_model(&self.bert_cfg, vb.pp("bert"), with_pooler)?
            }
            None => BertModel::new(vb.pp("bert"), &self.bert_cfg, with_pooler)?,
        };
        let h = self.bert_cfg.hidden_size;
        let head = if self.model_cfg.mlp_head {
            Some(Dense::new(vb.pp("head.dense"), h, h, self.bert_cfg.initializer_range)?)
        } else {
            None
        };
        self.net = Some((model, head));
        Ok(())
    }

    fn num_samples(&self) -> usize {
        self.tokens.len()
    }

    fn loss(&mut self, batch: &Batch, pg: &ProcessGroup) -> Result<Tensor> {
        crate::loss_of_embedded_batch(self, batch, pg)
    }

    fn embedding(&mut self) -> Option<&mut dyn EmbeddingObjective> {
        Some(self)
    }

    fn expect_batch(&mut self, global_micro_batch: usize) -> Result<()> {
        self.queue.expect_batch(global_micro_batch)
    }

    /// The queue of past keys (`loss.queue`), when it holds any.
    fn buffers(&self) -> Result<Vec<(String, Tensor)>> {
        self.queue.buffers()
    }

    fn load_buffers(&mut self, buffers: &std::collections::HashMap<String, Tensor>) -> Result<()> {
        self.queue.load_buffers(buffers)
    }

    fn evaluate(&mut self, pg: &ProcessGroup) -> Result<Vec<(String, f64)>> {
        match &self.eval {
            Some((evaluator, tokenizer)) => evaluator.evaluate(self.encoder()?, tokenizer, self.model_cfg.pooling, pg),
            None => Ok(Vec::new()),
        }
    }
}

/// Embeddings `[n, views, d]`: each sample's sentences (unsupervised: the sentence twice,
/// views 0 and 1; supervised: anchor, positive and hard negative), their dropout masks keyed
/// by the global sample index, so a chunk embedded twice gets the same masks. (Gradient
/// caching: each chunk is padded to its own longest sentence; padded keys are masked out.)
impl EmbeddingObjective for SimCse {
    fn embed(&mut self, batch: &Batch, chunk: std::ops::Range<usize>, _pg: &ProcessGroup) -> Result<Tensor> {
        let part = batch.part(chunk);
        let b = part.indices.len();
        let views = if self.supervised { 3 } else { 2 };
        let mut rows = Vec::with_capacity(views * b);
        let mut keys = Vec::with_capacity(views * b);
        for v in 0..views {
            for &i in part.indices {
                let sample = self.tokens.get(i).ok_or_else(|| {
                    candle_core::Error::Msg(format!("simcse: sample {i} out of range ({} samples)", self.tokens.len()))
                })?;
                rows.push(sample[if self.supervised { v } else { 0 }].clone());
                keys.push((i as u64, v as u64));
            }
        }
        let tokens = TokenBatch::from_ids(rows, self.pad_id, &self.device)?;
        let key = DropoutKey { seed: part.seed, step: part.step as u64, rows: keys };
        let z = self.train_embeddings(&tokens, &key)?; // [views * b, d], view-major
        z.reshape((views, b, ()))?.transpose(0, 1)?.contiguous()
    }

    fn loss_of_embeddings(&mut self, z: &Tensor, _batch: &Batch, pg: &ProcessGroup) -> Result<Tensor> {
        // bf16 embeddings (autocast): the logits and the loss in f32.
        let z = &allgrad_nn::autocast::full(z)?;
        let view = |v: usize| z.i((.., v));
        let (a, p) = (view(0)?, view(1)?);
        let SimCseLoss { temperature: t, hard_negative_weight: w, .. } = self.loss_cfg;
        let tile = self.tiling.tile();
        if let (Some(tile), Some(queue)) = (tile, self.queue.queue()) {
            let n = if self.supervised { Some(view(2)?) } else { None };
            return info_nce_tiled_queued(&a, &p, n.as_ref(), t, w, tile, queue, pg);
        }
        match (self.supervised, tile) {
            (true, None) => info_nce_hard_negatives(&a, &p, &view(2)?, t, w, pg),
            (true, Some(tile)) => info_nce_hard_negatives_tiled(&a, &p, &view(2)?, t, w, tile, pg),
            (false, None) => info_nce(&a, &p, t, pg),
            (false, Some(tile)) => info_nce_tiled(&a, &p, t, tile, pg),
        }
    }
}
