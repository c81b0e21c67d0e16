//! insightface's face backbones (`model.kind: iresnet`, `mobilefacenet`) against PyTorch.
//!
//! The reference is `scripts/reference/insightface_backbones.py`, through ALLGRAD_PYTHON: no
//! PyPI package ships arcface_torch's backbones, so it is an independent PyTorch
//! implementation of insightface's `iresnet.py` and `mobilefacenet.py`, module for module,
//! whose `state_dict()` has the names of insightface's `backbone.pth`.
//!
//! - The state dicts of IResNet-18, -34, -50, -100 and -200 (width 64, 112x112, 512
//!   features), of a width-16 IResNet-18, and of MobileFaceNet (`get_mbf`, `get_mbf_large`)
//!   have the same names and shapes in allgrad's layout as in the reference's, entry for
//!   entry (the structure of the large networks, checked without running them).
//! - A width-16 IResNet-18 and `get_mbf`'s MobileFaceNet, random weights and running
//!   statistics saved by PyTorch (`torch.save`, as insightface's `backbone.pth`), converted by
//!   `scripts/data/convert_insightface_backbone.py` and loaded through `model.init_from`, embed three random
//!   112x112 faces (evaluation mode, f32) as PyTorch's f64 forward does, within
//!   [`FORWARD_TOL`]; the error is printed.
//! - Without Python: a backbone's tensors written under insightface's names by
//!   `insightface::export` and read back by `model.init_from` give bit-identical embeddings;
//!   a file of another width is refused naming the keys and both shapes, and one whose
//!   `features.weight` is not 1 naming that key.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use allgrad_dist::ProcessGroup;
use allgrad_models::batch_norm::{running_buffers, Mode};
use allgrad_models::face::backbone::{Backbone, FaceModel, Pass};
use allgrad_models::face::insightface::{self, Slot};
use allgrad_testkit::{hashed_values, Need};
use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};

/// Runs `scripts/reference/insightface_backbones.py ARGS` with ALLGRAD_PYTHON (torch and
/// safetensors); `None` after a skip line when it is unset.
fn reference(args: &[&OsStr]) -> Option<String> {
    script("reference/insightface_backbones.py", args)
}

/// Runs `scripts/<path> ARGS` with ALLGRAD_PYTHON.
fn script(path: &str, args: &[&OsStr]) -> Option<String> {
    let Some(python) = std::env::var_os("ALLGRAD_PYTHON").filter(|p| !p.is_empty()).map(PathBuf::from) else {
        allgrad_testkit::skip(Need::Torch, "ALLGRAD_PYTHON (a Python with torch and safetensors) is unset");
        return None;
    };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts").join(path);
    let mut cmd = std::process::Command::new(&python);
    cmd.arg(&script).args(args);
    let (o, _) = allgrad_testkit::process::run(&mut cmd, "insightface_backbones.py", std::time::Duration::from_secs(300));
    let (stdout, stderr) = (String::from_utf8(o.stdout).unwrap(), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{} {args:?}: {}\n{stdout}\n{stderr}", script.display(), o.status);
    Some(stdout)
}

fn os(args: &[&str]) -> Vec<std::ffi::OsString> {
    args.iter().map(|a| a.into()).collect()
}

fn iresnet(depth: usize, width: usize, init_from: Option<PathBuf>) -> FaceModel {
    FaceModel::Iresnet { depth, width, in_channels: 3, input_size: 112, embedding: 512, dropout: 0.0, sync_bn: false, init_from }
}

fn mbf(scale: usize, blocks: [usize; 4], init_from: Option<PathBuf>) -> FaceModel {
    FaceModel::Mobilefacenet { scale, blocks, in_channels: 3, input_size: 112, embedding: 512, sync_bn: false, init_from }
}

/// The reference's architecture flags for `model`.
fn flags(model: &FaceModel) -> Vec<String> {
    let (cfg, _) = model.insightface().unwrap();
    let mut f: Vec<String> = match cfg.arch {
        insightface::Arch::IResNet { depth, width } => vec![format!("iresnet{depth}"), "--width".into(), width.to_string()],
        insightface::Arch::MobileFaceNet { scale, blocks } => {
            vec!["mbf".into(), "--scale".into(), scale.to_string(), "--blocks".into(), blocks.map(|b| b.to_string()).join(",")]
        }
    };
    f.insert(0, "--arch".into());
    f.extend(["--in-channels".into(), cfg.in_channels.to_string(), "--input-size".into(), cfg.input_size.to_string()]);
    f.extend(["--embedding".into(), cfg.embedding.to_string()]);
    f
}

#[test]
fn iresnet_18_to_200_and_mobilefacenets_have_the_references_state_dict_names_and_shapes() {
    let cases = [
        iresnet(18, 64, None),
        iresnet(34, 64, None),
        iresnet(50, 64, None),
        iresnet(100, 64, None),
        iresnet(200, 64, None),
        iresnet(18, 16, None),
        mbf(2, [1, 4, 6, 2], None),
        mbf(4, [2, 8, 12, 4], None),
    ];
    // One Python process for all (importing torch costs seconds on the CI machine).
    let mut args = Vec::new();
    for (i, model) in cases.iter().enumerate() {
        if i > 0 {
            args.push("--next".to_string());
        }
        args.push("layout".into());
        args.extend(flags(model));
    }
    let Some(out) = reference(&args.iter().map(OsStr::new).collect::<Vec<_>>()) else { return };
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), cases.len(), "{out}");
    for (model, line) in cases.iter().zip(lines) {
        let f = flags(model);
        let want: HashMap<String, Vec<usize>> = serde_json::from_str(line).unwrap();
        let (cfg, _) = model.insightface().unwrap();
        let layout = insightface::layout(&cfg).unwrap();
        let got: HashMap<String, Vec<usize>> = layout.iter().map(|e| (e.name.clone(), e.shape.clone())).collect();
        assert_eq!(got.len(), layout.len(), "{f:?}: a name twice in allgrad's layout");
        let mut missing: Vec<_> = want.iter().filter(|(k, v)| got.get(*k) != Some(v)).collect();
        let mut extra: Vec<_> = got.iter().filter(|(k, _)| !want.contains_key(*k)).collect();
        missing.sort();
        extra.sort();
        assert!(
            missing.is_empty() && extra.is_empty(),
            "{f:?}: reference entries not in allgrad's layout (or of another shape): {missing:?}; allgrad's not in the \
             reference: {extra:?}"
        );
        let params: usize =
            layout.iter().filter(|e| matches!(e.slot, Slot::Param | Slot::Unit)).map(|e| e.shape.iter().product::<usize>()).sum();
        eprintln!("{f:?}: {} state-dict entries, {params} parameter values", layout.len());
    }
}

