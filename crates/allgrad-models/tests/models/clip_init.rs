//! A fresh CLIP or SigLIP model starts from OpenCLIP's initialisation, scaled by width and
//! depth: the statistics of the initialised weights (mean, standard deviation, kurtosis, which
//! tells a normal from a uniform draw, and the range of a uniform one) against the formulas of
//! OpenCLIP's `TextTransformer.init_parameters` and `VisionTransformer` (PyTorch's defaults:
//! `nn.Linear` / `nn.Conv2d` U(±fan_in^-1/2), `nn.MultiheadAttention`'s Xavier-uniform
//! in-projection and zero biases), each group pooled over the layers.

use std::collections::HashMap;

use allgrad_models::clip::ClipConfig;
use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};

/// Text: width 64, 3 layers, MLP 256; image: width 96, 2 layers, MLP 192, patches 3 x 4 x 4.
const CONFIG: &str = r#"{
  "model_type": "clip",
  "projection_dim": 48,
  "text_config": {"vocab_size": 500, "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 3,
                  "num_attention_heads": 4, "max_position_embeddings": 32, "eos_token_id": 499},
  "vision_config": {"hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_channels": 3, "image_size": 32, "patch_size": 4}
}"#;

enum Law {
    Normal(f64),
    Uniform(f64),
    Const(f64),
}

fn fresh(config: &str) -> HashMap<String, Vec<f64>> {
    let cfg = ClipConfig::from_json(config).unwrap();
    let vars = VarMap::new();
    allgrad_models::clip::ClipModel::new(&VarBuilder::from_varmap(&vars, DType::F64, &Device::Cpu), &cfg).unwrap();
    let data = vars.data().lock().unwrap();
    data.iter().map(|(k, v)| (k.clone(), v.flatten_all().unwrap().to_vec1::<f64>().unwrap())).collect()
}

/// Checks the values of every parameter whose name matches `pick` against `law`.
fn check(params: &HashMap<String, Vec<f64>>, what: &str, pick: impl Fn(&str) -> bool, law: Law) {
    let x: Vec<f64> = params.iter().filter(|(k, _)| pick(k)).flat_map(|(_, v)| v.iter().copied()).collect();
    assert!(!x.is_empty(), "{what}: no parameter matched");
    let n = x.len() as f64;
    let mean = x.iter().sum::<f64>() / n;
    let var = x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
    let kurt = x.iter().map(|v| (v - mean).powi(4)).sum::<f64>() / n / var.powi(2);
    let max = x.iter().fold(0f64, |m, v| m.max(v.abs()));
    let (sigma, kurtosis) = match law {
        Law::Const(c) => {
            assert!(x.iter().all(|v| *v == c), "{what}: not all {c}");
            return;
        }
        Law::Normal(s) => (s, 3.0),
        Law::Uniform(b) => {
            assert!(max <= b && max > 0.9 * b, "{what}: U(±{b:.4}) but max |x| = {max:.4}");
            (b / 3f64.sqrt(), 1.8)
        }
    };
    // Five standard errors: of the mean, σ/√n; of the standard deviation, σ √((κ−1)/4n).
    let (sd, se_sd) = (var.sqrt(), sigma * ((kurtosis - 1.0) / (4.0 * n)).sqrt());
    println!("{what}: n {n}, mean {mean:.2e}, std {sd:.5} (formula {sigma:.5}), kurtosis {kurt:.2} ({kurtosis})");
    assert!(mean.abs() <= 5.0 * sigma / n.sqrt(), "{what}: mean {mean:e}, σ {sigma}");
    assert!((sd - sigma).abs() <= 5.0 * se_sd, "{what}: std {sd} against the formula's {sigma} (5 SE = {})", 5.0 * se_sd);
    assert!((kurt - kurtosis).abs() < 0.35, "{what}: kurtosis {kurt}, the law's {kurtosis}");
}

#[test]
fn fresh_towers_follow_openclips_initialisation_scaled_by_width_and_depth() {
    let p = fresh(CONFIG);
    let (w, layers, inner) = (64f64, 3f64, 256usize);
    let text = |suffix: &'static str| move |k: &str| k.starts_with("text_model.encoder.layers.") && k.ends_with(suffix);
    let qkv = |k: &str| {
        k.starts_with("text_model.encoder.layers.")
            && ["q_proj.weight", "k_proj.weight", "v_proj.weight"].iter().any(|s| k.ends_with(s))
    };
    let proj_std = w.powf(-0.5) * (2.0 * layers).powf(-0.5);
    check(&p, "text q/k/v", qkv, Law::Normal(w.powf(-0.5)));
    check(&p, "text out_proj", text("self_attn.out_proj.weight"), Law::Normal(proj_std));
    check(&p, "text fc1", text("mlp.fc1.weight"), Law::Normal((2.0 * w).powf(-0.5)));
    check(&p, "text fc2", text("mlp.fc2.weight"), Law::Normal(proj_std));
    check(&p, "text fc1 bias", text("mlp.fc1.bias"), Law::Uniform(w.powf(-0.5)));
    check(&p, "text fc2 bias", text("mlp.fc2.bias"), Law::Uniform((inner as f64).powf(-0.5)));
    check(
        &p,
        "text attention biases",
        |k| k.starts_with("text_model.") && k.contains("self_attn.") && k.ends_with(".bias"),
        Law::Const(0.0),
    );
    check(&p, "token embedding", |k| k == "text_model.embeddings.token_embedding.weight", Law::Normal(0.02));
    check(&p, "text positions", |k| k == "text_model.embeddings.position_embedding.weight", Law::Normal(0.01));
    check(&p, "text projection", |k| k == "text_projection.weight", Law::Normal(w.powf(-0.5)));
    check(&p, "norm gains", |k| k.contains("norm") && k.ends_with(".weight"), Law::Const(1.0));

    let (v, v_inner) = (96f64, 192f64);
    let vis = |suffix: &'static str| move |k: &str| k.starts_with("vision_model.encoder.layers.") && k.ends_with(suffix);
    let vqkv = |k: &str| {
        k.starts_with("vision_model.encoder.layers.")
            && ["q_proj.weight", "k_proj.weight", "v_proj.weight"].iter().any(|s| k.ends_with(s))
    };
    check(&p, "image q/k/v (Xavier over [3w, w])", vqkv, Law::Uniform((6.0 / (4.0 * v)).sqrt()));
    check(&p, "image out_proj", vis("self_attn.out_proj.weight"), Law::Uniform(v.powf(-0.5)));
    check(&p, "image fc1", vis("mlp.fc1.weight"), Law::Uniform(v.powf(-0.5)));
    check(&p, "image fc1 bias", vis("mlp.fc1.bias"), Law::Uniform(v.powf(-0.5)));
    check(&p, "image fc2", vis("mlp.fc2.weight"), Law::Uniform(v_inner.powf(-0.5)));
    check(
        &p,
        "image patch embedding",
        |k| k == "vision_model.embeddings.patch_embedding.weight",
        Law::Uniform((48f64).powf(-0.5)),
    );
    check(
        &p,
        "image class token and positions",
        |k| k == "vision_model.embeddings.class_embedding" || k == "vision_model.embeddings.position_embedding.weight",
        Law::Normal(v.powf(-0.5)),
    );
    check(&p, "image projection", |k| k == "visual_projection.weight", Law::Normal(v.powf(-0.5)));
    check(&p, "logit scale", |k| k == "logit_scale", Law::Const(2.6592));
}
