//! The ResNet of a SimCLR, BarlowTwins or face run for PyTorch: the backbone under torchvision's
//! (and timm's, the same) parameter names with its running statistics and
//! `num_batches_tracked` (`model.safetensors`), the head after it separately as an
//! `nn.Sequential`'s state dict (`projector.safetensors`; for the face method the embedding
//! layers, `embedding.safetensors`), and a `config.json` saying what they are: architecture,
//! width, input channels and size, normalisation, how to load them, and a note when no
//! torchvision or timm model has their shape.
//!
//! A face run's insightface backbone (`model.kind: iresnet` or `mobilefacenet`) is written
//! whole, embedding layers included, under insightface's own names (`model.safetensors`, for
//! `load_state_dict(strict=True)` of arcface_torch's `iresnet50()` etc.), by `--format
//! safetensors` only.
//!
//! `--format torchvision` and `--format timm` refuse an encoder that has no such model
//! ([`allgrad_models::resnet_io::standard_model`]; torchvision also one of 1 input channel, which
//! timm builds with `in_chans=1`); `--format safetensors` writes any encoder, with the note.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use allgrad_data::AugmentConfig;
use allgrad_models::face::insightface::{self, Arch, InsightfaceConfig};
use allgrad_models::face::FaceModel;
use allgrad_models::image_ssl::ProjectorConfig;
use allgrad_models::resnet::{ResNetConfig, Stem};
use allgrad_models::resnet_io::{export_encoder, standard_model};
use candle_core::{DType, Device, Tensor};
use serde_json::json;

use super::contrastive::{ContrastiveSections, DataConfig, ModelConfig};
use super::face::FaceSections;
use crate::checkpoint::Checkpoint;
use crate::error::{TrainError, TrainResult};

/// What `export --format` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportFormat {
    /// For `torchvision.models.resnet18()` etc.: width 64, the ImageNet stem, 3 input channels.
    Torchvision,
    /// For `timm.create_model('resnet18', ...)` etc.: width 64, the ImageNet stem, 1 or 3 input
    /// channels; `config.json` in timm's layout (`architecture`, `pretrained_cfg`).
    Timm,
    /// Any encoder, under the same names, with a note of what loads it.
    Safetensors,
}

impl ExportFormat {
    /// The name on the command line (and of the default output folder).
    pub fn name(self) -> &'static str {
        match self {
            ExportFormat::Torchvision => "torchvision",
            ExportFormat::Timm => "timm",
            ExportFormat::Safetensors => "safetensors",
        }
    }
}

/// The head that follows the backbone, as the layers of an `nn.Sequential`.
enum Head<'a> {
    /// The image methods' projector (`projector.<i>.linear`, `projector.<i>.bn`).
    Projector(&'a ProjectorConfig),
    /// The face method's BN-Dropout-FC-BN (`backbone.embedding.{bn1,fc,bn2}`).
    Embedding { dropout: f64 },
}

/// What the export needs from a run's config.
struct Run<'a> {
    method: String,
    encoder: ResNetConfig,
    /// The parameters' prefix in the checkpoint (`encoder.`, `backbone.encoder.`).
    prefix: &'static str,
    head: Head<'a>,
    augment: Option<&'a AugmentConfig>,
}

fn setup(msg: impl Into<String>) -> TrainError {
    TrainError::Setup(msg.into())
}

/// Writes the backbone (and its head) of the newest checkpoint of the SimCLR, BarlowTwins or
/// face run in `run_dir` in `format` to `out` (default `run_dir/export/<format>`) and returns
/// the folder.
pub fn export_run(run_dir: &Path, format: ExportFormat, out: Option<&Path>) -> TrainResult<PathBuf> {
    let out = out.map(Path::to_path_buf).unwrap_or_else(|| run_dir.join("export").join(format.name()));
    let cfg_path = run_dir.join("config.yaml");
    let text = std::fs::read_to_string(&cfg_path).map_err(|source| TrainError::Io {
        action: "reading",
        path: cfg_path.clone(),
        source,
    })?;
    let method = crate::config::RunConfig::parse(&text, &cfg_path, &[]).map_err(|e| setup(e.to_string()))?.method;
    match method.as_str() {
        "simclr" | "barlowtwins" => {
            let (s, ck, _) = super::run_export::read_run::<ContrastiveSections>(run_dir, None, &method)?;
            let (ModelConfig::Resnet(m), DataConfig::Images(d)) = (&s.model, &s.data) else {
                return Err(setup(format!("{}: a {method} run without a ResNet has nothing to export", cfg_path.display())));
            };
            let run = Run {
                method,
                encoder: m.encoder.clone(),
                prefix: "encoder.",
                head: Head::Projector(&m.projector),
                augment: Some(&d.augment),
            };
            write(&run, &ck, format, &out)?;
        }
        "face" => {
            let (s, ck, _) = super::run_export::read_run::<FaceSections>(run_dir, None, &method)?;
            if let Some((cfg, _)) = s.model.insightface() {
                let augment = match &s.data {
                    allgrad_models::face::FaceData::Images(d) => Some(&d.augment),
                    allgrad_models::face::FaceData::Recordio(d) => Some(&d.augment),
                    _ => None,
                };
                write_insightface(&cfg, &ck, augment, format, &out)?;
                return Ok(out);
            }
            let FaceModel::Resnet { encoder, dropout, .. } = &s.model else {
                return Err(setup(format!("{}: a face run with a linear backbone has no ResNet to export", cfg_path.display())));
            };
            let augment = match &s.data {
                allgrad_models::face::FaceData::Images(d) => Some(&d.augment),
                _ => None,
            };
            let run = Run {
                method,
                encoder: encoder.clone(),
                prefix: "backbone.encoder.",
                head: Head::Embedding { dropout: *dropout },
                augment,
            };
            write(&run, &ck, format, &out)?;
        }
        "simcse" | "clip" => {
            return Err(setup(format!("a {method} run exports as a Hugging Face folder: `export --format hf` (or `export-hf`)")));
        }
        m => return Err(setup(format!("method `{m}` has no ResNet to export (simclr, barlowtwins and face have)"))),
    }
    Ok(out)
}

