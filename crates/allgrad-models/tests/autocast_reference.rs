//! The losses of two fixed batches under bf16 autocast against PyTorch's
//! `torch.autocast("cpu", dtype=torch.bfloat16)` (values from `scripts/ref_autocast.py`, which
//! describes the batches): a SimCLR batch through a ResNet-18 of width 4 and its projector, and
//! an unsupervised SimCSE batch through the committed tiny BERT. The same losses in f32 are
//! checked against PyTorch's f32 first (1e-5), so that both sides compute the same function.
//!
//! bf16 keeps 8 significant bits, and two correct bf16 implementations round at slightly
//! different places (the GEMMs sum in other orders, so a value near a rounding boundary rounds
//! the other way; PyTorch's CPU attention rounds its unnormalised probabilities to bf16, allgrad's
//! keeps them f32), and a deep network carries those differences to the loss. They agree to
//! "bf16 rounding", not to f32's. The yardstick is the effect of bf16 itself, `E` = |PyTorch's
//! bf16 loss - its f32 loss| / |its f32 loss|, and the checks are: allgrad's bf16 loss is within
//! 0.75 E of PyTorch's bf16 loss (an implementation that stayed in f32 is at 1.0 E), and at
//! least 0.25 E from allgrad's own f32 loss (it did compute in bf16). Measured on the reference
//! machine (AVX-512): SimCLR E = 4.5e-4, allgrad within 0.46 E of PyTorch's bf16 loss (PyTorch
//! itself moves by 0.33 E between its NCHW and channels-last convolutions under autocast), 0.54 E
//! from its f32 loss; SimCSE E = 3.6e-3, within 0.34 E, 0.66 E from its f32 loss.

mod support;

use allgrad_dist::ProcessGroup;
use allgrad_models::batch_norm::Mode;
use allgrad_models::bert::{BertFolder, Pooling, TokenBatch};
use allgrad_models::losses::nt_xent;
use allgrad_models::resnet::{ResNet, ResNetConfig, Stem};
use allgrad_models::simcse::info_nce;
use allgrad_nn::autocast::{full, Autocast};
use candle_core::{DType, Device, Result, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;

// python3 scripts/ref_autocast.py  (torch 2.15.0+cu132)
const RESNET_F64: f64 = 2.7434048039127426;
const RESNET_F32: f64 = 2.7434048652648926;
const RESNET_BF16: f64 = 2.7421822547912598;
const BERT_F64: f64 = 0.6562449342548968;
const BERT_F32: f64 = 0.6562449932098389;
const BERT_BF16: f64 = 0.6586120128631592;

fn fnv1a(name: &str) -> u64 {
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3);
    }
    h % 1000
}

/// `2 frac(43758.5453 sin t) - 1`, as the script computes it.
fn noise(t: f64) -> f64 {
    let v = t.sin() * 43758.5453;
    2.0 * (v - v.floor()) - 1.0
}

/// The script's closed-form parameters, by name.
struct ClosedForm;

