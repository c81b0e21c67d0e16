//! CLIP's image preprocessing against `transformers`' `CLIPImageProcessor` (its Pillow
//! backend, `scripts/reference/clip_preprocess.py` through ALLGRAD_PYTHON) on the committed
//! photographs of several aspect ratios (`tests/data/clip-images/`, written by
//! `scripts/data/make_clip_images.py`): the processor's `preprocessor_config.json`, read by
//! allgrad, gives the processor's pixel values from the pixels Pillow decoded (to float
//! rounding: the same bytes after the resize), and from allgrad's own JPEG decoder within the
//! decoders' difference (stated). A preprocessor config with a resample filter allgrad does not
//! run is an error naming it and the file. (And the objective's pretrained weights are dropped
//! once `build` has copied them into the parameters.)

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use allgrad_data::{decode_image, ColorMode, Image, ViewKey};
use allgrad_models::clip::ImageProcessor;

fn images() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/clip-images")
}

const FILES: [&str; 6] = ["wide.jpg", "tall.jpg", "square.jpg", "small.jpg", "gray.jpg", "photo.png"];

/// The reference script's JSON for `settings`, and the folder it saved its config in.
fn reference(python: &Path, settings: &[&str], out: &Path) -> serde_json::Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/reference/clip_preprocess.py");
    let mut cmd = Command::new(python);
    cmd.arg(&script).arg(out).args(settings).args(FILES.iter().map(|f| images().join(f)));
    let (res, _) = allgrad_testkit::process::run(&mut cmd, "clip_preprocess.py", Duration::from_secs(300));
    assert!(res.status.success(), "{}", String::from_utf8_lossy(&res.stderr));
    serde_json::from_slice(&res.stdout).unwrap()
}

fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

/// Largest and mean absolute difference.
fn diff(a: &[f32], b: &[f32]) -> (f32, f32) {
    assert_eq!(a.len(), b.len());
    let max = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    let mean = a.iter().zip(b).map(|(x, y)| (x - y).abs()).sum::<f32>() / a.len() as f32;
    (max, mean)
}

#[test]
fn pixel_values_equal_transformers_clip_image_processor_on_photographs() {
    let Some(python) = std::env::var_os("ALLGRAD_PYTHON").filter(|p| !p.is_empty()).map(PathBuf::from) else {
        return allgrad_testkit::skip(
            allgrad_testkit::Need::Torch,
            "ALLGRAD_PYTHON is not set: no Python with transformers to preprocess the photographs",
        );
    };
    let key = ViewKey { seed: 0, epoch: 0, index: 0, view: 0 };
    // The defaults (shortest side 224, centre crop 224, bicubic: upscaling every photograph
    // here), and a 64-pixel model with the bilinear filter (downscaling).
    for settings in [&[][..], &["--shortest", "64", "--crop", "64", "--resample", "2"][..]] {
        let dir = tempfile::tempdir().unwrap();
        let want = reference(&python, settings, dir.path());
        let processor = ImageProcessor::read(&dir.path().join("preprocessor_config.json")).unwrap();
        let pipeline = processor.pipeline(3, None).unwrap();
        for f in FILES {
            let r = &want[f];
            let values = floats(&r["values"]);
            let shape: Vec<usize> = r["shape"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect();
            // Pillow's decoded pixels through allgrad's preprocessing: the processor's values.
            let d = &r["decoded"];
            let bytes: Vec<u8> = d["bytes"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u8).collect();
            let pil =
                Image::new(d["width"].as_u64().unwrap() as usize, d["height"].as_u64().unwrap() as usize, 3, bytes).unwrap();
            let same = pipeline.apply(&pil, key).unwrap();
            assert_eq!(vec![same.channels, same.height, same.width], shape, "{f} {settings:?}");
            let (max, _) = diff(&same.data, &values);
            println!("{f} {settings:?}: from Pillow's pixels, largest difference {max:.2e}");
            assert!(max <= 1e-6, "{f} {settings:?}: preprocessing differs from transformers' by {max:.2e}");
            // allgrad's own decoder: the JPEG decoders' rounding differs (a PNG decodes alike).
            let file = images().join(f);
            let ours = decode_image(&std::fs::read(&file).unwrap(), ColorMode::Rgb, &file).unwrap();
            let (max, mean) = diff(&pipeline.apply(&ours, key).unwrap().data, &values);
            println!("{f} {settings:?}: from allgrad's decoder, largest difference {max:.3} (mean {mean:.4})");
            if f.ends_with(".png") {
                assert!(max <= 1e-6, "{f}: {max:.2e}");
            } else {
                assert!(max <= JPEG_MAX && mean <= JPEG_MEAN, "{f} {settings:?}: {max:.3} (mean {mean:.4})");
            }
        }
    }
}

/// The decoders' difference, in normalised units (one byte is 1/255/std, about 0.015): zune-jpeg
/// and libjpeg-turbo round their IDCT and chroma upsampling differently.
const JPEG_MAX: f32 = 0.1;
const JPEG_MEAN: f32 = 0.01;

#[test]
fn a_preprocessor_config_with_a_filter_allgrad_does_not_run_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("preprocessor_config.json");
    let config = |resample: i64| {
        format!(r#"{{"size": {{"shortest_edge": 32}}, "crop_size": {{"height": 32, "width": 32}}, "resample": {resample}}}"#)
    };
    for (code, name) in [(1, "1 (Lanczos)"), (0, "0 (nearest)"), (7, "7 (unknown)")] {
        std::fs::write(&file, config(code)).unwrap();
        let e = ImageProcessor::read(&file).unwrap_err().to_string();
        assert!(e.contains(&format!("resample {name} is not supported")) && e.contains("preprocessor_config.json"), "{e}");
    }
    std::fs::write(&file, config(3)).unwrap();
    let p = ImageProcessor::read(&file).unwrap();
    assert_eq!((p.shortest_edge, p.crop, p.resample), (Some(32), Some([32, 32]), allgrad_data::Resample::Bicubic));
    // Written back, it reads to the same settings.
    p.write(&file).unwrap();
    assert_eq!(ImageProcessor::read(&file).unwrap(), p);
}

#[test]
fn pretrained_weights_are_dropped_once_copied_into_the_parameters() {
    use allgrad_models::clip::{Clip, ClipData, ClipLoss, ClipModelSection};
    use allgrad_models::Objective;
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let model = ClipModelSection { dir: repo.join("data/clip-tiny"), pretrained: true, max_len: None, mean: None, std: None };
    let data = ClipData {
        images: Some(repo.join("data/fashion-mnist")),
        classes: (0..10).map(|c| vec![format!("class {c}")]).collect(),
        templates: vec!["a {}".into()],
        limit: Some(16),
        ..Default::default()
    };
    let mut clip = Clip::new(&model, ClipLoss::default(), &data, 0, 8, candle_core::Device::Cpu).unwrap();
    assert!(clip.holds_pretrained_weights());
    let vars = candle_nn::VarMap::new();
    clip.build(candle_nn::VarBuilder::from_varmap(&vars, candle_core::DType::F32, &candle_core::Device::Cpu)).unwrap();
    assert!(!clip.holds_pretrained_weights(), "the safetensors are still held after build");
    // The parameters hold the folder's values.
    let file = candle_core::safetensors::load(repo.join("data/clip-tiny/model.safetensors"), &candle_core::Device::Cpu).unwrap();
    let want = file["logit_scale"].to_vec0::<f32>().unwrap();
    assert_eq!(clip.model().unwrap().logit_scale.to_vec0::<f32>().unwrap(), want);
}
