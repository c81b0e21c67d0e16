//! Where a face backbone's forward pass is (training or evaluation, the step, the samples),
//! and the dropout masks keyed by it, shared by [`super::backbone`] and
//! [`super::insightface`].

use allgrad_rng::{bernoulli, stream};
use candle_core::{Result, Tensor};

use crate::batch_norm::Mode;

/// Key word of the dropout masks.
const DROPOUT_KEY: u64 = 0xD409_0C7F_0000_0004;

/// Where a forward pass is: the mode, and the keys of its dropout masks.
#[derive(Clone, Copy)]
pub struct Pass<'a> {
    /// Training or evaluation, and the group of SyncBatchNorm.
    pub mode: Mode<'a>,
    /// The run's seed.
    pub seed: u64,
    /// The optimizer step.
    pub step: usize,
    /// Global indices of the samples.
    pub indices: &'a [usize],
}

/// Inverted-dropout multipliers `[b, width]`: 0 or `1/(1-p)`, each row from the stream
/// `[seed, DROPOUT_KEY, step, global index]`, so they do not depend on W.
pub(crate) fn dropout_mask(width: usize, p: f64, pass: Pass, device: &candle_core::Device) -> Result<Tensor> {
    let keep = 1.0 / (1.0 - p);
    let mut v = Vec::with_capacity(pass.indices.len() * width);
    for &i in pass.indices {
        let mut rng = stream(&[pass.seed, DROPOUT_KEY, pass.step as u64, i as u64]);
        v.extend((0..width).map(|_| if bernoulli(&mut rng, p) { 0.0 } else { keep }));
    }
    Tensor::from_vec(v, (pass.indices.len(), width), device)
}
