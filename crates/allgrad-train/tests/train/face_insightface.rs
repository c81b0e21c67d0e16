//! The face method with insightface's backbones (`model.kind: iresnet` and `mobilefacenet`)
//! through the trainer, on a small RecordIO set of 32x32 gray faces:
//!
//! - a width-4 IResNet-18 (with dropout 0.2) and a scale-1 MobileFaceNet train 3 SGD steps on
//!   2 and 3 ranks with the same losses and parameters as on 1 rank (f64, 1e-10, Partial FC at
//!   rate 0.5 with the sparse update), and the loss moves;
//! - `precision: bf16` trains a step with each, its loss within bf16's rounding of the f32 run's;
//! - `export --format safetensors` of a trained IResNet run writes the checkpoint under
//!   insightface's names (every tensor equal to the checkpoint's; `features.weight` 1;
//!   `num_batches_tracked` the steps), which `scripts/reference/insightface_backbones.py` (an
//!   independent PyTorch IResNet with insightface's module names, through ALLGRAD_PYTHON)
//!   loads with `strict=True` and whose embeddings of four faces equal allgrad's from the
//!   checkpoint (f32); `--format torchvision` is refused pointing to safetensors;
//! - keys that do not fit (a depth insightface has no IResNet of, an `input_size` that is not
//!   the crop size or not a multiple of 16, a zero width or stack, 2 input channels, dropout
//!   of 1, MobileFaceNet's unknown `dropout`) are refused when the config is read, naming the key.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use allgrad_dist::{run_threads, ProcessGroup};
use allgrad_models::batch_norm::{load_running_buffers, Mode};
use allgrad_models::face::backbone::{Backbone, FaceModel, Pass};
use allgrad_testkit::close::{assert_elem_rel, assert_rel};
use allgrad_testkit::{hashed_values, Need};
use allgrad_train::method::resnet_export::{export_run, ExportFormat};
use allgrad_train::{run, RunConfig};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;

use crate::face_support::{train, write_recordio};

/// `dir/train.{rec,idx}` and `property`: 36 records of 6 identities.
fn write_data(dir: &Path) {
    write_recordio(dir, 32);
}

// 32x32 inputs: the last stage's maps are 2x2 (on 1x1 maps a padded 3x3 convolution would
// be a 1x1 one, and more biases would have a zero gradient).
const IRESNET: &str = "{kind: iresnet, depth: 18, width: 4, in_channels: 1, input_size: 32, embedding: 8, dropout: 0.2}";
const MBF: &str = "{kind: mobilefacenet, scale: 1, blocks: [1, 1, 1, 1], in_channels: 1, input_size: 32, embedding: 8}";

fn config(dir: &Path, model: &str, dtype: &str, extra: &str) -> RunConfig {
    let text = format!(
        "seed: 5\n\
         dtype: {dtype}\n{extra}\
         method: face\n\
         data:\n  kind: recordio\n  dir: {dir}\n  color: gray\n\
         \x20 augment: {{crop: {{size: 32, scale: [0.6, 1.0], ratio: [0.8, 1.25]}}, flip: {{p: 0.5}}, \
         color_jitter: {{p: 0.0}}, grayscale: {{p: 0.0}}, blur: {{p: 0.0}}, normalize: {{mean: [0.5], std: [0.5]}}}}\n\
         model: {model}\n\
         head: {{num_classes: 6, margin: {{kind: arcface, s: 16}}, sample_rate: 0.5}}\n\
         optim: {{kind: sgd, lr: 0.1, momentum: 0.9, weight_decay: 0.0005}}\n\
         train: {{global_batch: 12, epochs: 1, max_steps: 3, eval: false}}\n\
         checkpoint: {{every: 0}}\n\
         log: {{progress: quiet, plot: false}}\n",
        dir = dir.display(),
    );
    RunConfig::parse(&text, Path::new("face-insightface-test.yaml"), &[]).unwrap()
}

