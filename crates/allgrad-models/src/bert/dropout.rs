//! Dropout with masks drawn from keyed random streams (DESIGN §3).
//!
//! A mask entry depends only on `(seed, step, global sample index, view, layer, site,
//! position)` and the entry's place within that position, never on the rank, the sample's
//! place in the local batch or the padded length of the batch, so a run on W ranks draws
//! exactly the masks of a run on one rank over the same global batch. (Padding only appends
//! positions, and each position has its own stream; within the attention probabilities of
//! one query position, values are drawn key position by key position, so the entries of real
//! keys do not move when padded keys are added after them.)

use candle_core::{Result, Tensor};

use crate::rng::stream;

/// Where in the network a dropout mask is applied (one word of the stream key).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Site {
    /// After the embedding LayerNorm.
    Embeddings = 1,
    /// On the attention probabilities.
    AttentionProbs = 2,
    /// On the attention output projection, before the residual.
    AttentionOutput = 3,
    /// On the feed-forward output, before the residual.
    FeedForward = 4,
}

/// The key of one forward pass's dropout masks: run seed, optimizer step, and for each row
/// of the batch its global sample index and view (SimCSE encodes every sentence twice, as
/// views 0 and 1, in one batch).
#[derive(Clone, Debug)]
pub struct DropoutKey {
    /// The run's seed.
    pub seed: u64,
    /// Optimizer step.
    pub step: u64,
    /// `(global sample index, view)` of each batch row.
    pub rows: Vec<(u64, u64)>,
}

/// Bernoulli keep/drop from one `u64` of the stream (`unit < p` drops), scaled by `1/(1-p)`.
fn draw(rng: &mut crate::rng::KeyedRng, p: f64, scale: f64) -> f64 {
    if allgrad_rng::unit(rng) < p {
        0.0
    } else {
        scale
    }
}

impl DropoutKey {
    fn stream(&self, row: usize, layer: usize, site: Site, position: usize) -> crate::rng::KeyedRng {
        let (sample, view) = self.rows[row];
        stream(&[self.seed, self.step, sample, view, layer as u64, site as u64, position as u64])
    }

    fn check_rows(&self, b: usize) -> Result<()> {
        if self.rows.len() != b {
            candle_core::bail!("dropout: the key names {} rows, the batch has {b}", self.rows.len());
        }
        Ok(())
    }

    /// Dropout with probability `p` on `x` (`[b, len, width]`): for each row and position, a
    /// stream of `width` draws.
    pub fn apply(&self, x: &Tensor, p: f64, layer: usize, site: Site) -> Result<Tensor> {
        if p == 0.0 {
            return Ok(x.clone());
        }
        let (b, len, width) = x.dims3()?;
        self.check_rows(b)?;
        let scale = 1.0 / (1.0 - p);
        let mut mask = Vec::with_capacity(b * len * width);
        for row in 0..b {
            for pos in 0..len {
                let mut rng = self.stream(row, layer, site, pos);
                mask.extend((0..width).map(|_| draw(&mut rng, p, scale)));
            }
        }
        let mask = Tensor::from_vec(mask, (b, len, width), x.device())?.to_dtype(x.dtype())?;
        x * mask
    }

    /// Dropout with probability `p` on attention probabilities `[b, heads, len_q, len_k]`: for
    /// each row and query position, a stream drawn key by key, head by head.
    pub fn apply_attention(&self, probs: &Tensor, p: f64, layer: usize) -> Result<Tensor> {
        if p == 0.0 {
            return Ok(probs.clone());
        }
        let (b, heads, lq, lk) = probs.dims4()?;
        self.check_rows(b)?;
        let scale = 1.0 / (1.0 - p);
        let mut mask = vec![0f64; b * heads * lq * lk];
        for row in 0..b {
            for q in 0..lq {
                let mut rng = self.stream(row, layer, Site::AttentionProbs, q);
                for k in 0..lk {
                    for h in 0..heads {
                        mask[((row * heads + h) * lq + q) * lk + k] = draw(&mut rng, p, scale);
                    }
                }
            }
        }
        let mask = Tensor::from_vec(mask, (b, heads, lq, lk), probs.device())?.to_dtype(probs.dtype())?;
        probs * mask
    }
}
