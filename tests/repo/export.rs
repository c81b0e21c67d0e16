//! `export` of a ResNet run for PyTorch, and `model.init_from` back in.
//!
//! - A standard ResNet-18 (width 64, the ImageNet stem, 3 channels) after 3 SimCLR steps
//!   exports for torchvision and timm; both load it with `load_state_dict(strict=True)` and give
//!   the features (and the projector's outputs) that allgrad computes from the checkpoint
//!   (`scripts/reference/check_resnet_export.py`, through ALLGRAD_PYTHON).
//! - The export's names and shapes are those of torchvision's resnet18 state dict (its 122
//!   entries less `fc.weight` and `fc.bias`), and `model.init_from` of it starts a run from
//!   exactly the trained parameters (a step at a learning rate of 1e-30 leaves them as they
//!   are); a file of another shape is refused naming the first mismatched keys with both shapes.
//! - The CPU demos' encoder (width 8, the cifar stem, 1 channel) is refused by `--format
//!   torchvision` naming the width and pointing to `--format safetensors`, which writes it with
//!   a note.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::Duration;

use allgrad::candle::{DType, Device, Tensor};
use allgrad::candle_nn::VarBuilder;
use allgrad::models::batch_norm::{load_running_buffers, Mode};
use allgrad::models::image_ssl::{Projector, ProjectorConfig};
use allgrad::models::resnet::{ResNet, ResNetConfig, Stem};

use crate::common;

const LIMIT: Duration = Duration::from_secs(600);

fn ok(what: &str, out: &Output) {
    assert!(
        out.status.success(),
        "{what} failed\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn run(cmd: &mut Command) -> Output {
    common::run_with_watchdog(cmd, LIMIT).0
}

/// A CIFAR-10 folder of binary batches (5 training files of 8 images, a test file of 8), with
/// pixels that differ everywhere.
fn write_cifar(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let files: Vec<String> = (1..=5).map(|i| format!("data_batch_{i}.bin")).chain(["test_batch.bin".into()]).collect();
    for (f, name) in files.iter().enumerate() {
        let mut bytes = Vec::new();
        for i in 0..8u64 {
            bytes.push((i % 10) as u8);
            let px = allgrad_testkit::hashed_values(3072, 100 * f as u64 + i);
            bytes.extend(px.iter().map(|v| ((v + 1.0) * 127.5) as u8));
        }
        std::fs::write(dir.join(name), bytes).unwrap();
    }
}

fn encoder_cfg(width: usize, in_channels: usize, stem: Stem) -> ResNetConfig {
    ResNetConfig { depth: 18, width, in_channels, stem, sync_bn: false }
}

const STANDARD_MODEL: &str =
    "{kind: resnet, encoder: {depth: 18, width: 64, in_channels: 3, stem: imagenet, sync_bn: false}, projector: {hidden: 0, out: 32, layers: 3}}";

/// A SimCLR config on the CIFAR folder `data` with `model`, 3 steps of 8 images, no evaluation.
fn simclr_config(data: &Path, model: &str, lr: &str) -> String {
    format!(
        "seed: 3\nmethod: simclr\n\
         data:\n  kind: images\n  dir: {}\n  format: cifar10\n  augment:\n    crop: {{size: 32, scale: [0.5, 1.0], ratio: [0.75, 1.3333]}}\n\
         model: {model}\n\
         loss: {{kind: nt_xent, temperature: 0.2}}\n\
         optim: {{kind: lars, lr: {lr}, momentum: 0.9, weight_decay: 1.0e-6}}\n\
         train: {{global_batch: 8, epochs: 1, max_steps: 3, eval: false}}\n\
         checkpoint: {{every: 3, keep_last: 1}}\nlog: {{every: 1, progress: lines}}\n",
        data.display()
    )
}

fn train(dir: &Path, name: &str, config: &str, sets: &[&str]) -> (Output, PathBuf) {
    let cfg = dir.join(format!("{name}.yaml"));
    std::fs::write(&cfg, config).unwrap();
    let out_dir = dir.join(name);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_train"));
    cmd.arg("--config").arg(&cfg).arg("--output-dir").arg(&out_dir).env_remove("RANK");
    for s in sets {
        cmd.args(["--set", s]);
    }
    (run(&mut cmd), out_dir)
}

fn export(run_dir: &Path, format: &str) -> Output {
    run(Command::new(env!("CARGO_BIN_EXE_export")).arg("--run").arg(run_dir).args(["--format", format]))
}

/// The standard run, trained and exported once for the tests of this file (both formats).
struct Standard {
    _dir: tempfile::TempDir,
    root: PathBuf,
    cifar: PathBuf,
    run: PathBuf,
}

fn standard() -> &'static Standard {
    static RUN: OnceLock<Standard> = OnceLock::new();
    RUN.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_path_buf();
        let cifar = root.join("cifar");
        write_cifar(&cifar);
        let (out, run_dir) = train(&root, "standard", &simclr_config(&cifar, STANDARD_MODEL, "0.5"), &[]);
        ok("train (standard ResNet-18)", &out);
        for f in ["torchvision", "timm"] {
            ok(&format!("export --format {f}"), &export(&run_dir, f));
        }
        Standard { _dir: dir, root, cifar, run: run_dir }
    })
}