/// Whether parameter `n` has a gradient of exactly zero in exact arithmetic, so that it holds
/// rounding noise only: the batch-norm biases that add a per-channel constant to a tensor
/// which reaches the loss only through batch norms, after maps that keep a per-channel
/// constant one (1x1 convolutions without padding, flatten and a linear layer, the residual
/// sum), so that every path subtracts it again. In IResNet the residual stream (each block's
/// `bn3`, a downsampling shortcut's batch norm) is read only by the next block's `bn1`, a 1x1
/// shortcut and its batch norm, or `bn2`; `fc`'s bias reaches `features` as one vector for
/// every sample (`bn2`'s would too without dropout, whose masks differ per sample). In MobileFaceNet the depthwise blocks' last layer (a LinearBlock:
/// convolution and batch norm, `<block>.layers.2.layers.1`) feeds the residual stream, read
/// only by 1x1 ConvBlocks; the global depthwise convolution's batch norm feeds the linear
/// layer and the last batch norm.
fn noise_only(n: &str) -> bool {
    let n = n.strip_prefix("backbone.").unwrap_or(n);
    let iresnet = n.starts_with("layer") && (n.ends_with(".bn3.bias") || n.ends_with(".downsample.1.bias"));
    let mbf = n.starts_with("layers.") && n.ends_with(".layers.2.layers.1.bias");
    iresnet || mbf || ["fc.bias", "features.layers.0.layers.1.bias"].contains(&n)
}

#[test]
fn iresnet_and_mobilefacenet_face_runs_on_2_and_3_ranks_equal_1_rank_f64() {
    let dir = tempfile::tempdir().unwrap();
    write_data(dir.path());
    for (name, model) in [("iresnet", IRESNET), ("mobilefacenet", MBF)] {
        let cfg = config(dir.path(), model, "f64", "");
        let stops = [1, 2, 3];
        let one = train(&cfg, 1, None, false, &stops);
        assert!(one.losses.iter().all(|l| l.is_finite() && *l > 0.0), "{name}: {:?}", one.losses);
        assert!(one.losses[2] != one.losses[0], "{name}: the loss did not move: {:?}", one.losses);
        assert!(one.params.contains_key("backbone.layer4.1.conv2.weight") || name != "iresnet", "{name}: names");
        assert!(one.params.contains_key("backbone.conv_sep.layers.2.weight") || name != "mobilefacenet", "{name}: names");
        // IResNet's features.weight is no parameter (held at 1).
        assert!(!one.params.contains_key("backbone.features.weight"), "{name}");
        // The noise-only batch-norm biases stay at their initial 0 up to rounding (weight decay
        // of 0 is 0): their gradient is 0. (`fc.bias` starts uniform, and decays.)
        let noise: Vec<&String> = one.params.keys().filter(|n| noise_only(n) && !n.ends_with("fc.bias")).collect();
        assert!(noise.len() >= 4, "{name}: {noise:?}");
        for n in &noise {
            let worst = one.params[*n].iter().fold(0.0f64, |m, v| m.max(v.abs()));
            assert!(worst <= 1e-12, "{name}: {n} moved to {worst:e}: its gradient is not zero");
        }
        for w in [2, 3] {
            let run = train(&cfg, w, None, false, &stops);
            let what = format!("{name} W={w} vs W=1");
            assert_elem_rel(&run.losses, &one.losses, 1e-10, f64::MIN_POSITIVE, &format!("{what}: losses"));
            assert_eq!(run.params.keys().collect::<Vec<_>>(), one.params.keys().collect::<Vec<_>>(), "{what}");
            for (n, want) in &one.params {
                if noise_only(n) {
                    let worst = run.params[n].iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
                    assert!(worst <= 1e-12, "{what}: {n} differs by {worst}");
                } else {
                    assert_rel(&run.params[n], want, 1e-10, &format!("{what}: {n}"));
                }
            }
        }
    }
}

/// bf16 autocast against f32 over one step: bf16 keeps 8 significant bits of every
/// activation (3.9e-3 relative), over ~20 layers; measured 6.2e-5 (IResNet) and 1.4e-3
/// (MobileFaceNet).
const BF16_LOSS: f64 = 1e-2;

