//! Image-text losses over the global batch, gather forms: CLIP's symmetric InfoNCE (whole or in
//! tiles) and SigLIP's sigmoid loss (the ring forms, whose memory does not grow with the ranks,
//! are in [`super::ring`]).
//!
//! Every loss here is in the local-loss form: rank r scores its own `b_r` images against the
//! texts of EVERY rank (and, for CLIP, its own texts against every rank's images), reaching
//! them through the differentiable collectives, whose backward follows the sum rule. Each
//! returns `(W / B)` times the sum of its rows' terms, so the mean over ranks is the loss of
//! the global batch of `B` pairs (uneven shards included) and, with the trainer's 1/W scaling
//! and sum of replicated gradients, W ranks train exactly like one process. No
//! "times world size" correction appears anywhere.

use allgrad_dist::{all_gather, ProcessGroup};
use candle_core::{Result, Tensor};

use crate::losses::{l2_normalize, logsumexp, placement, Temperature};
use crate::tiled::{scaled_dot_cross_entropy, Pairs};

/// CLIP's cap on the logit scale's multiplier: the parameter `logit_scale` is clamped to
/// `[0, ln 100]` after every optimizer step (the objective's
/// [`crate::Objective::clamp_after_step`], which the trainer applies), as OpenCLIP clamps it.
pub const MAX_LOGIT_SCALE: f64 = 100.0;

/// `exp(logit_scale)`: CLIP's multiplier of the cosine similarities, uncapped, as in
/// OpenCLIP's and `transformers`' forward (the cap is a clamp of the parameter after each
/// step, [`MAX_LOGIT_SCALE`]), so an exported model computes the same logits in `transformers`.
pub fn clip_scale(logit_scale: &Tensor) -> Result<Tensor> {
    logit_scale.flatten_all()?.exp()
}

fn check(loss: &str, images: &Tensor, texts: &Tensor) -> Result<()> {
    if images.rank() != 2 || images.dims() != texts.dims() {
        candle_core::bail!(
            "{loss}: image embeddings {:?} and text embeddings {:?} must be [b, d] of one shape",
            images.dims(),
            texts.dims()
        );
    }
    Ok(())
}

/// `Σ_i (logsumexp(logits_i) − logits_{i, offset + i})` over the rows of `logits`.
fn cross_entropy_sum(logits: &Tensor, offset: usize) -> Result<Tensor> {
    let b = logits.dim(0)?;
    // The columns `offset..offset + b`, a view of numbers kept on the device (no upload).
    let idx = allgrad_nn::transfer::numbers(offset + b, logits.device())?.narrow(0, offset, b)?.reshape((b, 1))?;
    let pos = logits.gather(&idx, 1)?.squeeze(1)?;
    (logsumexp(logits)? - pos)?.sum_all()
}

/// CLIP's symmetric InfoNCE (Radford et al., 2021) over the global batch: image i against
/// the texts of every rank (its positive: its own caption) and text i against every rank's
/// images, with logits `exp(s) · cos`, `s` the learned `logit_scale` (one number, clamped
/// to `[0, ln 100]` after each step by the trainer). Returns `(W / 2B) Σ_{i local} (ℓ^{image→text}_i + ℓ^{text→image}_i)`; the mean
/// over ranks is `transformers`' `CLIPModel` loss on the global batch.
pub fn clip_loss(images: &Tensor, texts: &Tensor, logit_scale: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    check("clip_loss", images, texts)?;
    let (offset, total) = placement(images.dim(0)?, pg)?;
    let (img, txt) = (l2_normalize(images)?, l2_normalize(texts)?);
    let all_txt = all_gather(&txt, pg)?; // [B, d]
    let all_img = all_gather(&img, pg)?;
    let scale = clip_scale(logit_scale)?.to_dtype(img.dtype())?;
    let per_image = img.matmul(&all_txt.t()?)?.broadcast_mul(&scale)?; // [b, B]
    let per_text = txt.matmul(&all_img.t()?)?.broadcast_mul(&scale)?;
    let sum = (cross_entropy_sum(&per_image, offset)? + cross_entropy_sum(&per_text, offset)?)?;
    sum * (pg.world_size() as f64 / (2.0 * total as f64))
}