impl SimpleBackend for ClosedForm {
    fn get(&self, s: Shape, name: &str, _: candle_nn::Init, dtype: DType, dev: &Device) -> Result<Tensor> {
        let h = fnv1a(name) as f64;
        let dims = s.dims().to_vec();
        let n = s.elem_count();
        let base: Vec<f64> = (0..n).map(|j| noise(0.37 * j as f64 + 0.011 * h + 0.5)).collect();
        let values: Vec<f64> = if dims.len() >= 2 {
            let fan = (n / dims[0]) as f64;
            base.iter().map(|v| v / fan.sqrt()).collect()
        } else if name.ends_with("bn1.weight") || name.ends_with("bn2.weight") || name.ends_with("downsample.1.weight") {
            base.iter().map(|v| 1.0 + 0.2 * v).collect()
        } else {
            base.iter().map(|v| 0.1 * v).collect()
        };
        Tensor::from_vec(values, dims, dev)?.to_dtype(dtype)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> Result<Tensor> {
        candle_core::bail!("closed-form parameter {name} needs its shape")
    }

    fn contains_tensor(&self, _: &str) -> bool {
        true
    }
}

const IMAGES: usize = 8;
const SIZE: usize = 16;

/// The SimCLR batch's NT-Xent (temperature 0.5) in `dtype`, under bf16 autocast when `bf16`.
fn simclr_loss(dtype: DType, bf16: bool) -> f64 {
    let dev = Device::Cpu;
    let vb = VarBuilder::from_backend(Box::new(ClosedForm), dtype, dev.clone());
    let cfg = ResNetConfig { depth: 18, width: 4, in_channels: 3, stem: Stem::Cifar, sync_bn: false };
    let enc = ResNet::new(&cfg, vb.clone()).unwrap();
    let [w0, b0, w1, b1] =
        [("proj.0.weight", (32, 32)), ("proj.0.bias", (32, 0)), ("proj.1.weight", (16, 32)), ("proj.1.bias", (16, 0))]
            .map(|(name, (a, b))| if b == 0 { vb.get(a, name).unwrap() } else { vb.get((a, b), name).unwrap() });
    let mut x = Vec::with_capacity(2 * IMAGES * 3 * SIZE * SIZE);
    for n in 0..2 * IMAGES {
        for c in 0..3 {
            for y in 0..SIZE {
                for xx in 0..SIZE {
                    x.push(noise(0.9 * n as f64 + 1.7 * c as f64 + 0.31 * y as f64 - 0.23 * xx as f64));
                }
            }
        }
    }
    let x = Tensor::from_vec(x, (2 * IMAGES, 3, SIZE, SIZE), &dev).unwrap().to_dtype(dtype).unwrap();
    let pg = ProcessGroup::single();
    let z = {
        let _autocast = bf16.then(Autocast::bf16);
        let f = enc.forward(&x, Mode { train: true, pg: &pg }).unwrap();
        let h = allgrad_nn::relu(&allgrad_nn::linear(&f, &w0, Some(&b0)).unwrap()).unwrap();
        allgrad_nn::linear(&h, &w1, Some(&b1)).unwrap()
    };
    assert_eq!(z.dtype(), if bf16 { DType::BF16 } else { dtype }, "embedding dtype");
    let z = full(&z).unwrap();
    let loss = nt_xent(&z.narrow(0, 0, IMAGES).unwrap(), &z.narrow(0, IMAGES, IMAGES).unwrap(), 0.5, &pg).unwrap();
    loss.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap()
}

/// The SimCSE batch's InfoNCE (temperature 0.05, positives = anchors) in `dtype`.
fn simcse_loss(dtype: DType, bf16: bool) -> f64 {
    let rows: Vec<Vec<u32>> =
        vec![vec![2, 7, 11, 5, 9, 3], vec![2, 14, 6, 3], vec![2, 30, 12, 8, 19, 21, 25, 17, 3], vec![2, 4, 3]];
    let dev = Device::Cpu;
    let model = BertFolder::open(&support::tiny_dir()).unwrap().model(dtype, &dev).unwrap();
    let batch = TokenBatch::from_ids(rows, 0, &dev).unwrap();
    let z = {
        let _autocast = bf16.then(Autocast::bf16);
        model.embed(&batch, Pooling::Mean, None).unwrap()
    };
    let z = full(&z).unwrap();
    info_nce(&z, &z, 0.05, &ProcessGroup::single()).unwrap().to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap()
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs()
}

/// The checks of the module docs, for allgrad's f32 and bf16 losses against PyTorch's.
fn check_bf16(what: &str, ours_f32: f64, ours_bf16: f64, torch_f32: f64, torch_bf16: f64) {
    let effect = rel(torch_bf16, torch_f32);
    let to_torch = rel(ours_bf16, torch_bf16) / effect;
    let from_f32 = rel(ours_bf16, ours_f32) / effect;
    println!("{what}: bf16 effect E = {effect:.2e}; allgrad's bf16 loss is {to_torch:.2} E from PyTorch's, {from_f32:.2} E from its f32 loss");
    assert!(to_torch <= 0.75, "{what}: bf16 loss {ours_bf16} is {to_torch:.2} E from PyTorch's {torch_bf16} (E = {effect:.2e})");
    assert!(
        from_f32 >= 0.25,
        "{what}: bf16 loss {ours_bf16} is only {from_f32:.2} E from the f32 loss {ours_f32}: not computed in bf16?"
    );
}

#[test]
fn simclr_batch_under_bf16_autocast_matches_pytorch_autocast() {
    let (f64_, f32_, bf16) = (simclr_loss(DType::F64, false), simclr_loss(DType::F32, false), simclr_loss(DType::F32, true));
    println!("SimCLR: allgrad f64 {f64_} f32 {f32_} bf16 {bf16}; PyTorch f64 {RESNET_F64} f32 {RESNET_F32} bf16 {RESNET_BF16}");
    assert!(rel(f64_, RESNET_F64) <= 1e-10, "f64: {f64_} vs PyTorch {RESNET_F64}");
    assert!(rel(f32_, RESNET_F32) <= 1e-5, "f32: {f32_} vs PyTorch {RESNET_F32}");
    check_bf16("SimCLR", f32_, bf16, RESNET_F32, RESNET_BF16);
}

#[test]
fn simcse_batch_under_bf16_autocast_matches_pytorch_autocast() {
    let (f64_, f32_, bf16) = (simcse_loss(DType::F64, false), simcse_loss(DType::F32, false), simcse_loss(DType::F32, true));
    println!("SimCSE: allgrad f64 {f64_} f32 {f32_} bf16 {bf16}; PyTorch f64 {BERT_F64} f32 {BERT_F32} bf16 {BERT_BF16}");
    assert!(rel(f64_, BERT_F64) <= 1e-10, "f64: {f64_} vs PyTorch {BERT_F64}");
    assert!(rel(f32_, BERT_F32) <= 1e-5, "f32: {f32_} vs PyTorch {BERT_F32}");
    check_bf16("SimCSE", f32_, bf16, BERT_F32, BERT_BF16);
}