#[test]
fn a_bf16_step_with_iresnet_and_mobilefacenet_stays_near_the_f32_one() {
    let dir = tempfile::tempdir().unwrap();
    write_data(dir.path());
    for (name, model) in [("iresnet", IRESNET), ("mobilefacenet", MBF)] {
        let full = train(&config(dir.path(), model, "f32", ""), 1, None, false, &[1]);
        let bf16 = train(&config(dir.path(), model, "f32", "precision: bf16\n"), 1, None, false, &[1]);
        eprintln!("{name}: loss f32 {:.6}, bf16 {:.6}", full.losses[0], bf16.losses[0]);
        assert!(bf16.losses[0].is_finite(), "{name}: {:?}", bf16.losses);
        assert_elem_rel(&bf16.losses, &full.losses, BF16_LOSS, f64::MIN_POSITIVE, &format!("{name}: bf16 vs f32 loss"));
        assert!(bf16.params.values().flatten().all(|v| v.is_finite()), "{name}: a bf16 step left a non-finite parameter");
    }
}

/// allgrad's f32 embeddings of `x` from the newest checkpoint of `run` (evaluation mode).
fn allgrad_embeddings(run: &Path, model: &FaceModel, x: &Tensor) -> Tensor {
    let ck = allgrad_train::checkpoint::load_latest(run, &Device::Cpu).unwrap().unwrap();
    let vb = VarBuilder::from_tensors(ck.model.clone(), DType::F32, &Device::Cpu);
    let net = Backbone::new(model, 0, vb.pp("backbone")).unwrap();
    load_running_buffers(&net.batch_norms(), &ck.buffers).unwrap();
    let pg = ProcessGroup::single();
    net.forward(x, Pass { mode: Mode { train: false, pg: &pg }, seed: 0, step: 0, indices: &[0, 1, 2, 3] }).unwrap()
}

/// Largest difference allowed between PyTorch's f32 embeddings of the export and allgrad's,
/// relative to the largest |embedding|: f32 sums in different orders over ~40 layers (as
/// FORWARD_TOL of the models' test, where PyTorch's own f32 forward is 1.2e-6 from its f64
/// one); measured 5.4e-7.
const EXPORT_TOL: f64 = 1e-5;

