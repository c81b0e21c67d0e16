//! ResNet-18/34/50 encoders (no classifier), with a CIFAR stem (3x3 conv, no pooling) for
//! small images or the ImageNet stem (7x7/2 conv, 3x3/2 max-pool), a configurable width, and
//! batch norm that is synchronised across ranks when asked. Convolutions and pooling use
//! allgrad-nn's kernels (fast on CPU, with a backward for every stride).

use allgrad_nn::{adaptive_avg_pool2d, max_pool2d, Conv2d, ConvParams};
use candle_core::{Result, Tensor};
use candle_nn::{Module, VarBuilder};
use serde::{Deserialize, Serialize};

use crate::batch_norm::{BatchNorm, BnTail, Mode};
use crate::error::fail;
use crate::ModelError;

/// The `model` section for a ResNet encoder.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ResNetConfig {
    /// 18, 34 or 50.
    pub depth: usize,
    /// Channels of the first stage (64 in the original; smaller trains faster on a CPU).
    pub width: usize,
    /// Input channels (1 for grayscale, 3 for colour).
    pub in_channels: usize,
    /// `cifar`: 3x3 stride-1 conv, no pooling; `imagenet`: 7x7 stride-2 conv and 3x3/2 max-pool.
    pub stem: Stem,
    /// Synchronise batch statistics across ranks (SyncBatchNorm).
    pub sync_bn: bool,
}

/// The first layers of a ResNet.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Stem {
    /// For 32x32-sized images.
    Cifar,
    /// For 224x224-sized images.
    Imagenet,
}

impl Default for ResNetConfig {
    fn default() -> Self {
        ResNetConfig { depth: 18, width: 64, in_channels: 3, stem: Stem::Cifar, sync_bn: true }
    }
}

/// A bias-free `k x k` convolution (`<name>.weight`) followed by a batch norm (`<bn>.*`).
struct ConvBn {
    conv: Conv2d,
    bn: BatchNorm,
}

impl ConvBn {
    fn new(cin: usize, cout: usize, k: usize, stride: usize, sync: bool, vb: VarBuilder, [name, bn]: [&str; 2]) -> Result<Self> {
        let params = ConvParams { stride, padding: k / 2, ..Default::default() };
        let conv = Conv2d::from_vb(cin, cout, k, params, false, vb.pp(name))?;
        Ok(ConvBn { conv, bn: BatchNorm::new(cout, sync, vb.pp(bn))? })
    }
    /// The convolution, the batch norm and `tail` (the batch norm and its tail fused on the CPU).
    fn forward(&self, x: &Tensor, mode: Mode, tail: BnTail) -> Result<Tensor> {
        self.bn.forward_then(&self.conv.forward(x)?, mode, tail)
    }
}

enum Block {
    Basic { a: ConvBn, b: ConvBn, down: Option<ConvBn> },
    Bottleneck { a: ConvBn, b: ConvBn, c: ConvBn, down: Option<ConvBn> },
}

impl Block {
    fn forward(&self, x: &Tensor, mode: Mode) -> Result<Tensor> {
        let (Block::Basic { down, .. } | Block::Bottleneck { down, .. }) = self;
        // The shortcut's convolution first (as torchvision orders the layers); the last batch
        // norm of the block adds the shortcut in its fused `relu(bn(·) + skip)`, and a
        // downsampling shortcut's batch norm is fused into it too (`forward_add_shortcut`), so
        // that its output is never stored.
        let shortcut = down.as_ref().map(|d| Ok::<_, candle_core::Error>((d, d.conv.forward(x)?))).transpose()?;
        let (last, h) = match self {
            Block::Basic { a, b, .. } => (b, a.forward(x, mode, BnTail::Relu)?),
            Block::Bottleneck { a, b, c, .. } => (c, b.forward(&a.forward(x, mode, BnTail::Relu)?, mode, BnTail::Relu)?),
        };
        let pre = last.conv.forward(&h)?;
        match shortcut {
            Some((d, xd)) => last.bn.forward_add_shortcut(&pre, mode, &d.bn, &xd),
            None => last.bn.forward_then(&pre, mode, BnTail::AddRelu(x)),
        }
    }
}