fn load(path: &Path) -> HashMap<String, Tensor> {
    allgrad::candle::safetensors::load(path, &Device::Cpu).unwrap()
}

/// The names of torchvision's `resnet18().state_dict()` (122 entries) less `fc.weight` and
/// `fc.bias`, written out from torchvision's BasicBlock: per block conv1, bn1, conv2, bn2, and
/// in the first block of stages 2 to 4 downsample.0 (conv) and downsample.1 (batch norm).
fn torchvision_resnet18_names() -> Vec<String> {
    let bn = |p: &str| ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"].map(|s| format!("{p}.{s}"));
    let mut names = vec!["conv1.weight".to_string()];
    names.extend(bn("bn1"));
    for stage in 1..=4 {
        for block in 0..2 {
            let b = format!("layer{stage}.{block}");
            for i in 1..=2 {
                names.push(format!("{b}.conv{i}.weight"));
                names.extend(bn(&format!("{b}.bn{i}")));
            }
            if stage > 1 && block == 0 {
                names.push(format!("{b}.downsample.0.weight"));
                names.extend(bn(&format!("{b}.downsample.1")));
            }
        }
    }
    names
}

#[test]
fn the_export_has_torchvisions_resnet18_names_and_shapes_and_the_trained_values() {
    let s = standard();
    let ck = allgrad::train::checkpoint::load_latest(&s.run, &Device::Cpu).unwrap().expect("a checkpoint");
    assert_eq!(ck.state.step, 3);
    for format in ["torchvision", "timm"] {
        let dir = s.run.join("export").join(format);
        let file = load(&dir.join("model.safetensors"));
        let mut got: Vec<&String> = file.keys().collect();
        got.sort();
        let mut want = torchvision_resnet18_names();
        assert_eq!(want.len() + 2, 122, "torchvision's resnet18 state dict has 122 entries with fc");
        want.sort();
        assert_eq!(got, want.iter().collect::<Vec<_>>(), "{format}");
        assert_eq!(file["conv1.weight"].dims(), [64, 3, 7, 7]);
        assert_eq!(file["layer4.0.downsample.0.weight"].dims(), [512, 256, 1, 1]);
        assert_eq!(file["layer4.1.bn2.running_var"].dims(), [512]);
        assert_eq!(file["bn1.num_batches_tracked"].dtype(), DType::I64);
        assert_eq!(file["bn1.num_batches_tracked"].to_scalar::<i64>().unwrap(), 3);
        // Values: every parameter and running statistic is the checkpoint's, and the trained
        // ones moved away from their initial values (batch-norm weights start at 1).
        for (name, t) in &file {
            if name.ends_with("num_batches_tracked") {
                continue;
            }
            let key = format!("encoder.{name}");
            let from =
                ck.model.get(&key).or_else(|| ck.buffers.get(&key)).unwrap_or_else(|| panic!("{key} not in the checkpoint"));
            assert_eq!(t.dtype(), DType::F32);
            let diff =
                (t - from.to_dtype(DType::F32).unwrap()).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert_eq!(diff, 0.0, "{format}: {name}");
        }
        let bn_w = file["bn1.weight"].to_vec1::<f32>().unwrap();
        assert!(bn_w.iter().any(|w| (w - 1.0).abs() > 1e-6), "bn1.weight did not train: {bn_w:?}");
        let rv = file["bn1.running_var"].to_vec1::<f32>().unwrap();
        assert!(rv.iter().any(|v| (v - 1.0).abs() > 1e-6), "bn1.running_var is still its initial value");

        let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
        assert_eq!(config["architecture"], "resnet18");
        assert_eq!(config["width"], 64);
        assert_eq!(config["in_channels"], 3);
        assert_eq!(config["input_size"], serde_json::json!([3, 32, 32]));
        assert_eq!(config["mean"].as_array().unwrap().len(), 3);
        assert_eq!(config["projector"]["file"], "projector.safetensors");
        let projector = load(&dir.join("projector.safetensors"));
        assert_eq!(projector["0.weight"].dims(), [512, 512]);
        assert_eq!(projector["1.running_mean"].dims(), [512]);
        assert_eq!(projector["3.weight"].dims(), [512, 512]);
        assert_eq!(projector["6.weight"].dims(), [32, 512]);
        if format == "timm" {
            assert_eq!(config["pretrained_cfg"]["input_size"], serde_json::json!([3, 32, 32]));
            assert_eq!(config["num_classes"], 0);
        }
    }
}

