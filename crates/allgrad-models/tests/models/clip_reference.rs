//! CLIP against `transformers` 5.24's `CLIPModel` on the committed tiny random model
//! `data/clip-tiny` (written by `scripts/data/make_tiny_clip.py` with fixed seeds): token
//! ids, image and text features (projected, not normalised), logits and loss of three images
//! and captions, f32. The values below were printed by
//!
//!     $PYTHON scripts/data/make_tiny_clip.py --reference
//!
//! and an exported folder read back equals the source; a learned logit bias is exported and
//! read back.

use std::path::PathBuf;

use allgrad_dist::ProcessGroup;
use allgrad_models::clip::{clip_loss, export_clip_folder, ClipFolder, ImageProcessor};
use allgrad_testkit::close::{assert_rel, rel_err};
use candle_core::{DType, Device, Tensor};

fn folder() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/clip-tiny"))
}

const CAPTIONS: [&str; 3] = ["a photo of a sneaker.", "a black and white photo of the dress", "this is an ankle boot for sale"];

const IDS: [&[u32]; 3] = [
    &[705, 320, 670, 665, 320, 691, 269, 706],
    &[705, 320, 587, 573, 704, 670, 665, 695, 617, 706],
    &[705, 697, 542, 563, 578, 590, 629, 680, 706],
];

#[rustfmt::skip]
const IMAGE_FEATURES: [f64; 96] = [-1.626875162e+00, -8.314544559e-01, 3.233954310e-02, -1.767179847e+00, 1.207356930e+00, 4.993307590e-01, -4.864807129e-01, -8.914844990e-01, -2.575764060e-01, 5.101009011e-01, 4.128480554e-01, -2.145946503e+00, 5.773388743e-01, 3.667261899e-01, -9.160908461e-01, -1.916927576e+00, -6.950536966e-01, 4.036791921e-01, -7.666238546e-01, -2.508248687e-01, 2.585404634e+00, 1.074650168e+00, 1.154199004e+00, -1.423354864e+00, 1.698725224e-01, 7.435005903e-01, -5.682370663e-01, -1.074032187e+00, 2.031843066e-01, -6.277928352e-01, -1.419553876e+00, -1.158008352e-01, -1.753618002e+00, -8.420087099e-01, -1.397864819e-01, -1.760929823e+00, 1.197916865e+00, 4.493356347e-01, -4.407237768e-01, -8.903743029e-01, -2.605067194e-01, 4.859394431e-01, 4.812164307e-01, -2.125174046e+00, 7.083308697e-01, 3.710532188e-01, -1.069187641e+00, -1.954345584e+00, -8.132278323e-01, 5.509775877e-01, -7.619109750e-01, -4.033342898e-01, 2.771356583e+00, 1.217198849e+00, 1.073258638e+00, -1.404740334e+00, 1.888133883e-01, 7.449234724e-01, -5.461729765e-01, -1.029558897e+00, 2.601905167e-01, -7.260208726e-01, -1.345355749e+00, -2.008751035e-02, -1.664637566e+00, -8.541398644e-01, -5.581203103e-02, -1.791214108e+00, 1.072715640e+00, 4.959382415e-01, -3.867485523e-01, -8.932254314e-01, -2.988332808e-01, 3.854356706e-01, 4.608676434e-01, -2.105989218e+00, 7.235766649e-01, 3.508694172e-01, -1.228943706e+00, -2.019345999e+00, -9.622296691e-01, 5.702620745e-01, -7.172186375e-01, -4.463352561e-01, 2.870563269e+00, 1.285428286e+00, 1.090007782e+00, -1.434566259e+00, 2.733081579e-01, 6.767756939e-01, -4.206461310e-01, -8.976496458e-01, 1.821860373e-01, -8.570874333e-01, -1.253473759e+00, -4.900470376e-03];
#[rustfmt::skip]
const TEXT_FEATURES: [f64; 96] = [3.706139922e-01, -1.602164865e+00, 5.906293392e-01, 6.508227587e-01, 2.371345758e-01, -8.991585374e-01, -7.788566351e-01, -1.244174480e+00, 1.084241867e+00, -1.352857351e+00, -7.254309654e-01, 5.817813277e-01, 6.433712244e-01, 6.418132782e-01, 7.751356959e-01, 8.243200779e-01, 1.343383670e+00, -4.347622395e-03, 1.232709885e+00, -1.328806281e+00, 7.462655902e-01, 5.943551064e-01, 1.357246161e+00, -1.406096458e+00, -1.687558889e+00, -1.006755948e+00, 6.727176309e-01, -1.366476059e+00, -1.338977695e+00, 9.936485291e-01, 3.023267090e-01, 2.450611889e-01, -1.072933078e-01, -1.834385872e+00, -3.348648548e-02, 2.645333707e-01, 9.288017750e-01, -8.513639569e-01, -5.616798401e-01, -3.677180409e-01, -2.731335163e-02, 2.701162100e-01, -1.695049763e+00, 3.776192069e-01, 1.164967060e+00, 7.108395100e-01, -6.221459508e-01, 1.806392908e+00, 7.761014104e-01, -8.726179004e-01, 4.600321054e-01, -1.019640326e+00, 8.367472887e-01, 2.597817183e-01, 9.761301279e-01, -1.398185730e+00, -8.600351810e-01, -8.580684662e-03, 4.507406652e-01, -8.796936274e-01, -6.834259033e-01, -3.429409862e-02, 6.527645588e-01, -2.663561702e-01, 5.494631529e-01, -1.455012083e+00, -7.178635001e-01, -3.934532404e-01, 3.769609332e-02, -4.715901315e-01, -1.210060596e+00, -6.558499336e-01, -3.820360899e-01, -1.437878609e+00, -6.493630409e-01, 8.838322759e-01, 8.720161915e-01, -1.312378943e-01, -1.783226579e-01, 7.123557925e-01, 8.101998568e-01, -9.680180550e-01, 6.542026997e-01, -1.718596458e+00, 7.188706398e-01, 3.900310397e-01, -3.866168559e-01, -2.904349864e-01, -2.149412632e+00, -3.894747198e-01, 1.380091608e-01, -4.873481393e-02, -1.701200604e+00, 2.033998370e-01, -2.502682209e-01, 6.614637375e-01];
#[rustfmt::skip]
const LOGITS_PER_IMAGE: [f64; 9] = [3.541128011e-03, 1.628045559e+00, -5.948247910e-01, -1.046699733e-01, 1.620351911e+00, -4.424324334e-01, -1.694004536e-01, 1.555809379e+00, -3.792843521e-01];
const LOSS: f64 = 1.244898796e+00;

