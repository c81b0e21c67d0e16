//! SigLIP against `transformers` 5.24's `SiglipModel`: a tiny random model that
//! `scripts/reference/siglip_reference.py write` makes with `SiglipConfig` and saves with
//! `save_pretrained` (fixed seed, no download), read here as a Hugging Face folder: its
//! parameter names and shapes are exactly those allgrad's SigLIP towers ask for; token ids,
//! image and text features (pooled and projected, not normalised), logits and the sigmoid loss
//! of three images and captions equal transformers' in f32; and a folder exported from changed
//! weights (`logit_bias` included) loads in `SiglipModel` and gives allgrad's numbers
//! (`siglip_reference.py check`). Needs ALLGRAD_PYTHON (torch and transformers).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use allgrad_dist::ProcessGroup;
use allgrad_models::clip::{export_clip_folder, siglip_loss, Architecture, ClipFolder, ClipModel, ImageProcessor};
use allgrad_testkit::close::{assert_rel, rel_err};
use allgrad_testkit::Need;
use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/reference/siglip_reference.py");

/// Runs the script with `args` through ALLGRAD_PYTHON (None: skipped) and returns its stdout;
/// `must_pass`: a failure fails the test (else the caller reads the output).
fn script(args: &[&Path], must_pass: bool) -> Option<(bool, String)> {
    let Some(python) = std::env::var_os("ALLGRAD_PYTHON").filter(|p| !p.is_empty()).map(PathBuf::from) else {
        allgrad_testkit::skip(Need::Torch, "ALLGRAD_PYTHON (a Python with torch and transformers) is unset");
        return None;
    };
    let mut cmd = std::process::Command::new(&python);
    cmd.arg(SCRIPT).args(args);
    let (out, _) = allgrad_testkit::process::run(&mut cmd, "siglip_reference.py", std::time::Duration::from_secs(300));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!must_pass || out.status.success(), "{} {SCRIPT} {args:?}: {}\n{text}", python.display(), out.status);
    Some((out.status.success(), text))
}

/// The script's images: pixel (b, c, y, x) = sin(0.37 (s y + x) + b + c) + 0.1 b, as f32.
fn pixels(c: usize, s: usize) -> Tensor {
    let mut v = Vec::with_capacity(3 * c * s * s);
    for b in 0..3 {
        for ch in 0..c {
            for y in 0..s {
                for x in 0..s {
                    v.push(((0.37 * (s * y + x) as f64 + (b + ch) as f64).sin() + 0.1 * b as f64) as f32);
                }
            }
        }
    }
    Tensor::from_vec(v, (3, c, s, s), &Device::Cpu).unwrap()
}

fn flat(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap()
}

fn flat_json(v: &serde_json::Value) -> Vec<f64> {
    match v {
        serde_json::Value::Array(a) => a.iter().flat_map(flat_json).collect(),
        x => vec![x.as_f64().unwrap()],
    }
}

/// allgrad's outputs on the script's inputs, as the JSON `check` reads.
fn outputs(dir: &Path, captions: &[String]) -> serde_json::Value {
    let f = ClipFolder::open(dir).unwrap();
    assert_eq!(f.config.model_type, Architecture::Siglip, "{}: read as SigLIP", dir.display());
    let model = f.model(DType::F32, &Device::Cpu).unwrap();
    let tok = f.tokenizer(f.config.text_config.max_position_embeddings).unwrap();
    let ids: Vec<Vec<u32>> = captions.iter().map(|c| tok.encode(c).unwrap()).collect();
    let v = &f.config.vision_config;
    let img = model.vision.forward(&pixels(v.num_channels, v.image_size)).unwrap();
    let txt = model.text.forward(&ids, tok.pad_id(), &Device::Cpu).unwrap();
    let logits = model.logits(&img, &txt).unwrap();
    let bias = model.logit_bias.as_ref().expect("SigLIP has a logit bias");
    let loss = siglip_loss(&img, &txt, &model.logit_scale, bias, &ProcessGroup::single()).unwrap();
    serde_json::json!({
        "captions": captions,
        "ids": ids,
        "image_features": img.to_vec2::<f32>().unwrap(),
        "text_features": txt.to_vec2::<f32>().unwrap(),
        "logits_per_image": logits.to_vec2::<f32>().unwrap(),
        "loss": loss.to_scalar::<f32>().unwrap(),
    })
}

