//! insightface's face backbones, as its `arcface_torch` trains them, under the parameter names
//! of its `backbone.pth` state dicts: IResNet (`model.kind: iresnet`, depths 18, 34, 50, 100
//! and 200) and MobileFaceNet (`model.kind: mobilefacenet`).
//!
//! - **IResNet**: a 3x3 convolution (`conv1`), batch norm (`bn1`) and PReLU (`prelu`); four
//!   stages `layer1`..`layer4` of `IBasicBlock`s (`bn1`, 3x3 `conv1`, `bn2`, `prelu`, 3x3
//!   `conv2` carrying the stage's stride 2, `bn3`, plus the input, through `downsample.0` (1x1
//!   convolution) and `downsample.1` (batch norm) in a stage's first block); then the embedding
//!   layers: `bn2` (BatchNorm2d), dropout, flatten, `fc` (a linear layer from the `C x 7 x 7`
//!   map of a 112x112 face) and `features` (BatchNorm1d whose weight is held at 1, as
//!   insightface sets and freezes it; only its bias and statistics are learnt). Stage widths
//!   64, 128, 256, 512 (`width` scales them; insightface's is 64).
//! - **MobileFaceNet**: `layers.0` a stride-2 3x3 ConvBlock (convolution, batch norm, PReLU:
//!   `layers.<i>.layers.{0,1,2}`), `layers.1` a grouped ConvBlock (or a stack of residual
//!   depthwise blocks), then depthwise blocks (1x1 ConvBlock, depthwise 3x3 ConvBlock, 1x1
//!   LinearBlock: convolution and batch norm) and their residual stacks in `layers.2`..`layers.7`,
//!   `conv_sep` (1x1 ConvBlock to 512 channels) and `features`, the global depthwise
//!   convolution (`features.layers.0`, a 7x7 LinearBlock on the 7x7 map), a bias-free linear
//!   layer (`features.layers.2`) and BatchNorm1d (`features.layers.3`).
//!
//! [`layout`] lists a configuration's state dict (names, shapes, and what each entry holds)
//! from the network itself, built over a backend that records the parameters it is asked
//! for; [`read_init`] checks a safetensors file against it (`model.init_from`), [`build`]
//! builds the network from it, and [`export`] writes a checkpoint back under the same names.
//! The inputs are faces of `input_size` pixels (112 in insightface: the map before the
//! embedding is `input_size / 16` pixels wide); smaller sizes, widths and 1 input channel
//! train faster on a CPU and have no insightface counterpart.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use allgrad_nn::{prelu, Conv2d, ConvParams};
use candle_core::{DType, Device, Result, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, Linear, Module, VarBuilder};

use super::forward_pass::{dropout_mask, Pass};
use crate::batch_norm::{BatchNorm, Mode};
use crate::resnet_io::{layout_mismatch, Preloaded};
use crate::ModelError;

/// Which of insightface's networks, with its shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Arch {
    /// `iresnet<depth>` with stage widths `width`, 2, 4 and 8 x `width`.
    IResNet {
        /// 18, 34, 50, 100 or 200.
        depth: usize,
        /// Channels of the stem and the first stage (64 in insightface).
        width: usize,
    },
    /// `MobileFaceNet(blocks, scale)`: `get_mbf` is scale 2 and blocks (1, 4, 6, 2),
    /// `get_mbf_large` scale 4 and blocks (2, 8, 12, 4).
    MobileFaceNet {
        /// The stem's channels are `64 * scale`.
        scale: usize,
        /// Residual depthwise blocks of the four stacks.
        blocks: [usize; 4],
    },
}

/// A backbone of [`Arch`] with its input, embedding and batch-norm settings.
#[derive(Clone, Debug, PartialEq)]
pub struct InsightfaceConfig {
    /// The network.
    pub arch: Arch,
    /// Input channels (3 in insightface; 1 for gray images).
    pub in_channels: usize,
    /// Height and width of the input faces (112 in insightface), a multiple of 16.
    pub input_size: usize,
    /// Embedding width (insightface's `num_features`, 512).
    pub embedding: usize,
    /// IResNet's dropout before `fc` (masks keyed by seed, step and global sample index).
    pub dropout: f64,
    /// Synchronise the batch statistics across ranks (SyncBatchNorm).
    pub sync_bn: bool,
}

