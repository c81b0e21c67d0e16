//! The networks that turn a sample into an embedding: a linear map (synthetic vectors; tests
//! and smoke runs), the image methods' ResNet with arcface_torch's embedding layer
//! (BatchNorm → Dropout → FC → BatchNorm), or insightface's own IResNet and MobileFaceNet
//! under its parameter names ([`super::insightface`]).

use candle_core::{Result, Tensor};
use candle_nn::{Linear, VarBuilder};
use serde::{Deserialize, Serialize};

use super::forward_pass::dropout_mask;
pub use super::forward_pass::Pass;
use super::insightface::{self, Arch, InsightfaceConfig, InsightfaceNet};
use crate::batch_norm::BatchNorm;
use crate::resnet::{ResNet, ResNetConfig};
use crate::ModelError;

/// The `model` section of the face method.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum FaceModel {
    /// One linear layer from the input vectors to the embedding.
    Linear {
        /// Embedding width D.
        embedding: usize,
    },
    /// A ResNet encoder, then BN-Dropout-FC-BN to the embedding.
    Resnet {
        /// The encoder.
        #[serde(default)]
        encoder: ResNetConfig,
        /// Embedding width D (128 to 512 in face recognition).
        embedding: usize,
        /// Dropout before the FC layer (masks keyed by seed, step and global sample index).
        #[serde(default)]
        dropout: f64,
        /// A torchvision or timm ResNet safetensors file the encoder starts from (see
        /// [`crate::resnet_io::read_init`]).
        #[serde(default)]
        init_from: Option<std::path::PathBuf>,
    },
    /// insightface's IResNet with its embedding layers, under the names of its `backbone.pth`.
    Iresnet {
        /// 18, 34, 50, 100 or 200.
        depth: usize,
        /// Channels of the stem and the first stage (insightface: 64).
        #[serde(default = "width_64")]
        width: usize,
        /// Input channels (insightface: 3).
        #[serde(default = "rgb")]
        in_channels: usize,
        /// The faces' height and width, a multiple of 16 (insightface: 112).
        #[serde(default = "face_size")]
        input_size: usize,
        /// Embedding width (insightface: 512).
        #[serde(default = "embedding_512")]
        embedding: usize,
        /// Dropout before `fc` (masks keyed by seed, step and global sample index).
        #[serde(default)]
        dropout: f64,
        /// Synchronise the batch statistics across ranks (SyncBatchNorm).
        #[serde(default = "yes")]
        sync_bn: bool,
        /// A safetensors file of insightface's names to start from (see
        /// [`insightface::read_init`]).
        #[serde(default)]
        init_from: Option<std::path::PathBuf>,
    },
    /// insightface's MobileFaceNet, under the names of its `backbone.pth`.
    Mobilefacenet {
        /// The stem's channels are `64 * scale` (insightface's `get_mbf`: 2).
        #[serde(default = "scale_2")]
        scale: usize,
        /// Residual blocks of the four stacks (`get_mbf`: [1, 4, 6, 2]).
        #[serde(default = "mbf_blocks")]
        blocks: [usize; 4],
        /// Input channels (insightface: 3).
        #[serde(default = "rgb")]
        in_channels: usize,
        /// The faces' height and width, a multiple of 16 (insightface: 112).
        #[serde(default = "face_size")]
        input_size: usize,
        /// Embedding width (insightface: 512).
        #[serde(default = "embedding_512")]
        embedding: usize,
        /// Synchronise the batch statistics across ranks (SyncBatchNorm).
        #[serde(default = "yes")]
        sync_bn: bool,
        /// A safetensors file of insightface's names to start from.
        #[serde(default)]
        init_from: Option<std::path::PathBuf>,
    },
}

fn width_64() -> usize {
    64
}
fn rgb() -> usize {
    3
}
fn face_size() -> usize {
    112
}
fn embedding_512() -> usize {
    512
}
fn yes() -> bool {
    true
}
fn scale_2() -> usize {
    2
}
fn mbf_blocks() -> [usize; 4] {
    [1, 4, 6, 2]
}

impl FaceModel {
    /// The embedding width.
    pub fn embedding(&self) -> usize {
        match self {
            FaceModel::Linear { embedding }
            | FaceModel::Resnet { embedding, .. }
            | FaceModel::Iresnet { embedding, .. }
            | FaceModel::Mobilefacenet { embedding, .. } => *embedding,
        }
    }