/// Why `format` cannot hold this encoder, if it cannot.
fn refusal(format: ExportFormat, cfg: &ResNetConfig) -> Option<String> {
    let fmt = format.name();
    let mut why = match (format, standard_model(cfg)) {
        (ExportFormat::Safetensors, _) => return None,
        (_, Err(why)) => why,
        (_, Ok(_)) => String::new(),
    };
    if format == ExportFormat::Torchvision && cfg.in_channels != 3 {
        if !why.is_empty() {
            why.push_str("; ");
        }
        why.push_str(&format!(
            "model.encoder.in_channels is {} (torchvision's ResNets take 3; timm's take in_chans={0}: --format timm)",
            cfg.in_channels
        ));
    }
    (!why.is_empty()).then(|| {
        format!("--format {fmt}: {fmt} has no model with this encoder's shape: {why}. `--format safetensors` writes it under the same names")
    })
}

/// What loads the backbone, for `config.json`'s `note`.
fn note(cfg: &ResNetConfig) -> String {
    let depth = cfg.depth;
    let c = cfg.in_channels;
    match standard_model(cfg) {
        Ok(name) if c == 3 => format!(
            "torchvision.models.{name}() and timm.create_model('{name}', num_classes=0) load model.safetensors with \
             strict=True (in torchvision, replace the classifier first: model.fc = torch.nn.Identity())"
        ),
        Ok(name) => format!(
            "timm.create_model('{name}', in_chans={c}, num_classes=0) loads model.safetensors with strict=True; \
             torchvision's {name} takes 3 input channels and does not (its conv1.weight is [64, 3, 7, 7], this one's \
             [64, {c}, 7, 7])"
        ),
        Err(why) => {
            let mut s = format!(
                "torchvision and timm have no ResNet-{depth} of this shape ({why}): the names and shapes are those of a \
                 torchvision ResNet-{depth} built with these widths"
            );
            if cfg.stem == Stem::Cifar {
                s.push_str(&format!(
                    "; for the cifar stem replace its stem before loading: model.conv1 = torch.nn.Conv2d({c}, {}, 3, 1, 1, \
                     bias=False) and model.maxpool = torch.nn.Identity()",
                    cfg.width
                ));
            }
            if cfg.width != 64 {
                s.push_str(&format!(
                    "; torchvision's ResNet class has no width parameter, so a width of {} needs a ResNet built with \
                     {} channels in its first stage",
                    cfg.width, cfg.width
                ));
            }
            s
        }
    }
}

fn f32_cpu(t: &Tensor) -> TrainResult<Tensor> {
    Ok(t.to_device(&Device::Cpu)?.to_dtype(DType::F32)?)
}

/// Tensors by name, in the order they are written.
type Named = Vec<(String, Tensor)>;