/// The blocks per stage of IResNet-`depth`, as insightface's `iresnet<depth>` builds it.
pub fn iresnet_stages(depth: usize) -> Option<[usize; 4]> {
    Some(match depth {
        18 => [2, 2, 2, 2],
        34 => [3, 4, 6, 3],
        50 => [3, 4, 14, 3],
        100 => [3, 13, 30, 3],
        200 => [6, 26, 60, 6],
        _ => return None,
    })
}

fn bad(key: &'static str, reason: String) -> ModelError {
    ModelError::ModelKey { key, reason }
}

impl InsightfaceConfig {
    /// Checks the values.
    pub fn validate(&self) -> std::result::Result<(), ModelError> {
        match self.arch {
            Arch::IResNet { depth, width } => {
                if iresnet_stages(depth).is_none() {
                    return Err(bad("depth", format!("IResNet's depth must be 18, 34, 50, 100 or 200, got {depth}")));
                }
                if width == 0 {
                    return Err(bad("width", "must be positive (insightface's is 64)".into()));
                }
            }
            Arch::MobileFaceNet { scale, blocks } => {
                if scale == 0 {
                    return Err(bad("scale", "must be positive (insightface's get_mbf has 2, get_mbf_large 4)".into()));
                }
                if blocks.contains(&0) {
                    return Err(bad("blocks", format!("every stack needs at least one block, got {blocks:?}")));
                }
            }
        }
        if !(self.in_channels == 1 || self.in_channels == 3) {
            return Err(bad("in_channels", format!("must be 1 or 3, got {}", self.in_channels)));
        }
        if self.input_size == 0 || !self.input_size.is_multiple_of(16) {
            return Err(bad(
                "input_size",
                format!(
                    "must be a positive multiple of 16 (four stride-2 stages; insightface's faces are 112), got {}",
                    self.input_size
                ),
            ));
        }
        if self.embedding == 0 {
            return Err(bad("embedding", "must be positive".into()));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(bad("dropout", format!("must be in [0, 1), got {}", self.dropout)));
        }
        Ok(())
    }

    /// The insightface constructor that builds this network (`iresnet50()`, `get_mbf(False,
    /// 512)`, ...), or why none does.
    pub fn insightface_model(&self) -> std::result::Result<String, String> {
        let mut why = Vec::new();
        let name = match self.arch {
            Arch::IResNet { depth, width } => {
                if width != 64 {
                    why.push(format!("model.width is {width} (insightface's IResNet has 64)"));
                }
                format!("iresnet{depth}(num_features={})", self.embedding)
            }
            Arch::MobileFaceNet { scale, blocks } => {
                format!("get_mbf(fp16=False, num_features={}, blocks={blocks:?}, scale={scale})", self.embedding)
                    .replace('[', "(")
                    .replace(']', ")")
            }
        };
        if self.in_channels != 3 {
            why.push(format!("model.in_channels is {} (insightface's backbones take 3)", self.in_channels));
        }
        if self.input_size != 112 {
            why.push(format!("model.input_size is {} (insightface's backbones take 112x112 faces)", self.input_size));
        }
        if why.is_empty() {
            Ok(name)
        } else {
            Err(why.join("; "))
        }
    }
}

/// PyTorch's `nn.PReLU(C)`: a slope per channel, from 0.25.
struct PRelu {
    weight: Tensor,
}

impl PRelu {
    fn new(c: usize, vb: VarBuilder) -> Result<Self> {
        Ok(PRelu { weight: vb.get_with_hints(c, "weight", Init::Const(0.25))? })
    }
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        prelu(x, &self.weight)
    }
}

/// A bias-free `k x k` convolution.
fn conv(cin: usize, cout: usize, k: usize, stride: usize, groups: usize, vb: VarBuilder) -> Result<Conv2d> {
    Conv2d::from_vb(cin, cout, k, ConvParams { stride, padding: k / 2, dilation: 1, groups }, false, vb)
}

/// IResNet's `IBasicBlock`.
struct IBlock {
    bn1: BatchNorm,
    conv1: Conv2d,
    bn2: BatchNorm,
    prelu: PRelu,
    conv2: Conv2d,
    bn3: BatchNorm,
    downsample: Option<(Conv2d, BatchNorm)>,
}

