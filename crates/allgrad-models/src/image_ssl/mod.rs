//! Self-supervised learning on images from two augmented views: SimCLR and BarlowTwins are
//! one method, [`TwoViewMethod`], parameterised by the loss that compares the views.
//!
//! - [`data`]: the `data` section (directory, format, augmentations, kNN monitor, loader).
//! - [`projector`]: the `model` section (ResNet encoder + projection MLP) and the projector.
//! - [`two_view`]: the data's two views of a batch (built ahead on loader threads) through
//!   the encoder and the projector.
//! - [`method`]: the [`crate::Objective`]: views, embeddings, the distributed loss.
//! - [`evaluation`]: kNN monitor and linear probe on the frozen encoder's features.
//!
//! The views of the coming batches are built ahead on loader threads (see
//! [`crate::Objective::plan`]) while the model computes; they are keyed by (seed, epoch,
//! global sample index, view), so prefetching changes nothing in the numbers.

pub mod data;
pub mod evaluation;
pub mod method;
pub mod projector;
pub mod two_view;

pub use data::{ImageData, ImageFormat, KnnConfig};
pub use evaluation::{knn_accuracy, linear_probe};
pub use method::{TwoViewMethod, ViewBatch};
pub use projector::{ImageModel, Projector, ProjectorConfig};
pub use two_view::TwoViewImages;