/// [`clip_loss`] with both directions' logits computed in `tile x tile` blocks
/// ([`crate::tiled`]): the same loss and gradients to rounding, never holding a `b x B`
/// matrix. The temperature is `1 / exp(s)`, learned through the tiles' backward.
pub fn clip_loss_tiled(images: &Tensor, texts: &Tensor, logit_scale: &Tensor, tile: usize, pg: &ProcessGroup) -> Result<Tensor> {
    check("clip_loss_tiled", images, texts)?;
    let b = images.dim(0)?;
    let (offset, total) = placement(b, pg)?;
    let (img, txt) = (l2_normalize(images)?, l2_normalize(texts)?);
    let all_txt = all_gather(&txt, pg)?;
    let all_img = all_gather(&img, pg)?;
    let temperature = Temperature::Learned(clip_scale(logit_scale)?.recip()?.to_dtype(img.dtype())?);
    let pairs = || Pairs { target: Some((0..b).map(|i| offset + i).collect()), ..Default::default() };
    let i2t = scaled_dot_cross_entropy(&img, &all_txt, &temperature, pairs(), tile)?;
    let t2i = scaled_dot_cross_entropy(&txt, &all_img, &temperature, pairs(), tile)?;
    (i2t + t2i)? * (pg.world_size() as f64 / (2.0 * total as f64))
}

/// `log σ(x)`, stable for every x: `min(x, 0) − log(1 + exp(−|x|))`.
pub fn log_sigmoid(x: &Tensor) -> Result<Tensor> {
    x.broadcast_minimum(&allgrad_nn::transfer::constant(x, 0.0)?)? - (x.abs()?.neg()?.exp()? + 1.0)?.log()?
}

/// `Σ_{i,j} log σ(y_ij · (t · img_i·txt_j + bias))` of one block, `y_ij = +1` on the
/// block's diagonal when `positives`, −1 elsewhere.
fn sigmoid_block(img: &Tensor, txt: &Tensor, scale: &Tensor, bias: &Tensor, positives: bool) -> Result<Tensor> {
    let z = img.matmul(&txt.t()?)?.broadcast_mul(scale)?.broadcast_add(bias)?; // [b, c]
    let (b, c) = z.dims2()?;
    // The labels: +1 on the diagonal of a block of positives, −1 elsewhere, made on the device
    // from kept row and column numbers (no upload).
    let y = if positives {
        let (rows, cols) = (allgrad_nn::transfer::numbers(b, z.device())?, allgrad_nn::transfer::numbers(c, z.device())?);
        rows.reshape((b, 1))?.broadcast_eq(&cols.reshape((1, c))?)?.to_dtype(z.dtype())?.affine(2.0, -1.0)?
    } else {
        z.zeros_like()?.affine(0.0, -1.0)?
    };
    log_sigmoid(&(z * y)?)?.sum_all()
}

fn siglip_parts(images: &Tensor, texts: &Tensor, logit_scale: &Tensor, logit_bias: &Tensor) -> Result<[Tensor; 4]> {
    let (img, txt) = (l2_normalize(images)?, l2_normalize(texts)?);
    let scale = logit_scale.flatten_all()?.exp()?.to_dtype(img.dtype())?;
    let bias = logit_bias.flatten_all()?.to_dtype(img.dtype())?;
    Ok([img, txt, scale, bias])
}

/// SigLIP's sigmoid loss (Zhai et al., 2023) over the global batch, all-gather form: every
/// image against every rank's texts, logits `exp(t') · cos + b` with the learned `logit_scale`
/// `t'` and `logit_bias` `b` (one number each), label +1 for the image's own caption and −1
/// for every other. Returns `−(W / B) Σ_{i local} Σ_{j global} log σ(y_ij z_ij)`: the mean
/// over ranks is the paper's `−(1/B) Σ_ij log σ(y_ij z_ij)`.
pub fn siglip_loss(
    images: &Tensor,
    texts: &Tensor,
    logit_scale: &Tensor,
    logit_bias: &Tensor,
    pg: &ProcessGroup,
) -> Result<Tensor> {
    check("siglip_loss", images, texts)?;
    let (offset, total) = placement(images.dim(0)?, pg)?;
    let [img, txt, scale, bias] = siglip_parts(images, texts, logit_scale, logit_bias)?;
    let all_txt = all_gather(&txt, pg)?;
    let b = img.dim(0)?;
    // The positives sit at columns offset..offset + b: score those as the diagonal block.
    let mut sum = sigmoid_block(&img, &all_txt.narrow(0, offset, b)?, &scale, &bias, true)?;
    if offset > 0 {
        sum = (sum + sigmoid_block(&img, &all_txt.narrow(0, 0, offset)?, &scale, &bias, false)?)?;
    }
    if offset + b < total {
        sum = (sum + sigmoid_block(&img, &all_txt.narrow(0, offset + b, total - offset - b)?, &scale, &bias, false)?)?;
    }
    sum.neg()? * (pg.world_size() as f64 / total as f64)
}