impl IBlock {
    fn new(cin: usize, planes: usize, stride: usize, sync: bool, vb: VarBuilder) -> Result<Self> {
        // Created in the module order of insightface's block (the order of its state dict).
        Ok(IBlock {
            bn1: BatchNorm::new(cin, sync, vb.pp("bn1"))?,
            conv1: conv(cin, planes, 3, 1, 1, vb.pp("conv1"))?,
            bn2: BatchNorm::new(planes, sync, vb.pp("bn2"))?,
            prelu: PRelu::new(planes, vb.pp("prelu"))?,
            conv2: conv(planes, planes, 3, stride, 1, vb.pp("conv2"))?,
            bn3: BatchNorm::new(planes, sync, vb.pp("bn3"))?,
            downsample: if stride != 1 || cin != planes {
                let d = vb.pp("downsample");
                Some((conv(cin, planes, 1, stride, 1, d.pp("0"))?, BatchNorm::new(planes, sync, d.pp("1"))?))
            } else {
                None
            },
        })
    }

    fn forward(&self, x: &Tensor, mode: Mode) -> Result<Tensor> {
        let h = self.conv1.forward(&self.bn1.forward(x, mode)?)?;
        let h = self.prelu.forward(&self.bn2.forward(&h, mode)?)?;
        let h = self.bn3.forward(&self.conv2.forward(&h)?, mode)?;
        let skip = match &self.downsample {
            Some((c, bn)) => bn.forward(&c.forward(x)?, mode)?,
            None => x.clone(),
        };
        h + skip
    }

    fn batch_norms(&self) -> Vec<&BatchNorm> {
        let mut out = vec![&self.bn1, &self.bn2, &self.bn3];
        out.extend(self.downsample.as_ref().map(|(_, bn)| bn));
        out
    }
}

/// insightface's IResNet with its embedding layers.
pub struct IResNet {
    conv1: Conv2d,
    bn1: BatchNorm,
    prelu: PRelu,
    blocks: Vec<IBlock>,
    bn2: BatchNorm,
    dropout: f64,
    fc: Linear,
    features: BatchNorm,
}

impl IResNet {
    fn new(cfg: &InsightfaceConfig, depth: usize, width: usize, vb: VarBuilder) -> Result<Self> {
        let stages = iresnet_stages(depth).ok_or_else(|| bad("depth", format!("no IResNet-{depth}")))?;
        let s = cfg.sync_bn;
        // The stem first: parameters are created in the order of insightface's state dict.
        let conv1 = conv(cfg.in_channels, width, 3, 1, 1, vb.pp("conv1"))?;
        let bn1 = BatchNorm::new(width, s, vb.pp("bn1"))?;
        let prelu = PRelu::new(width, vb.pp("prelu"))?;
        let mut blocks = Vec::new();
        let mut cin = width;
        for (stage, &n) in stages.iter().enumerate() {
            let planes = width << stage;
            for i in 0..n {
                let stride = if i == 0 { 2 } else { 1 };
                blocks.push(IBlock::new(cin, planes, stride, s, vb.pp(format!("layer{}.{i}", stage + 1)))?);
                cin = planes;
            }
        }
        let map = cfg.input_size / 16;
        Ok(IResNet {
            conv1,
            bn1,
            prelu,
            blocks,
            bn2: BatchNorm::new(cin, s, vb.pp("bn2"))?,
            dropout: cfg.dropout,
            fc: candle_nn::linear(cin * map * map, cfg.embedding, vb.pp("fc"))?,
            features: BatchNorm::with_unit_weight(cfg.embedding, s, vb.pp("features"))?,
        })
    }

    fn forward(&self, x: &Tensor, pass: Pass) -> Result<Tensor> {
        let mode = pass.mode;
        let mut h = self.prelu.forward(&self.bn1.forward(&self.conv1.forward(x)?, mode)?)?;
        for b in &self.blocks {
            h = b.forward(&h, mode)?;
        }
        let mut h = self.bn2.forward(&h, mode)?.flatten_from(1)?;
        if mode.train && self.dropout > 0.0 {
            let mask = dropout_mask(h.dims2()?.1, self.dropout, pass, h.device())?.to_dtype(h.dtype())?;
            h = (h * mask)?;
        }
        self.features.forward(&allgrad_nn::linear_module(&self.fc, &h)?, mode)
    }