/// Largest error allowed of allgrad's f32 embeddings against PyTorch's f64 forward of the
/// same network, relative to the largest |embedding|: f32 rounds at 6e-8 relative per
/// operation, and the convolutions (allgrad's Winograd and im2col kernels) sum in orders of
/// their own over about 40 layers; PyTorch's own f32 forward is 1.2e-6 (IResNet-18) and
/// 1.8e-6 (MobileFaceNet) from its f64 one. allgrad's measured 9.2e-7 and 2.1e-6; the bound is
/// about five times the larger.
const FORWARD_TOL: f64 = 1e-5;

/// A backbone built through `model` (its `init_from`), in f32.
fn build(model: &FaceModel) -> (Backbone, VarMap) {
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    (Backbone::new(model, 0, vb.pp("backbone")).unwrap(), vm)
}

fn embed(b: &Backbone, x: &Tensor) -> Tensor {
    let pg = ProcessGroup::single();
    let idx: Vec<usize> = (0..x.dim(0).unwrap()).collect();
    b.forward(x, Pass { mode: Mode { train: false, pg: &pg }, seed: 0, step: 0, indices: &idx }).unwrap()
}

/// max |a - b| / max |b|.
fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_dtype(DType::F64).unwrap();
    let b = b.to_dtype(DType::F64).unwrap();
    let d = (&a - &b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap();
    d / b.abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap()
}

#[test]
fn iresnet18_and_mobilefacenet_loaded_from_pytorch_weights_embed_as_pytorch_does() {
    for (name, model) in [("IResNet-18 width 16", iresnet(18, 16, None)), ("MobileFaceNet (get_mbf)", mbf(2, [1, 4, 6, 2], None))]
    {
        let dir = tempfile::tempdir().unwrap();
        let mut args = os(&["make", "--out"]);
        args.push(dir.path().into());
        args.extend(flags(&model).iter().map(|s| s.into()));
        let Some(_) = reference(&args.iter().map(|a| a.as_os_str()).collect::<Vec<_>>()) else { return };
        // insightface's backbone.pth through the shipped converter.
        let (pth, weights) = (dir.path().join("backbone.pth"), dir.path().join("converted.safetensors"));
        let out = script("data/convert_insightface_backbone.py", &[pth.as_os_str(), weights.as_os_str()]).unwrap();
        assert!(out.contains("tensors"), "{out}");
        let model = match model {
            FaceModel::Iresnet { depth, width, .. } => iresnet(depth, width, Some(weights)),
            FaceModel::Mobilefacenet { scale, blocks, .. } => mbf(scale, blocks, Some(weights)),
            _ => unreachable!(),
        };
        let io = candle_core::safetensors::load(dir.path().join("io.safetensors"), &Device::Cpu).unwrap();
        let (net, _) = build(&model);
        let emb = embed(&net, &io["x"]);
        assert_eq!(emb.dims(), [3, 512]);
        let (e64, e32) = (rel(&emb, &io["emb64"]), rel(&io["emb"], &io["emb64"]));
        eprintln!(
            "{name}: allgrad f32 vs PyTorch f64 {e64:.2e} (PyTorch f32 vs f64 {e32:.2e}), vs PyTorch f32 {:.2e}",
            rel(&emb, &io["emb"])
        );
        assert!(e64 <= FORWARD_TOL, "{name}: allgrad's embeddings are {e64:e} from PyTorch's f64 ones (> {FORWARD_TOL:e})");
        // Not a comparison of two near-constant outputs: the embeddings spread.
        let std = io["emb64"].flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let mean = std.iter().sum::<f64>() / std.len() as f64;
        assert!(std.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / std.len() as f64 > 0.1, "{name}: degenerate embeddings");
    }
}