/// The script's inputs: pixel (b, y, x) = sin(0.37 (28 y + x) + b) + 0.1 b, as f32.
fn pixels() -> Tensor {
    let mut v = Vec::new();
    for b in 0..3 {
        for y in 0..28 {
            for x in 0..28 {
                v.push(((0.37 * (28 * y + x) as f64 + b as f64).sin() + 0.1 * b as f64) as f32);
            }
        }
    }
    Tensor::from_vec(v, (3, 1, 28, 28), &Device::Cpu).unwrap()
}

fn flat(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap()
}

/// Image features, text features, logits, loss and token ids.
type Outputs = (Vec<f64>, Vec<f64>, Vec<f64>, f64, Vec<Vec<u32>>);

/// Features, logits and loss of the folder's model on the script's inputs, in f32.
fn outputs(dir: &std::path::Path) -> Outputs {
    let f = ClipFolder::open(dir).unwrap();
    let model = f.model(DType::F32, &Device::Cpu).unwrap();
    let tok = f.tokenizer(16).unwrap();
    let ids: Vec<Vec<u32>> = CAPTIONS.iter().map(|c| tok.encode(c).unwrap()).collect();
    let img = model.vision.forward(&pixels()).unwrap();
    let txt = model.text.forward(&ids, tok.pad_id(), &Device::Cpu).unwrap();
    let logits = model.logits(&img, &txt).unwrap();
    let loss = clip_loss(&img, &txt, &model.logit_scale, &ProcessGroup::single()).unwrap();
    (flat(&img), flat(&txt), flat(&logits), loss.to_scalar::<f32>().unwrap() as f64, ids)
}