    fn batch_norms(&self) -> Vec<&BatchNorm> {
        let mut out = vec![&self.bn1];
        out.extend(self.blocks.iter().flat_map(IBlock::batch_norms));
        out.extend([&self.bn2, &self.features]);
        out
    }
}

/// MobileFaceNet's ConvBlock (convolution, batch norm, PReLU) or, without the PReLU, its
/// LinearBlock; parameters `<name>.layers.{0,1,2}`.
struct ConvBlock {
    conv: Conv2d,
    bn: BatchNorm,
    prelu: Option<PRelu>,
}

impl ConvBlock {
    #[allow(clippy::too_many_arguments)]
    fn new(
        cin: usize,
        cout: usize,
        k: usize,
        stride: usize,
        groups: usize,
        linear: bool,
        sync: bool,
        vb: VarBuilder,
    ) -> Result<Self> {
        let l = vb.pp("layers");
        Ok(ConvBlock {
            conv: conv(cin, cout, k, stride, groups, l.pp("0"))?,
            bn: BatchNorm::new(cout, sync, l.pp("1"))?,
            prelu: if linear { None } else { Some(PRelu::new(cout, l.pp("2"))?) },
        })
    }

    fn forward(&self, x: &Tensor, mode: Mode) -> Result<Tensor> {
        let h = self.bn.forward(&self.conv.forward(x)?, mode)?;
        match &self.prelu {
            Some(p) => p.forward(&h),
            None => Ok(h),
        }
    }
}

/// MobileFaceNet's DepthWise block: a 1x1 ConvBlock to `hidden` channels, a depthwise 3x3
/// ConvBlock (the stride), a 1x1 LinearBlock to the output, plus the input when residual.
struct DepthWise {
    layers: [ConvBlock; 3],
    residual: bool,
}

impl DepthWise {
    fn new(cin: usize, cout: usize, residual: bool, stride: usize, hidden: usize, sync: bool, vb: VarBuilder) -> Result<Self> {
        let l = vb.pp("layers");
        Ok(DepthWise {
            layers: [
                ConvBlock::new(cin, hidden, 1, 1, 1, false, sync, l.pp("0"))?,
                ConvBlock::new(hidden, hidden, 3, stride, hidden, false, sync, l.pp("1"))?,
                ConvBlock::new(hidden, cout, 1, 1, 1, true, sync, l.pp("2"))?,
            ],
            residual,
        })
    }

    fn forward(&self, x: &Tensor, mode: Mode) -> Result<Tensor> {
        let mut h = x.clone();
        for l in &self.layers {
            h = l.forward(&h, mode)?;
        }
        if self.residual {
            x + h
        } else {
            Ok(h)
        }
    }
}

/// One entry of MobileFaceNet's `layers` (built once per run: the size difference of the
/// variants does not matter).
#[allow(clippy::large_enum_variant)]
enum Stage {
    Conv(ConvBlock),
    DepthWise(DepthWise),
    /// MobileFaceNet's `Residual`: residual DepthWise blocks, `<name>.layers.<i>`.
    Residual(Vec<DepthWise>),
}

impl Stage {
    fn residual(c: usize, n: usize, hidden: usize, sync: bool, vb: VarBuilder) -> Result<Self> {
        let l = vb.pp("layers");
        Ok(Stage::Residual((0..n).map(|i| DepthWise::new(c, c, true, 1, hidden, sync, l.pp(i))).collect::<Result<_>>()?))
    }

    fn forward(&self, x: &Tensor, mode: Mode) -> Result<Tensor> {
        match self {
            Stage::Conv(b) => b.forward(x, mode),
            Stage::DepthWise(d) => d.forward(x, mode),
            Stage::Residual(ds) => {
                let mut h = x.clone();
                for d in ds {
                    h = d.forward(&h, mode)?;
                }
                Ok(h)
            }
        }
    }

    fn convs(&self) -> Vec<&ConvBlock> {
        match self {
            Stage::Conv(b) => vec![b],
            Stage::DepthWise(d) => d.layers.iter().collect(),
            Stage::Residual(ds) => ds.iter().flat_map(|d| d.layers.iter()).collect(),
        }
    }
}

