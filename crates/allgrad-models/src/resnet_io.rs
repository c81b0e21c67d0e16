//! A ResNet encoder in torchvision's and timm's parameter layout, out and in.
//!
//! allgrad's encoder already names its parameters as torchvision does (`conv1`, `bn1`,
//! `layer1.0.conv1`, `layer2.0.downsample.0`, ...; timm's ResNet uses the same names), under a
//! method's prefix (`encoder.` for SimCLR and BarlowTwins, `backbone.encoder.` for the face
//! method). [`torchvision_layout`] lists the state dict a torchvision ResNet of the same shape
//! has, without its classifier `fc`: every parameter, then per batch norm `running_mean`,
//! `running_var` and `num_batches_tracked`, in the module order of `state_dict()`.
//! [`export_encoder`] fills it from a checkpoint; [`build_resnet`] builds an encoder whose
//! parameters and running statistics start from such a file (`model.init_from`).
//!
//! Which torchvision and timm models have the layout of a config ([`standard_model`]): the
//! ResNet-18, -34 and -50 of width 64 with the ImageNet stem. timm builds them for one input
//! channel too (`in_chans=1`); torchvision only for three.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Result, Shape, Tensor, Var};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};

use crate::error::fail;
use crate::resnet::{ResNet, ResNetConfig, Stem};
use crate::ModelError;

/// What an entry of the layout holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    /// A trainable parameter (a convolution's weight, a batch norm's weight or bias).
    Param,
    /// A batch norm's running mean or variance (a buffer of the checkpoint).
    Running,
    /// A batch norm's `num_batches_tracked` (an i64 scalar; not kept by allgrad).
    Count,
}

/// One tensor of a torchvision ResNet's state dict.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Its name in torchvision (and timm).
    pub name: String,
    /// Its shape (`[]` for `num_batches_tracked`).
    pub shape: Vec<usize>,
    /// What it holds.
    pub slot: Slot,
}

fn conv(out: &mut Vec<Entry>, name: &str, cout: usize, cin: usize, k: usize) {
    out.push(Entry { name: format!("{name}.weight"), shape: vec![cout, cin, k, k], slot: Slot::Param });
}

fn bn(out: &mut Vec<Entry>, name: &str, c: usize) {
    for (p, slot) in
        [("weight", Slot::Param), ("bias", Slot::Param), ("running_mean", Slot::Running), ("running_var", Slot::Running)]
    {
        out.push(Entry { name: format!("{name}.{p}"), shape: vec![c], slot });
    }
    out.push(Entry { name: format!("{name}.num_batches_tracked"), shape: vec![], slot: Slot::Count });
}

/// The state dict of a torchvision ResNet shaped as `cfg`, without `fc`, in `state_dict()`
/// order (a block's `conv1`, `bn1`, `conv2`, `bn2`[, `conv3`, `bn3`], then `downsample`).
pub fn torchvision_layout(cfg: &ResNetConfig) -> Result<Vec<Entry>> {
    let (counts, bottleneck) = match cfg.depth {
        18 => ([2, 2, 2, 2], false),
        34 => ([3, 4, 6, 3], false),
        50 => ([3, 4, 6, 3], true),
        d => return fail(ModelError::ResNetDepth(d)),
    };
    let k = if cfg.stem == Stem::Imagenet { 7 } else { 3 };
    let mut out = Vec::new();
    conv(&mut out, "conv1", cfg.width, cfg.in_channels, k);
    bn(&mut out, "bn1", cfg.width);
    let expansion = if bottleneck { 4 } else { 1 };
    let mut cin = cfg.width;
    for (stage, &n) in counts.iter().enumerate() {
        let planes = cfg.width << stage;
        let cout = planes * expansion;
        for i in 0..n {
            let b = format!("layer{}.{i}", stage + 1);
            let stride = if stage > 0 && i == 0 { 2 } else { 1 };
            if bottleneck {
                conv(&mut out, &format!("{b}.conv1"), planes, cin, 1);
                bn(&mut out, &format!("{b}.bn1"), planes);
                conv(&mut out, &format!("{b}.conv2"), planes, planes, 3);
                bn(&mut out, &format!("{b}.bn2"), planes);
                conv(&mut out, &format!("{b}.conv3"), cout, planes, 1);
                bn(&mut out, &format!("{b}.bn3"), cout);
            } else {
                conv(&mut out, &format!("{b}.conv1"), planes, cin, 3);
                bn(&mut out, &format!("{b}.bn1"), planes);
                conv(&mut out, &format!("{b}.conv2"), planes, planes, 3);
                bn(&mut out, &format!("{b}.bn2"), planes);
            }
            if stride != 1 || cin != cout {
                conv(&mut out, &format!("{b}.downsample.0"), cout, cin, 1);
                bn(&mut out, &format!("{b}.downsample.1"), cout);
            }
            cin = cout;
        }
    }
    Ok(out)
}