/// allgrad's features and projector outputs of `x`, from the newest checkpoint of `run`
/// (evaluation mode: running statistics), built from the checkpoint's own names.
fn allgrad_outputs(run: &Path, enc: &ResNetConfig, proj: &ProjectorConfig, x: &Tensor) -> (Tensor, Tensor) {
    let ck = allgrad::train::checkpoint::load_latest(run, &Device::Cpu).unwrap().unwrap();
    let vb = VarBuilder::from_tensors(ck.model.clone(), DType::F32, &Device::Cpu);
    let net = ResNet::new(enc, vb.pp("encoder")).unwrap();
    let head = Projector::new(proj, net.feature_dim(), false, vb.pp("projector")).unwrap();
    let bns: Vec<_> = net.batch_norms().into_iter().chain(head.batch_norms()).collect();
    load_running_buffers(&bns, &ck.buffers).unwrap();
    let pg = allgrad::dist::ProcessGroup::single();
    let mode = Mode { train: false, pg: &pg };
    let f = net.forward(x, mode).unwrap();
    let p = head.forward(&f, mode).unwrap();
    (f, p)
}

/// Largest relative difference allowed between PyTorch's f32 outputs and allgrad's: the two
/// sum the convolutions in different orders (allgrad's Winograd and im2col kernels, oneDNN's),
/// each rounding at 2^-24 relative, over 20 layers; measured about 1e-6.
const TORCH_TOL: f64 = 1e-4;

#[test]
fn a_standard_resnet18_loads_strictly_in_torchvision_and_timm_and_gives_allgrads_features() {
    let Some(python) = std::env::var_os("ALLGRAD_PYTHON").filter(|p| !p.is_empty()) else {
        return allgrad_testkit::skip(
            allgrad_testkit::Need::Torch,
            "ALLGRAD_PYTHON is not set: no Python with torch, torchvision and timm to load the export",
        );
    };
    let s = standard();
    let x = Tensor::from_vec(
        allgrad_testkit::hashed_values(4 * 3 * 32 * 32, 77).into_iter().map(|v| (2.0 * v) as f32).collect::<Vec<f32>>(),
        (4, 3, 32, 32),
        &Device::Cpu,
    )
    .unwrap();
    let proj = ProjectorConfig { hidden: 0, out: 32, layers: 3, bias: true };
    let (f, p) = allgrad_outputs(&s.run, &encoder_cfg(64, 3, Stem::Imagenet), &proj, &x);
    let inputs = s.root.join("inputs.safetensors");
    let map: HashMap<String, Tensor> = [("x".to_string(), x), ("features".into(), f), ("projections".into(), p)].into();
    allgrad::models::save_safetensors(&map, &inputs).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/reference/check_resnet_export.py");
    for (format, loaders) in [("torchvision", "torchvision,timm"), ("timm", "timm")] {
        let dir = s.run.join("export").join(format);
        let out = run(Command::new(&python)
            .arg(&script)
            .arg("--dir")
            .arg(&dir)
            .arg("--inputs")
            .arg(&inputs)
            .args(["--loaders", loaders]));
        ok(&format!("check_resnet_export.py on the {format} export"), &out);
        let lines: Vec<serde_json::Value> =
            String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), loaders.split(',').count(), "{lines:?}");
        for l in &lines {
            eprintln!("{format} export in {}: {l}", l["loader"]);
            assert_eq!(l["features"], serde_json::json!([4, 512]), "{l}");
            for k in ["features_rel", "projections_rel"] {
                let e = l[k].as_f64().unwrap();
                assert!(e <= TORCH_TOL, "{format} export loaded by {}: {k} {e:e} > {TORCH_TOL:e}", l["loader"]);
            }
        }
    }
}