/// insightface's MobileFaceNet with its GDC embedding layers.
pub struct MobileFaceNet {
    layers: Vec<Stage>,
    conv_sep: ConvBlock,
    gdc: ConvBlock,
    linear: Linear,
    bn: BatchNorm,
}

impl MobileFaceNet {
    fn new(cfg: &InsightfaceConfig, scale: usize, blocks: [usize; 4], vb: VarBuilder) -> Result<Self> {
        let s = cfg.sync_bn;
        let c = 64 * scale;
        let l = vb.pp("layers");
        let dw = |cin, cout, hidden, i: usize| -> Result<Stage> {
            Ok(Stage::DepthWise(DepthWise::new(cin, cout, false, 2, hidden, s, l.pp(i))?))
        };
        let layers = vec![
            Stage::Conv(ConvBlock::new(cfg.in_channels, c, 3, 2, 1, false, s, l.pp("0"))?),
            if blocks[0] == 1 {
                Stage::Conv(ConvBlock::new(c, c, 3, 1, 64, false, s, l.pp("1"))?)
            } else {
                Stage::residual(c, blocks[0], 128, s, l.pp("1"))?
            },
            dw(c, c, 128, 2)?,
            Stage::residual(c, blocks[1], 128, s, l.pp("3"))?,
            dw(c, 2 * c, 256, 4)?,
            Stage::residual(2 * c, blocks[2], 256, s, l.pp("5"))?,
            dw(2 * c, 2 * c, 512, 6)?,
            Stage::residual(2 * c, blocks[3], 256, s, l.pp("7"))?,
        ];
        let f = vb.pp("features").pp("layers");
        Ok(MobileFaceNet {
            layers,
            conv_sep: ConvBlock::new(2 * c, 512, 1, 1, 1, false, s, vb.pp("conv_sep"))?,
            // The global depthwise convolution: one kernel the size of the map, no padding.
            gdc: {
                let k = cfg.input_size / 16;
                let g = f.pp("0").pp("layers");
                let conv = Conv2d::from_vb(512, 512, k, ConvParams { groups: 512, ..Default::default() }, false, g.pp("0"))?;
                ConvBlock { conv, bn: BatchNorm::new(512, s, g.pp("1"))?, prelu: None }
            },
            linear: candle_nn::linear_no_bias(512, cfg.embedding, f.pp("2"))?,
            bn: BatchNorm::new(cfg.embedding, s, f.pp("3"))?,
        })
    }

    fn forward(&self, x: &Tensor, mode: Mode) -> Result<Tensor> {
        let mut h = x.clone();
        for l in &self.layers {
            h = l.forward(&h, mode)?;
        }
        let h = self.gdc.forward(&self.conv_sep.forward(&h, mode)?, mode)?.flatten_from(1)?;
        self.bn.forward(&allgrad_nn::linear_module(&self.linear, &h)?, mode)
    }

    fn batch_norms(&self) -> Vec<&BatchNorm> {
        let mut out: Vec<&BatchNorm> = self.layers.iter().flat_map(Stage::convs).map(|c| &c.bn).collect();
        out.extend([&self.conv_sep.bn, &self.gdc.bn, &self.bn]);
        out
    }
}

/// A built insightface backbone: images `[N, C, input_size, input_size]` to embeddings.
pub enum InsightfaceNet {
    /// See [`Arch::IResNet`].
    IResNet(IResNet),
    /// See [`Arch::MobileFaceNet`].
    MobileFaceNet(MobileFaceNet),
}

impl InsightfaceNet {
    /// The network of `cfg`, its parameters created through `vb` under insightface's names.
    pub fn new(cfg: &InsightfaceConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        Ok(match cfg.arch {
            Arch::IResNet { depth, width } => InsightfaceNet::IResNet(IResNet::new(cfg, depth, width, vb)?),
            Arch::MobileFaceNet { scale, blocks } => InsightfaceNet::MobileFaceNet(MobileFaceNet::new(cfg, scale, blocks, vb)?),
        })
    }

    /// The embeddings of a batch of faces.
    pub fn forward(&self, x: &Tensor, pass: Pass) -> Result<Tensor> {
        match self {
            InsightfaceNet::IResNet(n) => n.forward(x, pass),
            InsightfaceNet::MobileFaceNet(n) => n.forward(x, pass.mode),
        }
    }