/// The torchvision / timm model name (`resnet18`, `resnet34`, `resnet50`) whose layout `cfg`
/// has, or why there is none: both build these depths only at width 64 with the ImageNet stem
/// (7x7/2 convolution, then a 3x3/2 max-pool). The input channels are not checked here
/// (torchvision takes 3, timm also 1 with `in_chans=1`).
pub fn standard_model(cfg: &ResNetConfig) -> std::result::Result<&'static str, String> {
    let name = match cfg.depth {
        18 => "resnet18",
        34 => "resnet34",
        50 => "resnet50",
        d => return Err(format!("depth {d} is not a ResNet-18, -34 or -50")),
    };
    let mut why = Vec::new();
    if cfg.width != 64 {
        why.push(format!("model.encoder.width is {} (torchvision's and timm's {name} have width 64)", cfg.width));
    }
    if cfg.stem != Stem::Imagenet {
        why.push(format!(
            "model.encoder.stem is cifar (a 3x3 stride-1 first convolution without max-pool; {name} has the imagenet stem)"
        ));
    }
    if why.is_empty() {
        Ok(name)
    } else {
        Err(why.join("; "))
    }
}

/// The encoder's tensors from a checkpoint, under torchvision's names, in f32
/// (`num_batches_tracked`: `batches_tracked`, i64). `params` are the checkpoint's parameters
/// and `buffers` its buffers (the running statistics), both named `<prefix><torchvision name>`.
pub fn export_encoder(
    cfg: &ResNetConfig,
    params: &HashMap<String, Tensor>,
    buffers: &HashMap<String, Tensor>,
    prefix: &str,
    batches_tracked: i64,
) -> Result<Vec<(String, Tensor)>> {
    let mut out = Vec::new();
    for e in torchvision_layout(cfg)? {
        let t = match e.slot {
            Slot::Count => Tensor::new(batches_tracked, &Device::Cpu)?,
            Slot::Param | Slot::Running => {
                let from = if e.slot == Slot::Param { params } else { buffers };
                let key = format!("{prefix}{}", e.name);
                let t = from.get(&key).ok_or_else(|| {
                    candle_core::Error::Msg(format!("the checkpoint has no `{key}` (a {:?} of shape {:?})", e.slot, e.shape))
                })?;
                if t.dims() != e.shape.as_slice() {
                    candle_core::bail!(
                        "the checkpoint's `{key}` has shape {:?}, the encoder's config gives {:?}",
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

/// How many mismatched keys an `init_from` error lists.
const LISTED: usize = 8;

/// The differences between a file's tensors and the `(name, shape)` list a model expects: `None`
/// when they match; else the model's keys missing from the file or of another shape, and the
/// file's keys the model has not, at most [`LISTED`] of each.
pub(crate) fn layout_mismatch(file: &HashMap<String, Tensor>, expected: &[(&str, &[usize])]) -> Option<String> {
    let mut bad = Vec::new();
    for &(name, shape) in expected {
        match file.get(name) {
            None => bad.push(format!("{name}: file (missing), model {shape:?}")),
            Some(t) if t.dims() != shape => bad.push(format!("{name}: file {:?}, model {shape:?}", t.dims())),
            Some(_) => {}
        }
    }
    let mut extra: Vec<&String> = file.keys().filter(|k| !expected.iter().any(|(n, _)| n == k)).collect();
    extra.sort();
    let extra: Vec<String> = extra.into_iter().map(|k| format!("{k}: file {:?}, model (none)", file[k].dims())).collect();
    if bad.is_empty() && extra.is_empty() {
        return None;
    }
    let list = |v: &[String]| {
        let mut l: Vec<String> = v.iter().take(LISTED).cloned().collect();
        if v.len() > LISTED {
            l.push(format!("... {} more", v.len() - LISTED));
        }
        l.join("; ")
    };
    let mut parts = Vec::new();
    if !bad.is_empty() {
        parts.push(format!("{} key(s) of the model missing from the file or of another shape: {}", bad.len(), list(&bad)));
    }
    if !extra.is_empty() {
        parts.push(format!("{} key(s) of the file not in the model: {}", extra.len(), list(&extra)));
    }
    Some(parts.join(". "))
}

/// The tensors of a torchvision or timm ResNet safetensors file that an encoder shaped as `cfg`
/// starts from (parameters and running statistics, by torchvision name). The classifier
/// (`fc.*`) and `num_batches_tracked` are left out; any other difference in names or shapes is
/// an error listing the first mismatched keys with both shapes.
pub fn read_init(path: &Path, cfg: &ResNetConfig) -> Result<HashMap<String, Tensor>> {
    let err = |detail: String| -> candle_core::Error { ModelError::InitFrom { path: path.to_path_buf(), detail }.into() };
    if !path.is_file() {
        return Err(err("no such file".into()));
    }
    let mut file = candle_core::safetensors::load(path, &Device::Cpu).map_err(|e| err(format!("not a safetensors file: {e}")))?;
    file.retain(|k, _| !(k.starts_with("fc.") || k.ends_with(".num_batches_tracked")));
    let layout: Vec<Entry> = torchvision_layout(cfg)?.into_iter().filter(|e| e.slot != Slot::Count).collect();
    let expected: Vec<(&str, &[usize])> = layout.iter().map(|e| (e.name.as_str(), e.shape.as_slice())).collect();
    if let Some(mismatch) = layout_mismatch(&file, &expected) {
        return Err(err(format!(
            "the file is not a torchvision ResNet-{} of width {} with {} input channel(s) and the {} stem (fc.* and \
             num_batches_tracked are ignored). {mismatch}",
            cfg.depth,
            cfg.width,
            cfg.in_channels,
            if cfg.stem == Stem::Imagenet { "imagenet" } else { "cifar" },
        )));
    }
    Ok(file)
}

/// A VarBuilder backend that creates each variable through `inner` (the run's parameter
/// store, at its root) and then sets it to the file's value when the file has one.
pub(crate) struct Preloaded<'a> {
    pub(crate) inner: VarBuilder<'a>,
    /// By full parameter name.
    pub(crate) values: HashMap<String, Tensor>,
}

impl SimpleBackend for Preloaded<'_> {
    fn get(&self, s: Shape, name: &str, h: Init, dtype: DType, dev: &Device) -> Result<Tensor> {
        let t = self.inner.get_with_hints_dtype(s, name, h, dtype)?;
        if let Some(v) = self.values.get(name) {
            if !t.is_variable() {
                candle_core::bail!("model.init_from: parameter {name} is not a variable of the run's store");
            }
            Var::from_tensor(&t)?.set(&v.to_dtype(dtype)?.to_device(dev)?)?;
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, _dev: &Device) -> Result<Tensor> {
        self.inner.get_unchecked_dtype(name, dtype)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.inner.contains_tensor(name)
    }
}

/// The encoder of `cfg` with its parameters created through `vb`, and, with `init_from`, its
/// parameters and running statistics set from that torchvision / timm safetensors file (see
/// [`read_init`]).
pub fn build_resnet(cfg: &ResNetConfig, init_from: Option<&PathBuf>, vb: VarBuilder) -> Result<ResNet> {
    let Some(path) = init_from else { return ResNet::new(cfg, vb) };
    let file = read_init(path, cfg)?;
    let prefix = vb.prefix();
    let full = |k: &str| if prefix.is_empty() { k.to_string() } else { format!("{prefix}.{k}") };
    let values = file.iter().map(|(k, v)| (full(k), v.clone())).collect();
    let (dtype, device) = (vb.dtype(), vb.device().clone());
    let wrapped =
        VarBuilder::from_backend(Box::new(Preloaded { inner: vb.root(), values }), dtype, device.clone()).set_prefix(&prefix);
    let net = ResNet::new(cfg, wrapped)?;
    for bn in net.batch_norms() {
        let local = bn.name().strip_prefix(&format!("{prefix}.")).unwrap_or(bn.name());
        let get = |what: &str| file[&format!("{local}.{what}")].to_device(&device);
        bn.set_running_stats(&get("running_mean")?, &get("running_var")?)?;
    }
    Ok(net)
}