#[test]
fn init_from_an_export_starts_a_run_from_its_parameters_and_a_mismatched_file_is_refused() {
    let s = standard();
    let file = s.run.join("export/torchvision/model.safetensors");
    let model = format!(
        "{{kind: resnet, encoder: {{depth: 18, width: 64, in_channels: 3, stem: imagenet, sync_bn: false}}, \
         projector: {{hidden: 0, out: 32, layers: 3}}, init_from: {}}}",
        file.display()
    );
    // One step at a learning rate of 1e-30: the parameters stay where init_from put them.
    let (out, again) =
        train(&s.root, "again", &simclr_config(&s.cifar, &model, "1.0e-30"), &["train.max_steps=1", "checkpoint.every=1"]);
    ok("train with model.init_from", &out);
    let trained = allgrad::train::checkpoint::load_latest(&s.run, &Device::Cpu).unwrap().unwrap();
    let started = allgrad::train::checkpoint::load_latest(&again, &Device::Cpu).unwrap().unwrap();
    assert_eq!(started.state.step, 1);
    let mut compared = 0;
    for (name, t) in &trained.model {
        if !name.starts_with("encoder.") {
            continue;
        }
        let u = &started.model[name];
        let diff = (t - u).unwrap().abs().unwrap().max_all().unwrap().to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap();
        assert_eq!(diff, 0.0, "{name}: the run did not start from the export");
        compared += 1;
    }
    assert_eq!(compared, 60, "ResNet-18 has 60 parameter tensors (20 convolutions, 20 batch norms x 2)");
    // The projector is not in the file: it starts from the seed (it differs from the trained one).
    let p = "projector.0.linear.weight";
    let d = (&trained.model[p] - &started.model[p]).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    assert!(d > 0.0);

    // A width-8 encoder from the width-64 file: refused before training, naming keys and shapes.
    let small = model.replace("width: 64", "width: 8");
    let (out, _) = train(&s.root, "mismatch", &simclr_config(&s.cifar, &small, "0.5"), &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("model.init_from") && err.contains(&file.display().to_string()), "{err}");
    assert!(err.contains("conv1.weight: file [64, 3, 7, 7], model [8, 3, 7, 7]"), "{err}");
    assert!(err.contains("bn1.weight: file [64], model [8]"), "{err}");
    // A file of other names (a checkpoint's own `encoder.` names) is refused the same way.
    let ck_file = s.root.join("prefixed.safetensors");
    let prefixed: HashMap<String, Tensor> =
        trained.model.iter().filter(|(k, _)| k.starts_with("encoder.")).map(|(k, v)| (k.clone(), v.clone())).collect();
    allgrad::models::save_safetensors(&prefixed, &ck_file).unwrap();
    let (out, _) = train(
        &s.root,
        "prefixed",
        &simclr_config(&s.cifar, &model.replace(&file.display().to_string(), &ck_file.display().to_string()), "0.5"),
        &[],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("conv1.weight: file (missing), model [64, 3, 7, 7]")
            && err.contains("encoder.bn1.bias: file [64], model (none)"),
        "{err}"
    );
}

#[test]
fn the_cpu_demos_encoder_is_refused_by_torchvision_and_written_to_safetensors_with_a_note() {
    let d = tempfile::tempdir().unwrap();
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/simclr.yaml");
    let run_dir = d.path().join("demo");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_train"));
    cmd.arg("--config").arg(&demo).arg("--output-dir").arg(&run_dir).env_remove("RANK");
    cmd.args(["--set", "train.max_steps=2", "--set", "train.eval=false", "--set", "checkpoint.every=2"]);
    ok("train configs/simclr.yaml (2 steps)", &run(&mut cmd));

    for format in ["torchvision", "timm"] {
        let out = export(&run_dir, format);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{format}: {err}");
        assert!(err.contains("model.encoder.width is 8") && err.contains("--format safetensors"), "{format}: {err}");
        assert!(err.contains("model.encoder.stem is cifar"), "{format}: {err}");
        assert!(!run_dir.join("export").join(format).exists(), "{format}: a refused export left a folder");
    }
    ok("export --format safetensors", &export(&run_dir, "safetensors"));
    let dir = run_dir.join("export/safetensors");
    let file = load(&dir.join("model.safetensors"));
    let mut got: Vec<&String> = file.keys().collect();
    got.sort();
    let mut want = torchvision_resnet18_names();
    want.sort();
    assert_eq!(got, want.iter().collect::<Vec<_>>());
    assert_eq!(file["conv1.weight"].dims(), [8, 1, 3, 3]);
    assert_eq!(file["layer4.1.conv2.weight"].dims(), [64, 64, 3, 3]);
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let note = config["note"].as_str().unwrap();
    assert!(note.contains("no ResNet-18 of this shape") && note.contains("width is 8"), "{note}");
    assert!(note.contains("model.maxpool = torch.nn.Identity()"), "{note}");
    assert_eq!(config["torchvision_model"], serde_json::Value::Null);
    assert_eq!(config["input_size"], serde_json::json!([1, 28, 28]));
    // As configs/simclr.yaml writes them, not the f64 nearest to the f32 it is read into.
    assert_eq!(config["mean"], serde_json::json!([0.286]));
    assert_eq!(config["std"], serde_json::json!([0.353]));
}
