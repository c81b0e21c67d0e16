//! Errors of the trainer. Every variant says what failed, where (file, key path, step,
//! parameter) and, where it helps, what to do about it.

use std::path::PathBuf;

use crate::config::ConfigError;

/// Result alias of this crate's public functions.
pub type TrainResult<T> = std::result::Result<T, TrainError>;

/// What can go wrong while building, running, checkpointing or resuming a training run.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The run configuration is invalid (names the file and the key path).
    #[error(transparent)]
    Config(#[from] ConfigError),

    /// The objective and the trainer settings do not fit together (batch versus data set
    /// size, world size, an objective without parameters, ...).
    #[error("cannot set up the run: {0}")]
    Setup(String),

    /// Reading or writing a checkpoint failed.
    #[error("checkpoint {path}: {action} failed: {cause} (the previous checkpoint named by checkpoints/latest is untouched)")]
    Checkpoint {
        /// The checkpoint file or directory.
        path: PathBuf,
        /// What was being done (`writing model.safetensors`, `reading state.json`, ...).
        action: String,
        /// Why it failed.
        cause: String,
    },

    /// A checkpoint exists but cannot be resumed by this run (other seed, missing or
    /// differently shaped tensor, other world size for sharded parameters).
    #[error("checkpoint {path} does not fit this run: {reason}")]
    CheckpointMismatch {
        /// The checkpoint directory.
        path: PathBuf,
        /// What differs, with both values, and what to do.
        reason: String,
    },

    /// The loss or the gradients were not finite at a step, with `train.on_nonfinite: error`.
    #[error(
        "non-finite {what} at step {step} (loss {loss}, gradient norm {grad_norm}{}); stopping \
         (lower optim.lr, set train.clip_grad_norm, or set train.on_nonfinite: skip to skip such steps)",
        parameter.as_ref().map(|p| format!(", first non-finite gradient in {p}")).unwrap_or_default()
    )]
    NonFinite {
        /// `loss` or `gradient`.
        what: &'static str,
        /// The step (from 1) whose update was refused.
        step: usize,
        /// The mean loss over ranks.
        loss: f64,
        /// The global gradient norm.
        grad_norm: f64,
        /// The first parameter (in name order) with a non-finite gradient, if any.
        parameter: Option<String>,
    },

    /// A parameter held non-finite values when a checkpoint was due; nothing was written.
    #[error("parameter {parameter} is not finite after step {step}; checkpoint not written (lower optim.lr or set train.clip_grad_norm)")]
    NonFiniteParameter {
        /// The step just completed.
        step: usize,
        /// The parameter's name.
        parameter: String,
    },

    /// Gradient caching (`train.cache_chunk`): a chunk embedded the second time differs from
    /// its first embedding, so the cached gradient would be wrong (see
    /// [`crate::grad_cache`]).
    #[error(
        "train.cache_chunk: at step {step}, chunk {chunk} (samples {rows:?} of the rank's micro-batch) embedded again \
         differs from its first embedding by {diff:.3e} (largest value {scale:.3e}): the objective's randomness is not \
         replayed; key dropout and augmentations by (seed, step or epoch, global sample index, view), or remove \
         train.cache_chunk"
    )]
    CacheReplay {
        /// The step (from 1).
        step: usize,
        /// The chunk's number in the micro-batch, from 0.
        chunk: usize,
        /// Its samples (positions in the rank's micro-batch).
        rows: std::ops::Range<usize>,
        /// Largest absolute difference between the two embeddings.
        diff: f64,
        /// Largest absolute value of the first embedding.
        scale: f64,
    },

    /// A file of the run directory (metrics, config copy, plot) could not be written.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// A collective of the trainer's own (loss average, gradient norm) failed.
    #[error(transparent)]
    Dist(#[from] allgrad_dist::DistError),

    /// The objective, the model or a collective failed (the message names the layer or
    /// the rank).
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl TrainError {
    /// A checkpoint error from any displayable cause.
    pub fn checkpoint(path: impl Into<PathBuf>, action: impl Into<String>, cause: impl std::fmt::Display) -> Self {
        TrainError::Checkpoint { path: path.into(), action: action.into(), cause: cause.to_string() }
    }
}

impl From<TrainError> for candle_core::Error {
    fn from(e: TrainError) -> Self {
        match e {
            TrainError::Candle(e) => e,
            e => candle_core::Error::wrap(e),
        }
    }
}
