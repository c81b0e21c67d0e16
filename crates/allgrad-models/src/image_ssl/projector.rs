//! The `model` section of the image methods (a ResNet encoder and a projection MLP) and the
//! projector itself.

use candle_core::{Result, Tensor};
use candle_nn::{Linear, VarBuilder};
use serde::{Deserialize, Serialize};

use crate::batch_norm::{BatchNorm, BnTail, Mode};
use crate::error::fail;
use crate::resnet::ResNetConfig;
use crate::ModelError;

/// The `model` section of the image methods.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct ImageModel {
    /// The encoder.
    pub encoder: ResNetConfig,
    /// The projection head.
    pub projector: ProjectorConfig,
    /// A torchvision or timm ResNet safetensors file the encoder starts from (parameters and
    /// running statistics; `fc.*` is ignored): see [`crate::resnet_io::read_init`].
    pub init_from: Option<std::path::PathBuf>,
}

/// The projection MLP: `layers` linear layers with ReLU between them (2: SimCLR v1,
/// Linear-ReLU-Linear; 3 or more: batch norm after every hidden layer, as in SimCLR v2 and
/// BarlowTwins' Linear-BN-ReLU-Linear-BN-ReLU-Linear). Its batch norms are synchronised
/// when the encoder's are (`encoder.sync_bn`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ProjectorConfig {
    /// Hidden width (0: the encoder's feature width).
    pub hidden: usize,
    /// Output width.
    pub out: usize,
    /// Number of linear layers, at least 2.
    pub layers: usize,
    /// Whether the linear layers have biases (a bias before a batch norm has no effect).
    pub bias: bool,
}

impl Default for ProjectorConfig {
    fn default() -> Self {
        ProjectorConfig { hidden: 0, out: 128, layers: 2, bias: true }
    }
}

impl ProjectorConfig {
    /// Checks the shape: at least 2 layers and a positive output width.
    pub fn validate(&self) -> Result<()> {
        if self.layers < 2 || self.out == 0 {
            return fail(ModelError::Projector { layers: self.layers, out: self.out });
        }
        Ok(())
    }
}

/// The projection MLP of [`ProjectorConfig`]; parameters `<i>.linear.*` and `<i>.bn.*`.
pub struct Projector {
    layers: Vec<(Linear, Option<BatchNorm>)>,
}

impl Projector {
    /// The batch norms of the hidden layers, in order.
    pub fn batch_norms(&self) -> impl Iterator<Item = &BatchNorm> {
        self.layers.iter().filter_map(|(_, bn)| bn.as_ref())
    }

    /// Creates the layers on `input`-wide features; `sync` synchronises the batch norms.
    pub fn new(cfg: &ProjectorConfig, input: usize, sync: bool, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        let hidden = if cfg.hidden == 0 { input } else { cfg.hidden };
        let mut layers = Vec::new();
        let mut cin = input;
        for i in 0..cfg.layers {
            let last = i + 1 == cfg.layers;
            let cout = if last { cfg.out } else { hidden };
            let vbl = vb.pp(i.to_string());
            let bn = (cfg.layers >= 3 && !last).then(|| BatchNorm::new(cout, sync, vbl.pp("bn"))).transpose()?;
            let linear = if cfg.bias {
                candle_nn::linear(cin, cout, vbl.pp("linear"))?
            } else {
                candle_nn::linear_no_bias(cin, cout, vbl.pp("linear"))?
            };
            layers.push((linear, bn));
            cin = cout;
        }
        Ok(Projector { layers })
    }

    /// The projection of `x` (`[N, input]`).
    pub fn forward(&self, x: &Tensor, mode: Mode) -> Result<Tensor> {
        let mut h = x.clone();
        let n = self.layers.len();
        for (i, (lin, bn)) in self.layers.iter().enumerate() {
            h = allgrad_nn::linear_module(lin, &h)?;
            let hidden = i + 1 < n;
            h = match (bn, hidden) {
                (Some(bn), true) => bn.forward_then(&h, mode, BnTail::Relu)?,
                (Some(bn), false) => bn.forward(&h, mode)?,
                (None, true) => allgrad_nn::relu(&h)?,
                (None, false) => h,
            };
        }
        Ok(h)
    }
}