#[test]
fn tiny_clip_matches_transformers_ids_features_logits_and_loss() {
    let (img, txt, logits, loss, ids) = outputs(&folder());
    for (i, want) in IDS.iter().enumerate() {
        assert_eq!(ids[i], *want, "token ids of {:?}", CAPTIONS[i]);
    }
    // f32, rel 1e-5 (norm-wise); the measured errors are printed (ALLGRAD_TEST_ERRORS=1 for
    // the harness's own report).
    for (what, got, want) in [
        ("image features", &img, &IMAGE_FEATURES[..]),
        ("text features", &txt, &TEXT_FEATURES[..]),
        ("logits", &logits, &LOGITS_PER_IMAGE[..]),
        ("loss", &vec![loss], &[LOSS][..]),
    ] {
        println!("{what} vs transformers: relative error {:.2e}", rel_err(got, want));
    }
    assert_rel(&img, &IMAGE_FEATURES, 1e-5, "image features vs transformers");
    assert_rel(&txt, &TEXT_FEATURES, 1e-5, "text features vs transformers");
    assert_rel(&logits, &LOGITS_PER_IMAGE, 1e-5, "logits_per_image vs transformers");
    assert_rel(&[loss], &[LOSS], 1e-5, "loss vs transformers");
}

#[test]
fn an_exported_folder_reads_back_to_the_same_model() {
    let params = candle_core::safetensors::load(folder().join("model.safetensors"), &Device::Cpu).unwrap();
    let out = tempfile::tempdir().unwrap();
    let processor = ImageProcessor::default_for(&ClipFolder::open(&folder()).unwrap().config);
    export_clip_folder(&params, &folder(), out.path(), &processor).unwrap();
    assert_eq!(ImageProcessor::read(&out.path().join("preprocessor_config.json")).unwrap(), processor);
    for file in ["config.json", "tokenizer.json", "model.safetensors", "preprocessor_config.json"] {
        assert!(out.path().join(file).is_file(), "{file} missing from the export");
    }
    let (a, b) = (outputs(&folder()), outputs(out.path()));
    assert_eq!((a.0, a.1, a.2), (b.0, b.1, b.2), "the exported model computes other numbers");
}

#[test]
fn a_learned_logit_bias_is_exported_and_read_back_and_a_checkpoint_without_one_starts_at_the_init() {
    // A CLIP model trained with a sigmoid loss has a logit bias: the export writes it, a run
    // starting from the export reads it (not its initial value), and so does inference.
    let mut params = candle_core::safetensors::load(folder().join("model.safetensors"), &Device::Cpu).unwrap();
    params.insert("logit_bias".into(), Tensor::new(-3.5f32, &Device::Cpu).unwrap());
    let out = tempfile::tempdir().unwrap();
    let processor = ImageProcessor::default_for(&ClipFolder::open(&folder()).unwrap().config);
    export_clip_folder(&params, &folder(), out.path(), &processor).unwrap();
    let written = candle_core::safetensors::load(out.path().join("model.safetensors"), &Device::Cpu).unwrap();
    assert_eq!(written["logit_bias"].to_scalar::<f32>().unwrap(), -3.5, "logit_bias written");

    let bias_of = |dir: &std::path::Path| {
        let f = ClipFolder::open(dir).unwrap();
        let vars = candle_nn::VarMap::new();
        let vb = candle_nn::VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
        let m = f.weights().unwrap().init_model(&f.config, Some(-10.0), vb).unwrap();
        let var = vars.data().lock().unwrap()["logit_bias"].as_tensor().to_scalar::<f32>().unwrap();
        (m.logit_bias.unwrap().to_scalar::<f32>().unwrap(), var)
    };
    assert_eq!(bias_of(out.path()), (-3.5, -3.5), "a run starting from the export reads its bias");
    assert_eq!(bias_of(&folder()), (-10.0, -10.0), "a CLIP checkpoint without a bias starts it at the init");
    let inference = ClipFolder::open(out.path()).unwrap().model(DType::F32, &Device::Cpu).unwrap();
    assert_eq!(inference.logit_bias.unwrap().to_scalar::<f32>().unwrap(), -3.5);
    assert!(ClipFolder::open(&folder()).unwrap().model(DType::F32, &Device::Cpu).unwrap().logit_bias.is_none());
}
