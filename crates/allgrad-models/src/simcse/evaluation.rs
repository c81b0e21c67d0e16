//! SimCSE's evaluation: held-out WordNet retrieval (top-1, MRR) and Spearman correlations
//! with human ratings (Lee et al. 2005 documents, SimLex-999, WordSim-353, STS-B), on the
//! encoder's pooled embeddings without the training head, dropout off. The texts are split
//! over the ranks and the embeddings gathered, so every rank returns the same figures.
//!
//! A benchmark whose files are absent is skipped with a logged reason (the gensim files are
//! fetched by `scripts/data/get_text_eval.sh`); a file that is present but malformed is an error.

use std::path::{Path, PathBuf};

use allgrad_dist::ProcessGroup;
use candle_core::{Result, Tensor};
use serde::{Deserialize, Serialize};

use super::eval_data::{read_lee, read_retrieval, read_sts_tsv, read_word_pairs, RatedPairs, Retrieval};
use super::spearman::spearman;
use crate::bert::{cosine_matrix, embed_ids, BertModel, BertTokenizer, Pooling};

/// The evaluation settings of a SimCSE run (the `eval` section).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SimCseEval {
    /// Held-out retrieval split (`retrieval.tsv` of `scripts/data/build_wordnet_text.py`).
    pub retrieval: Option<PathBuf>,
    /// gensim's test data folder (`lee.cor`, `similarities0-1.txt`, `simlex999.txt`,
    /// `wordsim353.tsv`); each benchmark whose files are missing is skipped.
    pub similarity_dir: Option<PathBuf>,
    /// An STS-B file in TSV ([`super::read_sts_tsv`]).
    pub sts: Option<PathBuf>,
    /// Evaluation sequences are truncated to this many tokens (may exceed training's).
    pub max_len: usize,
    /// Sequences per forward pass.
    pub batch: usize,
}

impl Default for SimCseEval {
    fn default() -> Self {
        SimCseEval { retrieval: None, similarity_dir: None, sts: None, max_len: 128, batch: 64 }
    }
}

/// The benchmarks of a [`SimCseEval`], read once.
#[derive(Clone, Debug)]
pub struct Evaluator {
    retrieval: Option<Retrieval>,
    rated: Vec<(&'static str, RatedPairs)>,
    batch: usize,
}

/// Whether every file exists; if not, logs why `name` is skipped.
fn present(name: &str, files: &[&Path]) -> bool {
    match files.iter().find(|f| !f.is_file()) {
        None => true,
        Some(f) => {
            tracing::warn!(target: allgrad_dist::JOB_LOG, "simcse evaluation: {name} skipped: {} is absent", f.display());
            false
        }
    }
}

impl Evaluator {
    /// Reads the configured benchmarks; absent files skip theirs with a logged reason.
    pub fn load(cfg: &SimCseEval) -> Result<Self> {
        if cfg.batch == 0 {
            candle_core::bail!("simcse: eval.batch must be at least 1");
        }
        let mut retrieval = None;
        if let Some(p) = cfg.retrieval.as_deref().filter(|p| present("wordnet retrieval", &[*p])) {
            retrieval = Some(read_retrieval(p)?);
        }
        let mut rated = Vec::new();
        if let Some(dir) = &cfg.similarity_dir {
            let (cor, sim) = (dir.join("lee.cor"), dir.join("similarities0-1.txt"));
            if present("lee", &[cor.as_path(), sim.as_path()]) {
                rated.push(("lee_spearman", read_lee(&cor, &sim)?));
            }
            for (name, file) in [("simlex_spearman", "simlex999.txt"), ("wordsim_spearman", "wordsim353.tsv")] {
                let p = dir.join(file);
                if present(name, &[p.as_path()]) {
                    rated.push((name, read_word_pairs(&p)?));
                }
            }
        }
        if let Some(p) = cfg.sts.as_deref().filter(|p| present("sts", &[*p])) {
            rated.push(("sts_spearman", read_sts_tsv(p)?));
        }
        Ok(Evaluator { retrieval, rated, batch: cfg.batch })
    }

    /// Whether any benchmark is loaded.
    pub fn is_empty(&self) -> bool {
        self.retrieval.is_none() && self.rated.is_empty()
    }

    /// The figures (name, value) of `model` with `pooling`: `wordnet_top1`, `wordnet_mrr`
    /// and one `*_spearman` per loaded rated set. Collective: every rank must call it.
    pub fn evaluate(
        &self,
        model: &BertModel,
        tokenizer: &BertTokenizer,
        pooling: Pooling,
        pg: &ProcessGroup,
    ) -> Result<Vec<(String, f64)>> {
        let mut out = Vec::new();
        if let Some(r) = &self.retrieval {
            let q = embed_shared(model, tokenizer, pooling, &r.sentences, self.batch, pg)?;
            let g = embed_shared(model, tokenizer, pooling, &r.glosses, self.batch, pg)?;
            let (top1, mrr) = retrieval_scores(&cosine_matrix(&q, &g)?);
            out.push(("wordnet_top1".to_string(), top1));
            out.push(("wordnet_mrr".to_string(), mrr));
        }
        for (name, set) in &self.rated {
            let e = embed_shared(model, tokenizer, pooling, &set.texts, self.batch, pg)?;
            match rated_spearman(&cosine_matrix(&e, &e)?, set) {
                Some(s) => out.push((name.to_string(), s)),
                None => {
                    tracing::warn!(target: allgrad_dist::JOB_LOG, "simcse evaluation: {name} undefined (constant similarities or ratings)")
                }
            }
        }
        Ok(out)
    }
}

/// Embeddings of `texts` (in order) on every rank: rank r embeds the r-th contiguous part.
fn embed_shared(
    model: &BertModel,
    tokenizer: &BertTokenizer,
    pooling: Pooling,
    texts: &[String],
    batch: usize,
    pg: &ProcessGroup,
) -> Result<Tensor> {
    let (w, r) = (pg.world_size(), pg.rank());
    let (lo, hi) = (texts.len() * r / w, texts.len() * (r + 1) / w);
    let ids = texts[lo..hi].iter().map(|t| tokenizer.encode(t)).collect::<Result<Vec<_>>>()?;
    let local = embed_ids(model, tokenizer.pad_id(), pooling, &ids, batch)?;
    if w == 1 {
        return Ok(local);
    }
    Ok(pg.all_gather_with_sizes(&local.contiguous()?)?.0)
}

/// (top-1 accuracy, mean reciprocal rank) of a query x candidate similarity matrix whose
/// correct candidate for query i is i. Ties count against the query (a rank is 1 + the
/// number of candidates scoring at least as high, other than the correct one).
pub fn retrieval_scores(sim: &[Vec<f64>]) -> (f64, f64) {
    let n = sim.len() as f64;
    let (mut top1, mut mrr) = (0.0, 0.0);
    for (i, row) in sim.iter().enumerate() {
        let rank = 1 + row.iter().enumerate().filter(|&(j, s)| j != i && *s >= row[i]).count();
        top1 += (rank == 1) as u8 as f64;
        mrr += 1.0 / rank as f64;
    }
    (top1 / n, mrr / n)
}

/// Spearman's correlation of the pairs' cosine similarities (from `sim`, indexed by text)
/// with their ratings.
pub fn rated_spearman(sim: &[Vec<f64>], set: &RatedPairs) -> Option<f64> {
    let model: Vec<f64> = set.pairs.iter().map(|&(i, j, _)| sim[i][j]).collect();
    let human: Vec<f64> = set.pairs.iter().map(|&(_, _, s)| s).collect();
    spearman(&model, &human)
}
