//! Checking a distributed loss for world-size invariance.
//!
//! A loss written with the differentiable collectives should train the same on W ranks as
//! on one rank with the same global batch. [`check_world_size_invariance`] runs a user's
//! loss both ways and reports how far apart the results are.
//!
//! ```
//! use allgrad_dist::{all_gather, testing::check_world_size_invariance};
//! use candle_core::{Device, Tensor, D};
//!
//! // A custom contrastive-style loss: each rank's rows against ALL rows of the global batch.
//! let loss = |x: &Tensor, pg: &allgrad_dist::ProcessGroup| -> candle_core::Result<Tensor> {
//!     let all = all_gather(x, pg)?;                       // [B, D], differentiable
//!     let sim = x.matmul(&all.t()?)?;                     // [B/W, B]
//!     let lse = candle_nn_free_logsumexp(&sim)?;          // log Σ_j exp(sim_ij)
//!     lse.mean_all()                                      // mean over local anchors
//! };
//! fn candle_nn_free_logsumexp(s: &Tensor) -> candle_core::Result<Tensor> {
//!     let m = s.max_keepdim(D::Minus1)?;
//!     (s.broadcast_sub(&m)?.exp()?.sum_keepdim(D::Minus1)?.log()? + m)?.squeeze(D::Minus1)
//! }
//!
//! let x = Tensor::randn(0f64, 1.0, (12, 5), &Device::Cpu).unwrap();
//! for report in check_world_size_invariance(&x, &[2, 3, 4], loss).unwrap() {
//!     report.assert_close(1e-10).unwrap();
//! }
//! ```

use candle_core::{Result, Tensor, Var};

use crate::group::ProcessGroup;
use crate::threads::ThreadWorld;

/// How a W-rank run compared with the 1-rank run.
#[derive(Clone, Debug)]
pub struct InvarianceReport {
    /// Ranks of the distributed run.
    pub world_size: usize,
    /// Loss of the single-process run on the global batch.
    pub reference_loss: f64,
    /// Objective of the W-rank run: the mean over ranks of the per-rank losses.
    pub loss: f64,
    /// Largest absolute difference between the input gradients of the two runs.
    pub max_grad_diff: f64,
    /// Largest absolute input gradient of the reference (for relative tolerances).
    pub max_grad: f64,
}

impl InvarianceReport {
    /// Fails, with the figures, unless the loss agrees within `tol` relative to the reference
    /// loss, and the gradients within `tol` relative to the largest reference gradient entry
    /// (`max |g_W − g_1| / max |g_1|`: norm-wise, since rounding makes an entry's error
    /// proportional to the terms summed into it rather than to the entry). A reference of
    /// exactly zero asks for an exact zero.
    pub fn assert_close(&self, tol: f64) -> Result<()> {
        let rel = |diff: f64, scale: f64| if diff == 0.0 { 0.0 } else { diff / scale };
        let loss_err = rel((self.loss - self.reference_loss).abs(), self.reference_loss.abs());
        let grad_err = rel(self.max_grad_diff, self.max_grad);
        if !(loss_err <= tol && grad_err <= tol) {
            candle_core::bail!(
                "not world-size invariant at W = {}: loss {} vs single-process {} (rel. diff {loss_err:.3e}), \
                 largest gradient difference {:.3e} (rel. {grad_err:.3e}); tolerance {tol:.1e}",
                self.world_size,
                self.loss,
                self.reference_loss,
                self.max_grad_diff
            );
        }
        Ok(())
    }
}

/// Runs `loss(features, pg)` on one rank with the whole batch `global` (rows = samples),
/// then, for each W in `world_sizes`, on W thread-ranks with the rows split into W
/// consecutive near-equal parts, and compares:
/// - the single-process loss with the mean over ranks of the per-rank losses, and
/// - the single-process gradient of the features with the W-rank gradients under the
///   trainer's rule (each rank's backward scaled by 1/W), concatenated in rank order.
///
/// `loss` must return a scalar and build the same graph on every rank.
///
/// Fails, naming the rank and its rows of the batch, when the loss has no gradient with
/// respect to its input (on any rank, or in the single process), or when a rank's input
/// gradient is all zero where the single-process gradient of the same rows is not: a loss
/// that detaches its input cannot pass.
pub fn check_world_size_invariance<F>(global: &Tensor, world_sizes: &[usize], loss: F) -> Result<Vec<InvarianceReport>>
where
    F: Fn(&Tensor, &ProcessGroup) -> Result<Tensor> + Sync,
{
    let run = |w: usize| -> Result<(f64, Tensor)> {
        let rows = global.dim(0)?;
        let parts = crate::cpu::call::split_even(rows, w);
        let per_rank = ThreadWorld::new(w).run(|pg| {
            let part = &parts[pg.rank()];
            let x = Var::from_tensor(&global.narrow(0, part.start, part.len())?.contiguous()?)?;
            let l = loss(x.as_tensor(), &pg)?;
            if l.rank() != 0 {
                candle_core::bail!("the loss must be a scalar, got shape {:?}", l.dims());
            }
            let scaled = (&l / w as f64)?;
            let grads = scaled.backward()?;
            let Some(g) = grads.get(&x) else {
                candle_core::bail!(
                    "the loss has no gradient with respect to its input on rank {} of {w} (rows {:?} of the \
                     global batch): it does not depend on the input, or detaches it",
                    pg.rank(),
                    part
                );
            };
            let g = g.clone();
            Ok((l.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?, g))
        })?;
        let mean_loss = per_rank.iter().map(|(l, _)| l).sum::<f64>() / w as f64;
        let grads: Vec<Tensor> = per_rank.into_iter().map(|(_, g)| g).collect();
        Ok((mean_loss, Tensor::cat(&grads, 0)?))
    };
    let (reference_loss, reference_grad) = run(1)?;
    let max_grad = max_abs(&reference_grad)?;
    world_sizes
        .iter()
        .map(|&w| {
            let (l, g) = run(w)?;
            // A rank whose input gradient is all zero where the single process has a non-zero
            // one lost its gradient (a detached input, a collective without a backward); the
            // difference below would show it only relative to the tolerance, so say it here.
            for (r, part) in crate::cpu::call::split_even(reference_grad.dim(0)?, w).into_iter().enumerate() {
                let (got, want) = (g.narrow(0, part.start, part.len())?, reference_grad.narrow(0, part.start, part.len())?);
                if max_abs(&got)? == 0.0 && max_abs(&want)? != 0.0 {
                    candle_core::bail!(
                        "the input gradient of rank {r} of {w} (rows {part:?} of the global batch) is all zero, \
                         but the single-process gradient of those rows is not: the gradient is lost on the way"
                    );
                }
            }
            let diff = max_abs(&(g - &reference_grad)?)?;
            Ok(InvarianceReport { world_size: w, reference_loss, loss: l, max_grad_diff: diff, max_grad })
        })
        .collect()
}

/// Largest absolute value of a tensor (0 for an empty one), in f64.
fn max_abs(t: &Tensor) -> Result<f64> {
    if t.elem_count() == 0 {
        return Ok(0.0);
    }
    t.abs()?.max_all()?.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()
}