/// The head's tensors under `nn.Sequential` indices, and the description of its layers.
fn head_tensors(run: &Run, ck: &Checkpoint, batches: i64) -> TrainResult<(Named, Vec<String>)> {
    let param = |k: &str| ck.model.get(k).ok_or_else(|| setup(format!("the checkpoint has no parameter `{k}`")));
    let buffer = |k: &str| ck.buffers.get(k).ok_or_else(|| setup(format!("the checkpoint has no buffer `{k}`")));
    let mut out = Vec::new();
    let mut layers = Vec::new();
    let put_bn = |out: &mut Named, layers: &mut Vec<String>, i: usize, from: &str| -> TrainResult<()> {
        let w = param(&format!("{from}.weight"))?;
        layers.push(format!("BatchNorm1d({})", w.dim(0)?));
        out.push((format!("{i}.weight"), f32_cpu(w)?));
        out.push((format!("{i}.bias"), f32_cpu(param(&format!("{from}.bias"))?)?));
        out.push((format!("{i}.running_mean"), f32_cpu(buffer(&format!("{from}.running_mean"))?)?));
        out.push((format!("{i}.running_var"), f32_cpu(buffer(&format!("{from}.running_var"))?)?));
        out.push((format!("{i}.num_batches_tracked"), Tensor::new(batches, &Device::Cpu)?));
        Ok(())
    };
    let put_linear = |out: &mut Named, layers: &mut Vec<String>, i: usize, from: &str| -> TrainResult<()> {
        let w = param(&format!("{from}.weight"))?;
        let (o, inp) = w.dims2()?;
        out.push((format!("{i}.weight"), f32_cpu(w)?));
        let bias = ck.model.get(&format!("{from}.bias"));
        if let Some(b) = bias {
            out.push((format!("{i}.bias"), f32_cpu(b)?));
        }
        layers.push(format!("Linear({inp}, {o}, bias={})", if bias.is_some() { "True" } else { "False" }));
        Ok(())
    };
    match &run.head {
        Head::Projector(p) => {
            let mut i = 0;
            for l in 0..p.layers {
                put_linear(&mut out, &mut layers, i, &format!("projector.{l}.linear"))?;
                i += 1;
                let hidden = l + 1 < p.layers;
                if p.layers >= 3 && hidden {
                    put_bn(&mut out, &mut layers, i, &format!("projector.{l}.bn"))?;
                    i += 1;
                }
                if hidden {
                    layers.push("ReLU()".into());
                    i += 1;
                }
            }
        }
        Head::Embedding { dropout } => {
            put_bn(&mut out, &mut layers, 0, "backbone.embedding.bn1")?;
            layers.push(format!("Dropout(p={dropout})"));
            put_linear(&mut out, &mut layers, 2, "backbone.embedding.fc")?;
            put_bn(&mut out, &mut layers, 3, "backbone.embedding.bn2")?;
        }
    }
    Ok((out, layers))
}

fn save(tensors: Named, path: &Path) -> TrainResult<()> {
    let map: HashMap<String, Tensor> = tensors.into_iter().collect();
    allgrad_models::save_safetensors(&map, path)?;
    Ok(())
}

fn write(run: &Run, ck: &Checkpoint, format: ExportFormat, out: &Path) -> TrainResult<()> {
    if let Some(why) = refusal(format, &run.encoder) {
        return Err(setup(why));
    }
    let cfg = &run.encoder;
    // PyTorch counts a batch norm's training forwards in `num_batches_tracked` and reads it only
    // with momentum=None; allgrad keeps no such count, and writes the optimizer steps of the
    // checkpoint (config.json says so).
    let batches = ck.state.step as i64;
    let backbone = export_encoder(cfg, &ck.model, &ck.buffers, run.prefix, batches)?;
    let (head, layers) = head_tensors(run, ck, batches)?;
    std::fs::create_dir_all(out).map_err(|source| TrainError::Io { action: "creating", path: out.to_path_buf(), source })?;
    save(backbone, &out.join("model.safetensors"))?;
    let head_file = if matches!(run.head, Head::Projector(_)) { "projector.safetensors" } else { "embedding.safetensors" };
    save(head, &out.join(head_file))?;

    let c = cfg.in_channels;
    // As the config wrote them (0.286, not the f64 nearest to the f32 0.286), one per channel.
    let per_channel = |v: &[f32]| -> Vec<f64> {
        let v: Vec<f64> = v.iter().map(|x| x.to_string().parse().unwrap_or(f64::from(*x))).collect();
        if v.len() == 1 {
            vec![v[0]; c]
        } else {
            v
        }
    };
    let (mean, std, size) = match run.augment {
        Some(a) => (per_channel(&a.normalize.mean), per_channel(&a.normalize.std), a.crop.as_ref().map(|cr| cr.size)),
        None => (Vec::new(), Vec::new(), None),
    };
    let name = standard_model(cfg).ok();
    let arch = format!("resnet{}", cfg.depth);
    let input_size = size.map(|s| json!([c, s, s]));
    let mut config = json!({
        "architecture": arch,
        "format": format.name(),
        "method": run.method,
        "depth": cfg.depth,
        "width": cfg.width,
        "in_channels": c,
        "stem": if cfg.stem == Stem::Imagenet { "imagenet" } else { "cifar" },
        "num_features": backbone_features(cfg),
        "input_size": input_size,
        "input_size_note": if size.is_some() { "the training crops' size (data.augment.crop.size)" } else { "the data set's own image size (no crop)" },
        "mean": mean,
        "std": std,
        "normalization_note": "pixels in [0, 1], then (x - mean) / std per channel, as the run's data.augment.normalize",
        "torchvision_model": name.filter(|_| c == 3),
        "timm_model": name,
        "note": note(cfg),
        "num_batches_tracked": format!(
            "the optimizer steps of the checkpoint ({batches}); allgrad does not count batch-norm forwards, and PyTorch reads \
             the count only when a BatchNorm's momentum is None"
        ),
        "step": ck.state.step,
    });
    // The head's layers, under `projector` or `embedding`.
    config
        .as_object_mut()
        .unwrap()
        .insert(head_file.trim_end_matches(".safetensors").into(), json!({ "file": head_file, "sequential": layers }));
    if format == ExportFormat::Timm {
        // timm's own keys, as in the config.json of its Hugging Face Hub models.
        let o = config.as_object_mut().unwrap();
        o.insert("num_classes".into(), json!(0));
        o.insert(
            "pretrained_cfg".into(),
            json!({ "input_size": input_size, "mean": mean, "std": std, "num_classes": 0, "in_chans": c }),
        );
        o.insert("model_args".into(), json!({ "in_chans": c, "num_classes": 0 }));
    }
    let path = out.join("config.json");
    let text = serde_json::to_string_pretty(&config).map_err(|e| setup(e.to_string()))?;
    std::fs::write(&path, text + "\n").map_err(|source| TrainError::Io { action: "writing", path, source })?;
    Ok(())
}

