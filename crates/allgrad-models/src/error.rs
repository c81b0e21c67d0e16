//! The errors of allgrad-models: one variant per misuse, carrying the key, the path or the
//! numbers. They convert into `candle_core::Error` where the [`crate::Objective`] and layer
//! APIs return `candle_core::Result`.

use std::path::PathBuf;

use allgrad_data::DataError;

/// A misuse of a model, loss or method of allgrad-models.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The data set in `data.dir` could not be opened.
    #[error("data.dir {}: {source}", dir.display())]
    OpenData {
        /// The directory.
        dir: PathBuf,
        /// Why.
        source: DataError,
    },
    /// The augmentations of `data.augment` are invalid.
    #[error("data.augment: {0}")]
    Augment(DataError),
    /// Reading a sample or building its views failed.
    #[error(transparent)]
    Data(#[from] DataError),
    /// An objective was used before [`crate::Objective::build`] created its parameters.
    #[error("{objective} objective used before build")]
    NotBuilt {
        /// The objective.
        objective: &'static str,
    },
    /// `model.projector` has fewer than 2 layers or no output width.
    #[error("model.projector: layers must be at least 2 and out positive (got {layers} and {out})")]
    Projector {
        /// Linear layers asked for.
        layers: usize,
        /// Output width asked for.
        out: usize,
    },
    /// A ResNet depth other than 18, 34 or 50.
    #[error("model.depth must be 18, 34 or 50, got {0}")]
    ResNetDepth(usize),
    /// `model.init_from` names a file that is not a torchvision / timm ResNet of the
    /// encoder's shape.
    #[error("model.init_from {}: {detail}", path.display())]
    InitFrom {
        /// The file.
        path: PathBuf,
        /// What does not match.
        detail: String,
    },
    /// A ResNet of width 0, or with other than 1 or 3 input channels.
    #[error("model.width must be positive and model.in_channels 1 or 3 (got {width} and {in_channels})")]
    ResNetShape {
        /// The width asked for.
        width: usize,
        /// The input channels asked for.
        in_channels: usize,
    },
    /// A batch norm's input does not have its channels on dim 1.
    #[error("batch norm over {channels} channels got an input of shape {shape:?}")]
    BatchNormInput {
        /// The layer's channels.
        channels: usize,
        /// The input's shape.
        shape: Vec<usize>,
    },
    /// A batch norm's eps is not positive or its momentum not in [0, 1].
    #[error("batch norm: eps must be positive and momentum in [0, 1] (got {eps} and {momentum})")]
    BatchNormConfig {
        /// The eps asked for.
        eps: f64,
        /// The momentum asked for.
        momentum: f64,
    },
    /// The two views' embeddings of a two-view loss differ in shape or are not `[b, d]`.
    #[error("{loss}: the two views must be [b, d] of the same shape, got {z1:?} and {z2:?}")]
    ViewShapes {
        /// The loss.
        loss: &'static str,
        /// The first view's shape.
        z1: Vec<usize>,
        /// The second view's shape.
        z2: Vec<usize>,
    },
    /// A loss parameter out of its range.
    #[error("loss.{key} must be {expected}, got {value}")]
    LossValue {
        /// The key in the `loss` section.
        key: &'static str,
        /// The range, in words.
        expected: &'static str,
        /// The value given.
        value: f64,
    },
    /// A key of the `loss` section that cannot be used as given (`loss.tile`).
    #[error("{msg}")]
    LossKey {
        /// The key in the `loss` section.
        key: &'static str,
        /// What is wrong, naming `loss.<key>`, the value and what to do.
        msg: String,
    },
    /// The redundancy-reduction loss got a matrix that is not square.
    #[error("redundancy_reduction: expected a square matrix, got {shape:?}")]
    NotSquare {
        /// Its shape.
        shape: Vec<usize>,
    },
    /// The cross-correlation needs at least 2 samples in the global batch.
    #[error("cross_correlation: the global batch needs at least 2 samples, got {rows}")]
    GlobalBatchTooSmall {
        /// Rows of the global batch.
        rows: usize,
    },
    /// The vectors objective got a zero size.
    #[error(
        "vectors objective: samples, dim, clusters, hidden and out must all be positive \
         (data.samples {samples}, data.dim {dim}, data.clusters {clusters}, model.hidden {hidden}, model.out {out})"
    )]
    VectorSizes {
        /// `data.samples`.
        samples: usize,
        /// `data.dim`.
        dim: usize,
        /// `data.clusters`.
        clusters: usize,
        /// `model.hidden`.
        hidden: usize,
        /// `model.out`.
        out: usize,
    },
    /// A value of the face head's section out of its range.
    #[error("head.{key} must be {expected}, got {value}")]
    HeadValue {
        /// The key in the `head` section.
        key: &'static str,
        /// The value given.
        value: f64,
        /// The range, in words.
        expected: &'static str,
    },
    /// An input of a tiled loss that does not fit (shapes, special columns, the tile).
    #[error("tiled loss: {0}")]
    TiledInput(String),
    /// A face-head input that does not fit the head (shapes, labels, world size).
    #[error("face head: {0}")]
    HeadInput(String),
    /// A key of the face head's section that does not fit another.
    #[error("head.{key}: {reason}")]
    HeadKey {
        /// The key in the `head` section.
        key: &'static str,
        /// What does not fit, and what does.
        reason: String,
    },
    /// A key of the `model` section that does not fit (insightface's face backbones).
    #[error("model.{key}: {reason}")]
    ModelKey {
        /// The key in the `model` section.
        key: &'static str,
        /// What does not fit, and what does.
        reason: String,
    },
}

impl From<ModelError> for candle_core::Error {
    fn from(e: ModelError) -> Self {
        candle_core::Error::wrap(e)
    }
}

/// `Err(e.into())` for the `candle_core::Result`-returning APIs.
pub(crate) fn fail<T>(e: ModelError) -> candle_core::Result<T> {
    Err(e.into())
}
