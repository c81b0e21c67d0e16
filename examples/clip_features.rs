//! Prints the image and text features (projected, not normalised), the logits and the loss
//! (CLIP's, or SigLIP's sigmoid loss for a SigLIP folder) that allgrad computes for a Hugging
//! Face CLIP or SigLIP folder on fixed inputs, as one JSON object: what
//! `scripts/reference/check_clip_export.py` compares with `transformers`' `CLIPModel` on the
//! same inputs (an exported run, or any CLIP folder), and `siglip_reference.py check` with
//! `SiglipModel`.
//!
//! ```text
//! cargo run --release --example clip_features -- DIR > allgrad.json
//! $PYTHON scripts/reference/check_clip_export.py DIR allgrad.json          # CLIP
//! $PYTHON scripts/reference/siglip_reference.py check DIR allgrad.json     # SigLIP
//! ```
//!
//! Inputs: three captions, and three images whose pixel (b, c, y, x) is
//! `sin(0.37 (s y + x) + b + c) + 0.1 b` (s the image side), as f32.

use std::path::PathBuf;

use allgrad::dist::ProcessGroup;
use allgrad::models::clip::{clip_loss, siglip_loss, Architecture, ClipFolder};
use candle_core::{DType, Device, Tensor};

const CAPTIONS: [&str; 3] = ["a photo of a sneaker.", "a black and white photo of the dress", "this is an ankle boot for sale"];

fn main() -> anyhow::Result<()> {
    let dir = PathBuf::from(std::env::args().nth(1).ok_or_else(|| anyhow::anyhow!("usage: clip_features DIR"))?);
    let folder = ClipFolder::open(&dir)?;
    let v = &folder.config.vision_config;
    let (c, s) = (v.num_channels, v.image_size);
    let mut px = Vec::with_capacity(3 * c * s * s);
    for b in 0..3 {
        for ch in 0..c {
            for y in 0..s {
                for x in 0..s {
                    px.push(((0.37 * (s * y + x) as f64 + (b + ch) as f64).sin() + 0.1 * b as f64) as f32);
                }
            }
        }
    }
    let pixels = Tensor::from_vec(px, (3, c, s, s), &Device::Cpu)?;
    let model = folder.model(DType::F32, &Device::Cpu)?;
    let tok = folder.tokenizer(folder.config.text_config.max_position_embeddings)?;
    let ids: Vec<Vec<u32>> = CAPTIONS.iter().map(|t| tok.encode(t)).collect::<candle_core::Result<_>>()?;
    let img = model.vision.forward(&pixels)?;
    let txt = model.text.forward(&ids, tok.pad_id(), &Device::Cpu)?;
    let logits = model.logits(&img, &txt)?;
    let pg = ProcessGroup::single();
    let loss = match (folder.config.model_type, &model.logit_bias) {
        (Architecture::Siglip, Some(bias)) => siglip_loss(&img, &txt, &model.logit_scale, bias, &pg)?,
        _ => clip_loss(&img, &txt, &model.logit_scale, &pg)?,
    };
    let out = serde_json::json!({
        "captions": CAPTIONS,
        "ids": ids,
        "image_features": img.to_vec2::<f32>()?,
        "text_features": txt.to_vec2::<f32>()?,
        "logits_per_image": logits.to_vec2::<f32>()?,
        "loss": loss.to_scalar::<f32>()?,
    });
    println!("{out}");
    Ok(())
}