/// A small IResNet or MobileFaceNet (16x16 inputs) with `init_from`.
fn small(kind: &str, width: usize, init_from: Option<PathBuf>) -> FaceModel {
    match kind {
        "iresnet" => FaceModel::Iresnet {
            depth: 18,
            width,
            in_channels: 3,
            input_size: 16,
            embedding: 8,
            dropout: 0.0,
            sync_bn: false,
            init_from,
        },
        _ => FaceModel::Mobilefacenet {
            scale: 1,
            blocks: [2, 1, 1, 1],
            in_channels: 3,
            input_size: 16,
            embedding: 8,
            sync_bn: false,
            init_from,
        },
    }
}

/// The backbone's tensors under insightface's names, as `export` writes them, with running
/// statistics moved off their initial values by training-mode forwards.
fn exported(kind: &str, width: usize, path: &Path, x: &Tensor) -> Backbone {
    let model = small(kind, width, None);
    let (net, vm) = build(&model);
    let pg = ProcessGroup::single();
    let idx: Vec<usize> = (0..x.dim(0).unwrap()).collect();
    for _ in 0..2 {
        net.forward(x, Pass { mode: Mode { train: true, pg: &pg }, seed: 0, step: 0, indices: &idx }).unwrap();
    }
    let params: HashMap<String, Tensor> =
        vm.data().lock().unwrap().iter().map(|(k, v)| (k.clone(), v.as_tensor().clone())).collect();
    let buffers: HashMap<String, Tensor> = running_buffers(&net.batch_norms()).unwrap().into_iter().collect();
    let (cfg, _) = model.insightface().unwrap();
    let tensors = insightface::export(&cfg, &params, &buffers, "backbone.", 2).unwrap();
    allgrad_models::save_safetensors(&tensors.into_iter().collect(), path).unwrap();
    net
}

#[test]
fn an_export_read_back_through_init_from_embeds_bit_for_bit_and_mismatched_files_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let v: Vec<f32> = hashed_values(4 * 3 * 16 * 16, 54).into_iter().map(|v| (2.0 * v) as f32).collect();
    let x = Tensor::from_vec(v, (4, 3, 16, 16), &Device::Cpu).unwrap();
    for kind in ["iresnet", "mobilefacenet"] {
        let file = dir.path().join(format!("{kind}.safetensors"));
        let original = exported(kind, 4, &file, &x);
        let (again, _) = build(&small(kind, 4, Some(file.clone())));
        let (a, b) = (embed(&original, &x), embed(&again, &x));
        assert_eq!(rel(&b, &a), 0.0, "{kind}: init_from of its own export embeds differently");
        // Against a fresh network (no init_from): the file did set the values.
        let (fresh, _) = build(&small(kind, 4, None));
        assert!(rel(&embed(&fresh, &x), &a) > 1e-3, "{kind}: the file changed nothing");
    }
    // A width-8 file into a width-4 IResNet: refused naming keys and shapes.
    let wide = dir.path().join("wide.safetensors");
    exported("iresnet", 8, &wide, &x);
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    let err = Backbone::new(&small("iresnet", 4, Some(wide.clone())), 0, vb.pp("backbone")).err().unwrap().to_string();
    assert!(err.contains("model.init_from") && err.contains(&wide.display().to_string()), "{err}");
    assert!(err.contains("conv1.weight: file [8, 3, 3, 3], model [4, 3, 3, 3]"), "{err}");
    // IResNet's features.weight must be 1.
    let mut t = candle_core::safetensors::load(dir.path().join("iresnet.safetensors"), &Device::Cpu).unwrap();
    t.insert("features.weight".into(), Tensor::full(1.5f32, 8, &Device::Cpu).unwrap());
    let odd = dir.path().join("odd.safetensors");
    allgrad_models::save_safetensors(&t, &odd).unwrap();
    let err = Backbone::new(&small("iresnet", 4, Some(odd)), 0, vb.pp("other")).err().unwrap().to_string();
    assert!(err.contains("features.weight differs from 1 by up to 5e-1"), "{err}");
}