fn backbone_features(cfg: &ResNetConfig) -> usize {
    (cfg.width << 3) * if cfg.depth == 50 { 4 } else { 1 }
}

/// The insightface backbone of a face run, whole, under insightface's names
/// (`model.safetensors`), and a `config.json` saying which constructor loads it.
fn write_insightface(
    cfg: &InsightfaceConfig,
    ck: &Checkpoint,
    augment: Option<&AugmentConfig>,
    format: ExportFormat,
    out: &Path,
) -> TrainResult<()> {
    let model = cfg.insightface_model();
    if format != ExportFormat::Safetensors {
        return Err(setup(format!(
            "--format {}: an insightface backbone (model.kind iresnet or mobilefacenet) exports under insightface's own \
             names: `--format safetensors`",
            format.name()
        )));
    }
    let batches = ck.state.step as i64;
    let tensors = insightface::export(cfg, &ck.model, &ck.buffers, "backbone.", batches)?;
    std::fs::create_dir_all(out).map_err(|source| TrainError::Io { action: "creating", path: out.to_path_buf(), source })?;
    save(tensors, &out.join("model.safetensors"))?;
    let (arch, depth) = match cfg.arch {
        Arch::IResNet { depth, .. } => (format!("iresnet{depth}"), Some(depth)),
        Arch::MobileFaceNet { .. } => ("mobilefacenet".to_string(), None),
    };
    let note = match &model {
        Ok(m) => format!(
            "insightface's recognition/arcface_torch/backbones: {m} loads model.safetensors \
             (safetensors.torch.load_file) with load_state_dict(strict=True); its forward takes {0}x{0} faces",
            cfg.input_size
        ),
        Err(why) => format!(
            "no insightface constructor builds this shape ({why}); the names are those of insightface's {arch} built with \
             these settings"
        ),
    };
    let (mean, std) = match augment {
        Some(a) => (a.normalize.mean.clone(), a.normalize.std.clone()),
        None => (Vec::new(), Vec::new()),
    };
    let mut config = json!({
        "architecture": arch,
        "format": format.name(),
        "method": "face",
        "depth": depth,
        "in_channels": cfg.in_channels,
        "input_size": [cfg.in_channels, cfg.input_size, cfg.input_size],
        "embedding": cfg.embedding,
        "insightface_model": model.as_ref().ok(),
        "mean": mean,
        "std": std,
        "normalization_note": "pixels in [0, 1], then (x - mean) / std per channel, as the run's data.augment.normalize",
        "note": note,
        "num_batches_tracked": format!("the optimizer steps of the checkpoint ({batches}); allgrad does not count batch-norm forwards"),
        "step": ck.state.step,
    });
    let o = config.as_object_mut().unwrap();
    match cfg.arch {
        Arch::IResNet { width, .. } => {
            o.insert("width".into(), json!(width));
            o.insert("dropout".into(), json!(cfg.dropout));
        }
        Arch::MobileFaceNet { scale, blocks } => {
            o.insert("scale".into(), json!(scale));
            o.insert("blocks".into(), json!(blocks));
        }
    }
    let path = out.join("config.json");
    let text = serde_json::to_string_pretty(&config).map_err(|e| setup(e.to_string()))?;
    std::fs::write(&path, text + "\n").map_err(|source| TrainError::Io { action: "writing", path, source })?;
    Ok(())
}