#[test]
fn an_exported_iresnet_run_has_insightfaces_names_and_loads_strictly_in_pytorch() {
    let dir = tempfile::tempdir().unwrap();
    write_data(dir.path());
    let run_dir = dir.path().join("run");
    let mut cfg = config(dir.path(), IRESNET, "f32", "");
    cfg.checkpoint.every = 3;
    let rd = run_dir.clone();
    run_threads(1, |pg| Ok(run::build(&cfg, pg, Some(rd.clone()), false)?.train().map(|_| ())?)).unwrap();

    let err = export_run(&run_dir, ExportFormat::Torchvision, None).unwrap_err().to_string();
    assert!(err.contains("--format safetensors"), "{err}");
    let out = export_run(&run_dir, ExportFormat::Safetensors, None).unwrap();
    let exported = candle_core::safetensors::load(out.join("model.safetensors"), &Device::Cpu).unwrap();
    let ck = allgrad_train::checkpoint::load_latest(&run_dir, &Device::Cpu).unwrap().unwrap();
    let mut compared = 0;
    for (name, t) in &exported {
        let from = ck.model.get(&format!("backbone.{name}")).or_else(|| ck.buffers.get(&format!("backbone.{name}")));
        match from {
            Some(c) => {
                let d = (t - c).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                assert_eq!(d, 0.0, "{name}: the export is not the checkpoint");
                compared += 1;
            }
            None if name.ends_with("num_batches_tracked") => assert_eq!(t.to_scalar::<i64>().unwrap(), 3, "{name}"),
            None if name == "features.weight" => {
                assert_eq!(t.to_vec1::<f32>().unwrap(), vec![1.0; 8], "{name}")
            }
            None => panic!("{name}: in the export, not in the checkpoint"),
        }
    }
    let backbone = ck.model.keys().chain(ck.buffers.keys()).filter(|k| k.starts_with("backbone.")).count();
    assert_eq!(compared, backbone, "every parameter and running statistic of the backbone is in the export");
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["architecture"], "iresnet18");
    assert!(config["note"].as_str().unwrap().contains("model.width is 4"), "{config}");

    let Some(python) = std::env::var_os("ALLGRAD_PYTHON").filter(|p| !p.is_empty()).map(PathBuf::from) else {
        return allgrad_testkit::skip(Need::Torch, "ALLGRAD_PYTHON (a Python with torch and safetensors) is unset");
    };
    let v: Vec<f32> = hashed_values(4 * 32 * 32, 9).into_iter().map(|v| (2.0 * v) as f32).collect();
    let x = Tensor::from_vec(v, (4, 1, 32, 32), &Device::Cpu).unwrap();
    let model: FaceModel = serde_yaml::from_str(IRESNET).unwrap();
    let emb = allgrad_embeddings(&run_dir, &model, &x);
    let io = dir.path().join("io.safetensors");
    allgrad_models::save_safetensors(&HashMap::from([("x".to_string(), x), ("emb".into(), emb)]), &io).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/reference/insightface_backbones.py");
    let mut cmd = std::process::Command::new(&python);
    cmd.arg(&script).args(["check", "--arch", "iresnet18", "--width", "4", "--in-channels", "1", "--input-size", "32"]);
    cmd.args(["--embedding", "8", "--weights"]).arg(out.join("model.safetensors")).arg("--inputs").arg(&io);
    let (o, _) = allgrad_testkit::process::run(&mut cmd, "insightface_backbones.py", std::time::Duration::from_secs(300));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "check failed: {stdout}\n{}", String::from_utf8_lossy(&o.stderr));
    let line: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    eprintln!("export loaded by PyTorch (strict): {line}");
    assert_eq!(line["emb"], serde_json::json!([4, 8]));
    let e = line["f32_rel"].as_f64().unwrap();
    assert!(e <= EXPORT_TOL, "PyTorch's f32 embeddings of the export are {e:e} from allgrad's (> {EXPORT_TOL:e})");
}

#[test]
fn insightface_model_keys_that_do_not_fit_are_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let check = |model: &str| -> String {
        let text = format!(
            "method: face\ndata:\n  kind: recordio\n  dir: {}\n  augment: {{crop: {{size: 32}}}}\nmodel: {model}\n\
             head: {{num_classes: 6}}\ntrain: {{global_batch: 12}}\n",
            dir.path().display()
        );
        let path = Path::new("face-insightface-keys.yaml");
        match RunConfig::parse(&text, path, &[]) {
            Err(e) => e.to_string(),
            Ok(cfg) => cfg.validate(1, path).err().map(|e| e.to_string()).unwrap_or_default(),
        }
    };
    let cases = [
        ("{kind: iresnet, depth: 51, input_size: 32}", "model.depth", "18, 34, 50, 100 or 200, got 51"),
        ("{kind: iresnet, depth: 50}", "model.input_size", "is 112, and data.augment.crop.size is 32"),
        ("{kind: iresnet, depth: 18, input_size: 24}", "model.input_size", "multiple of 16"),
        ("{kind: iresnet, depth: 18, input_size: 32, width: 0}", "model.width", "must be positive"),
        ("{kind: iresnet, depth: 18, input_size: 32, in_channels: 2}", "model.in_channels", "must be 1 or 3, got 2"),
        ("{kind: iresnet, depth: 18, input_size: 32, dropout: 1.0}", "model.dropout", "[0, 1)"),
        ("{kind: mobilefacenet, input_size: 32, blocks: [1, 0, 1, 1]}", "model.blocks", "at least one block"),
        ("{kind: mobilefacenet, input_size: 32, dropout: 0.1}", "dropout", "unknown field"),
    ];
    for (model, key, words) in cases {
        let err = check(model);
        assert!(err.contains(key) && err.contains(words), "{model}: expected `{key}` and `{words}` in: {err}");
    }
    assert_eq!(check("{kind: iresnet, depth: 18, input_size: 32}"), "", "a config that fits");
}