#[test]
fn tiny_siglip_matches_transformers_and_an_export_loads_in_siglipmodel() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    if script(&[Path::new("write"), &src], true).is_none() {
        return;
    }
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("reference.json")).unwrap()).unwrap();

    // The parameters allgrad's SigLIP asks for are exactly SiglipModel's, with their shapes.
    let folder = ClipFolder::open(&src).unwrap();
    let vars = VarMap::new();
    ClipModel::new(&VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu), &folder.config).unwrap();
    let ours: HashMap<String, Vec<usize>> =
        vars.data().lock().unwrap().iter().map(|(k, v)| (k.clone(), v.dims().to_vec())).collect();
    let theirs: HashMap<String, Vec<usize>> = reference["parameters"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_array().unwrap().iter().map(|d| d.as_u64().unwrap() as usize).collect()))
        .collect();
    let mut missing: Vec<_> = theirs.keys().filter(|k| !ours.contains_key(*k)).collect();
    let mut extra: Vec<_> = ours.keys().filter(|k| !theirs.contains_key(*k)).collect();
    missing.sort();
    extra.sort();
    assert!(missing.is_empty() && extra.is_empty(), "not asked for: {missing:?}; not in SiglipModel: {extra:?}");
    for (k, shape) in &theirs {
        assert_eq!(&ours[k], shape, "shape of {k}");
    }

    // Features, logits and loss in f32 against transformers.
    let captions: Vec<String> = reference["captions"].as_array().unwrap().iter().map(|c| c.as_str().unwrap().into()).collect();
    let got = outputs(&src, &captions);
    assert_eq!(got["ids"], reference["ids"], "token ids");
    // Measured: relative errors (norm-wise) printed below, bound 1e-5 (f32).
    for key in ["image_features", "text_features", "logits_per_image", "loss"] {
        let (g, w) = (flat_json(&got[key]), flat_json(&reference[key]));
        println!("{key} vs transformers SiglipModel: relative error {:.2e}", rel_err(&g, &w));
        assert_rel(&g, &w, 1e-5, &format!("{key} vs transformers SiglipModel"));
    }

    // Export changed weights (every tensor scaled and shifted, so the export is not the source
    // file): the folder loads in SiglipModel and gives allgrad's numbers.
    let params: HashMap<String, Tensor> = candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(k, t)| {
            let t = t.affine(1.03, 0.01).unwrap();
            (k, t)
        })
        .collect();
    let out = tmp.path().join("out");
    let processor = ImageProcessor::of_folder(&src, &ClipFolder::open(&src).unwrap().config).unwrap();
    export_clip_folder(&params, &src, &out, &processor).unwrap();
    let written = candle_core::safetensors::load(out.join("model.safetensors"), &Device::Cpu).unwrap();
    let bias = written.get("logit_bias").expect("the export writes logit_bias");
    assert_eq!(flat(bias), vec![(-2.5f32 * 1.03 + 0.01) as f64], "logit_bias written");
    let exported = outputs(&out, &captions);
    let moved = rel_err(&flat_json(&exported["logits_per_image"]), &flat_json(&got["logits_per_image"]));
    assert!(moved > 1e-2, "the exported weights compute the source's logits (relative change {moved:e})");
    let json = tmp.path().join("allgrad.json");
    std::fs::write(&json, exported.to_string()).unwrap();
    let (ok, text) = script(&[Path::new("check"), &out, &json], false).unwrap();
    println!("{text}");
    assert!(ok, "siglip_reference.py check:\n{text}");
    let seen = text.lines().filter(|l| l.starts_with("allgrad vs transformers SiglipModel")).count();
    assert_eq!(seen, 4, "the check printed {seen} errors, not 4:\n{text}");
}