    /// The insightface backbone's settings and `init_from`, for `kind: iresnet` and
    /// `mobilefacenet`.
    pub fn insightface(&self) -> Option<(InsightfaceConfig, Option<&std::path::PathBuf>)> {
        Some(match self {
            FaceModel::Iresnet { depth, width, in_channels, input_size, embedding, dropout, sync_bn, init_from } => (
                InsightfaceConfig {
                    arch: Arch::IResNet { depth: *depth, width: *width },
                    in_channels: *in_channels,
                    input_size: *input_size,
                    embedding: *embedding,
                    dropout: *dropout,
                    sync_bn: *sync_bn,
                },
                init_from.as_ref(),
            ),
            FaceModel::Mobilefacenet { scale, blocks, in_channels, input_size, embedding, sync_bn, init_from } => (
                InsightfaceConfig {
                    arch: Arch::MobileFaceNet { scale: *scale, blocks: *blocks },
                    in_channels: *in_channels,
                    input_size: *input_size,
                    embedding: *embedding,
                    dropout: 0.0,
                    sync_bn: *sync_bn,
                },
                init_from.as_ref(),
            ),
            _ => return None,
        })
    }

    /// Checks the values.
    pub fn validate(&self) -> std::result::Result<(), ModelError> {
        if self.embedding() == 0 {
            return Err(ModelError::HeadInput("model.embedding must be positive".into()));
        }
        if let Some((cfg, _)) = self.insightface() {
            cfg.validate()?;
        }
        if let FaceModel::Resnet { dropout, .. } = self {
            if !(0.0..1.0).contains(dropout) {
                return Err(ModelError::HeadInput(format!("model.dropout must be in [0, 1), got {dropout}")));
            }
        }
        Ok(())
    }
}

/// A built backbone (built once per run: the size difference of the variants does not matter).
#[allow(clippy::large_enum_variant)]
pub enum Backbone {
    /// See [`FaceModel::Linear`].
    Linear(Linear),
    /// See [`FaceModel::Resnet`].
    Resnet {
        /// The encoder.
        encoder: ResNet,
        /// BatchNorm on the encoder's features.
        bn1: BatchNorm,
        /// Dropout rate.
        dropout: f64,
        /// The FC layer.
        fc: Linear,
        /// BatchNorm on the embedding.
        bn2: BatchNorm,
    },
    /// See [`FaceModel::Iresnet`] and [`FaceModel::Mobilefacenet`].
    Insightface(InsightfaceNet),
}

impl Backbone {
    /// Creates the parameters (`linear.*`, `encoder.*` and `embedding.{bn1,fc,bn2}.*`, or
    /// insightface's names);
    /// `in_dim` is the input width of the linear backbone.
    pub fn new(model: &FaceModel, in_dim: usize, vb: VarBuilder) -> Result<Self> {
        model.validate()?;
        Ok(match model {
            FaceModel::Linear { embedding } => Backbone::Linear(candle_nn::linear(in_dim, *embedding, vb.pp("linear"))?),
            FaceModel::Resnet { encoder, embedding, dropout, init_from } => {
                let enc = crate::resnet_io::build_resnet(encoder, init_from.as_ref(), vb.pp("encoder"))?;
                let f = enc.feature_dim();
                let e = vb.pp("embedding");
                Backbone::Resnet {
                    bn1: BatchNorm::new(f, encoder.sync_bn, e.pp("bn1"))?,
                    fc: candle_nn::linear(f, *embedding, e.pp("fc"))?,
                    bn2: BatchNorm::new(*embedding, encoder.sync_bn, e.pp("bn2"))?,
                    encoder: enc,
                    dropout: *dropout,
                }
            }
            FaceModel::Iresnet { .. } | FaceModel::Mobilefacenet { .. } => {
                let (cfg, init_from) = model.insightface().expect("an insightface model");
                Backbone::Insightface(insightface::build(&cfg, init_from, vb)?)
            }
        })
    }

    /// Embeddings `[b, D]` of inputs `x` (`[b, in]` vectors or `[b, C, H, W]` images).
    pub fn forward(&self, x: &Tensor, pass: Pass) -> Result<Tensor> {
        match self {
            Backbone::Linear(l) => allgrad_nn::linear_module(l, x),
            Backbone::Resnet { encoder, bn1, dropout, fc, bn2 } => {
                let mut h = bn1.forward(&encoder.forward(x, pass.mode)?, pass.mode)?;
                if pass.mode.train && *dropout > 0.0 {
                    let mask = dropout_mask(h.dims2()?.1, *dropout, pass, h.device())?.to_dtype(h.dtype())?;
                    h = (h * mask)?;
                }
                bn2.forward(&allgrad_nn::linear_module(fc, &h)?, pass.mode)
            }
            Backbone::Insightface(net) => net.forward(x, pass),
        }
    }

    /// Every batch norm (for the checkpointed running statistics).
    pub fn batch_norms(&self) -> Vec<&BatchNorm> {
        match self {
            Backbone::Linear(_) => Vec::new(),
            Backbone::Resnet { encoder, bn1, bn2, .. } => encoder.batch_norms().into_iter().chain([bn1, bn2]).collect(),
            Backbone::Insightface(net) => net.batch_norms(),
        }
    }
}