/// A ResNet encoder: images `[N, C, H, W]` to features `[N, feature_dim]`.
pub struct ResNet {
    stem: ConvBn,
    pool: bool,
    blocks: Vec<Block>,
    feature_dim: usize,
}

impl ResNet {
    /// Builds the encoder; parameter names follow torchvision's (`conv1`, `bn1`, `layer1.0.conv1`, ...).
    pub fn new(cfg: &ResNetConfig, vb: VarBuilder) -> Result<Self> {
        let (counts, bottleneck) = match cfg.depth {
            18 => ([2, 2, 2, 2], false),
            34 => ([3, 4, 6, 3], false),
            50 => ([3, 4, 6, 3], true),
            d => return fail(ModelError::ResNetDepth(d)),
        };
        if cfg.width == 0 || !(cfg.in_channels == 1 || cfg.in_channels == 3) {
            return fail(ModelError::ResNetShape { width: cfg.width, in_channels: cfg.in_channels });
        }
        let s = cfg.sync_bn;
        let (k, stride) = match cfg.stem {
            Stem::Cifar => (3, 1),
            Stem::Imagenet => (7, 2),
        };
        let stem = ConvBn::new(cfg.in_channels, cfg.width, k, stride, s, vb.clone(), ["conv1", "bn1"])?;
        let expansion = if bottleneck { 4 } else { 1 };
        let mut cin = cfg.width;
        let mut blocks = Vec::new();
        for (stage, &n) in counts.iter().enumerate() {
            let planes = cfg.width << stage;
            for i in 0..n {
                let vbb = vb.pp(format!("layer{}.{i}", stage + 1));
                let stride = if stage > 0 && i == 0 { 2 } else { 1 };
                let cout = planes * expansion;
                let down = if stride != 1 || cin != cout {
                    Some(ConvBn::new(cin, cout, 1, stride, s, vbb.pp("downsample"), ["0", "1"])?)
                } else {
                    None
                };
                blocks.push(if bottleneck {
                    Block::Bottleneck {
                        a: ConvBn::new(cin, planes, 1, 1, s, vbb.clone(), ["conv1", "bn1"])?,
                        b: ConvBn::new(planes, planes, 3, stride, s, vbb.clone(), ["conv2", "bn2"])?,
                        c: ConvBn::new(planes, cout, 1, 1, s, vbb.clone(), ["conv3", "bn3"])?,
                        down,
                    }
                } else {
                    Block::Basic {
                        a: ConvBn::new(cin, planes, 3, stride, s, vbb.clone(), ["conv1", "bn1"])?,
                        b: ConvBn::new(planes, planes, 3, 1, s, vbb.clone(), ["conv2", "bn2"])?,
                        down,
                    }
                });
                cin = cout;
            }
        }
        Ok(ResNet { stem, pool: cfg.stem == Stem::Imagenet, blocks, feature_dim: cin })
    }

    /// Every batch norm of the encoder, in layer order.
    pub fn batch_norms(&self) -> Vec<&BatchNorm> {
        let mut out = vec![&self.stem.bn];
        for b in &self.blocks {
            let convs: Vec<&ConvBn> = match b {
                Block::Basic { a, b, down } => [Some(a), Some(b), down.as_ref()].into_iter().flatten().collect(),
                Block::Bottleneck { a, b, c, down } => [Some(a), Some(b), Some(c), down.as_ref()].into_iter().flatten().collect(),
            };
            out.extend(convs.into_iter().map(|c| &c.bn));
        }
        out
    }

    /// Width of the output features.
    pub fn feature_dim(&self) -> usize {
        self.feature_dim
    }

    /// Features of a batch of images.
    pub fn forward(&self, x: &Tensor, mode: Mode) -> Result<Tensor> {
        let mut h = self.stem.forward(x, mode, BnTail::Relu)?;
        if self.pool {
            h = max_pool2d(&h, 3, 2, 1)?;
        }
        for b in &self.blocks {
            h = b.forward(&h, mode)?;
        }
        adaptive_avg_pool2d(&h, 1)?.flatten_from(1)
    }
}
