//! Face recognition at scale: a classification head over so many identities that its
//! centres are sharded across ranks, trained with a margin softmax.
//!
//! - [`shard`]: rank r holds the centres of a contiguous range of global class ids
//!   ([`RowRange`], `C % W` need not be 0), initialised per class from (seed, class id), so
//!   the centres do not depend on W.
//! - [`head::FaceHead`]: embeddings are L2-normalised and gathered with the differentiable
//!   all_gather (labels with a plain one); every rank scores the whole global batch against
//!   its (sampled) centres, applies the [`margin`] to the target logit and computes the
//!   [`softmax::parallel_cross_entropy`]. No rank holds the C-wide logits.
//! - [`sampling`]: Partial FC, the positives of the global batch plus negatives sampled by
//!   a hash of (seed, step, class id); only sampled rows get a gradient. With
//!   `head.update: sparse` (the default) the head reads the sampled rows into a leaf of
//!   their own, so the backward forms their gradient only, as row ids and rows
//!   ([`FaceHead::sparse_rows`], reported to the trainer by
//!   [`crate::Objective::sparse_rows`]). The other rows are updated as a dense step with a
//!   zero gradient would update them (`head.unsampled: decay`, the default: weight decay
//!   and momentum move them; the optimizer applies those steps lazily, exactly), or keep
//!   value and state (`frozen`, [`FaceHead::updated_rows`], reported by
//!   [`crate::Objective::updated_rows`]).
//!
//! # The gradient rule, and insightface's `* world_size`
//!
//! The loss is the same number on every rank (the global-batch mean). With the sum-rule
//! collectives (the sum rule, docs/gradient-convention.md) the backward of rank r yields `W · ∂L/∂x_r`; the trainer's 1/W
//! gives the single-process gradient for the centres (which are not communicated) and, after
//! the DDP sum, for the backbone. insightface's `arcface_torch` reaches the same numbers by
//! another route: its cross-entropy's backward gives each rank `∂L/∂z_r` (not W times it),
//! its gather's backward multiplies by W, and DDP averages. Both are tested equal in
//! `tests/models/face_head.rs`, as is the 1/W error without the factor.

pub mod backbone;
pub mod data;
pub mod forward_pass;
pub mod head;
pub mod insightface;
pub mod margin;
pub mod normalize;
pub mod objective;
pub mod sampling;
pub mod shard;
pub mod softmax;
pub mod verification;

pub use backbone::FaceModel;
pub use data::{FaceData, RecordIoData, SyntheticFaces};
pub use head::{CentreStorage, CentreUpdate, FaceHead, HeadConfig, Unsampled};
pub use margin::{Margin, MarginConfig};
pub use objective::{EvalConfig, FaceObjective, VerifyConfig, CENTRES_PARAM};
pub use shard::RowRange;