    /// Every batch norm, in layer order.
    pub fn batch_norms(&self) -> Vec<&BatchNorm> {
        match self {
            InsightfaceNet::IResNet(n) => n.batch_norms(),
            InsightfaceNet::MobileFaceNet(n) => n.batch_norms(),
        }
    }
}

/// What an entry of [`layout`] holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    /// A trainable parameter.
    Param,
    /// A batch norm's `running_mean` or `running_var`.
    Running,
    /// A batch norm's `num_batches_tracked` (an i64 scalar, not kept by allgrad).
    Count,
    /// IResNet's `features.weight`: 1, not trained.
    Unit,
}

/// One tensor of a backbone's state dict.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Its name in insightface's state dict.
    pub name: String,
    /// Its shape (`[]` for `num_batches_tracked`).
    pub shape: Vec<usize>,
    /// What it holds.
    pub slot: Slot,
}

/// A backend that hands out zero-stride placeholders and records what was asked for, so that
/// a layout costs no parameter memory (IResNet-100 has 65M parameters).
struct Recorder {
    seen: Arc<Mutex<Recorded>>,
}

/// Parameter names and shapes, in the order they were asked for.
type Recorded = Vec<(String, Vec<usize>)>;

impl SimpleBackend for Recorder {
    fn get(&self, s: Shape, name: &str, _: Init, dtype: DType, dev: &Device) -> Result<Tensor> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).push((name.to_string(), s.dims().to_vec()));
        Tensor::zeros((), dtype, dev)?.broadcast_as(s)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> Result<Tensor> {
        candle_core::bail!("layout: {name} asked for without a shape")
    }

    fn contains_tensor(&self, _: &str) -> bool {
        false
    }
}

/// The state dict of insightface's backbone shaped as `cfg` (as `model.state_dict()` names
/// it; without the `module.` of a DDP wrapper): every parameter, each batch norm's
/// `running_mean`, `running_var` and `num_batches_tracked`, and IResNet's unit
/// `features.weight`.
pub fn layout(cfg: &InsightfaceConfig) -> Result<Vec<Entry>> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let vb = VarBuilder::from_backend(Box::new(Recorder { seen: seen.clone() }), DType::F32, Device::Cpu);
    let net = InsightfaceNet::new(cfg, vb)?;
    let seen = std::mem::take(&mut *seen.lock().unwrap_or_else(|p| p.into_inner()));
    let mut out: Vec<Entry> = seen.into_iter().map(|(name, shape)| Entry { name, shape, slot: Slot::Param }).collect();
    for bn in net.batch_norms() {
        let c = bn.running_stats().0.dim(0)?;
        for (what, slot) in [("running_mean", Slot::Running), ("running_var", Slot::Running)] {
            out.push(Entry { name: format!("{}.{what}", bn.name()), shape: vec![c], slot });
        }
        out.push(Entry { name: format!("{}.num_batches_tracked", bn.name()), shape: vec![], slot: Slot::Count });
    }
    if let InsightfaceNet::IResNet(_) = net {
        out.push(Entry { name: "features.weight".into(), shape: vec![cfg.embedding], slot: Slot::Unit });
    }
    Ok(out)
}

fn describe(cfg: &InsightfaceConfig) -> String {
    let arch = match cfg.arch {
        Arch::IResNet { depth, width } => format!("IResNet-{depth} of width {width}"),
        Arch::MobileFaceNet { scale, blocks } => format!("MobileFaceNet of scale {scale} and blocks {blocks:?}"),
    };
    let s = cfg.input_size;
    format!("{arch}, {} input channel(s), {s}x{s} inputs and embedding {}", cfg.in_channels, cfg.embedding)
}

