//! SimCSE: contrastive sentence embeddings from a BERT encoder, unsupervised (dropout as
//! the augmentation) and supervised (triplets with hard negatives), with the loss over the
//! global batch ([`info_nce`], [`info_nce_hard_negatives`], and their tiled forms
//! [`info_nce_tiled`], [`info_nce_hard_negatives_tiled`] for `loss.tile`); readers of SimCSE's files
//! ([`read_sentences`], [`read_nli_triplets`]) and [`spearman`] for similarity benchmarks.

mod config;
mod data;
mod eval_data;
mod evaluation;
mod info_nce;
mod objective;
mod spearman;

pub use config::{SimCseData, SimCseLoss, SimCseModel};
pub use data::{read_nli_triplets, read_sentences};
pub use eval_data::{read_lee, read_retrieval, read_sts_tsv, read_word_pairs, RatedPairs, Retrieval};
pub use evaluation::{rated_spearman, retrieval_scores, Evaluator, SimCseEval};
pub use info_nce::{info_nce, info_nce_hard_negatives, info_nce_hard_negatives_tiled, info_nce_tiled, info_nce_tiled_queued};
pub use objective::SimCse;
pub use spearman::{ranks, spearman};