/// The tensors of an insightface backbone's safetensors file (`scripts/data/
/// convert_insightface_backbone.py` writes one from a `backbone.pth`) that a backbone shaped
/// as `cfg` starts from: parameters and running statistics by name. `num_batches_tracked` is
/// ignored; IResNet's `features.weight` must be 1 (insightface freezes it there); any other
/// difference in names or shapes is an error listing the first mismatched keys with both
/// shapes.
pub fn read_init(path: &Path, cfg: &InsightfaceConfig) -> Result<HashMap<String, Tensor>> {
    let err = |detail: String| -> candle_core::Error { ModelError::InitFrom { path: path.to_path_buf(), detail }.into() };
    if !path.is_file() {
        return Err(err("no such file".into()));
    }
    let mut file = candle_core::safetensors::load(path, &Device::Cpu).map_err(|e| err(format!("not a safetensors file: {e}")))?;
    file.retain(|k, _| !k.ends_with(".num_batches_tracked"));
    let layout: Vec<Entry> = layout(cfg)?.into_iter().filter(|e| e.slot != Slot::Count).collect();
    let expected: Vec<(&str, &[usize])> = layout.iter().map(|e| (e.name.as_str(), e.shape.as_slice())).collect();
    if let Some(mismatch) = layout_mismatch(&file, &expected) {
        return Err(err(format!(
            "the file is not an insightface {} (num_batches_tracked is ignored). {mismatch}",
            describe(cfg)
        )));
    }
    if let Some(w) = file.remove("features.weight") {
        let off = w.to_dtype(DType::F64)?.affine(1.0, -1.0)?.abs()?.max_all()?.to_scalar::<f64>()?;
        if off != 0.0 {
            return Err(err(format!(
                "features.weight differs from 1 by up to {off:e}: insightface holds the embedding BatchNorm1d's weight \
                 at 1 and so does allgrad (it is not a parameter)"
            )));
        }
    }
    Ok(file)
}

/// The backbone of `cfg` with its parameters created through `vb`, and, with `init_from`,
/// its parameters and running statistics set from that file (see [`read_init`]).
pub fn build(cfg: &InsightfaceConfig, init_from: Option<&PathBuf>, vb: VarBuilder) -> Result<InsightfaceNet> {
    let Some(path) = init_from else { return InsightfaceNet::new(cfg, vb) };
    let file = read_init(path, cfg)?;
    let prefix = vb.prefix();
    let full = |k: &str| if prefix.is_empty() { k.to_string() } else { format!("{prefix}.{k}") };
    let values = file.iter().map(|(k, v)| (full(k), v.clone())).collect();
    let (dtype, device) = (vb.dtype(), vb.device().clone());
    let wrapped =
        VarBuilder::from_backend(Box::new(Preloaded { inner: vb.root(), values }), dtype, device.clone()).set_prefix(&prefix);
    let net = InsightfaceNet::new(cfg, wrapped)?;
    for bn in net.batch_norms() {
        let local =
            if prefix.is_empty() { bn.name() } else { bn.name().strip_prefix(&format!("{prefix}.")).unwrap_or(bn.name()) };
        let get = |what: &str| file[&format!("{local}.{what}")].to_device(&device);
        bn.set_running_stats(&get("running_mean")?, &get("running_var")?)?;
    }
    Ok(net)
}

/// The backbone's tensors from a checkpoint under insightface's names, in f32
/// (`num_batches_tracked`: `batches_tracked`, i64; `features.weight`: 1), for
/// `load_state_dict(strict=True)`. `params` and `buffers` are the checkpoint's, named
/// `<prefix><insightface name>`.
pub fn export(
    cfg: &InsightfaceConfig,
    params: &HashMap<String, Tensor>,
    buffers: &HashMap<String, Tensor>,
    prefix: &str,
    batches_tracked: i64,
) -> Result<Vec<(String, Tensor)>> {
    let mut out = Vec::new();
    for e in layout(cfg)? {
        let t = match e.slot {
            Slot::Count => Tensor::new(batches_tracked, &Device::Cpu)?,
            Slot::Unit => Tensor::ones(e.shape.as_slice(), DType::F32, &Device::Cpu)?,
            Slot::Param | Slot::Running => {
                let from = if e.slot == Slot::Param { params } else { buffers };
                let key = format!("{prefix}{}", e.name);
                let t = from.get(&key).ok_or_else(|| {
                    candle_core::Error::Msg(format!("the checkpoint has no `{key}` (a {:?} of shape {:?})", e.slot, e.shape))
                })?;
                if t.dims() != e.shape.as_slice() {
                    candle_core::bail!(
                        "the checkpoint's `{key}` has shape {:?}, the model's config gives {:?}",
                        t.dims(),
                        e.shape
                    );
                }
                t.to_device(&Device::Cpu)?.to_dtype(DType::F32)?
            }
        };
        out.push((e.name, t));
    }
    Ok(out)
}
