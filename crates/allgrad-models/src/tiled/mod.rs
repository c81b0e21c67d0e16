//! Exact contrastive losses in tiles: the cross-entropy over pairwise logits of `m` query rows
//! against `n` key columns, without ever holding more than a `tile x tile` block of them.
//!
//! # What is computed
//!
//! With `s_ij` the logit of query `i` and key `j` (by default `q_i·k_j / τ`), each row's loss
//! is `ℓ_i = logsumexp_{j allowed} s_ij − s_{i, t_i}`: a softmax cross-entropy whose target is
//! the row's positive column `t_i` ([`Pairs::target`]), with one column per row that can be
//! left out ([`Pairs::exclude`], NT-Xent's anchor itself) and one that can carry a constant
//! ([`Pairs::boost`], supervised SimCSE's hard-negative weight). The functions here return
//! `Σ_i ℓ_i` over the rows they are given; the losses scale it (`W / 2B` for NT-Xent).
//!
//! **Forward.** For each block of rows, the logits of one block of keys at a time; each row
//! keeps a running maximum and a sum of exponentials rescaled whenever the maximum grows
//! (the online log-sum-exp), in the dtype of the run. The row's `lse_i` is kept (`m` numbers).
//!
//! **Backward.** A Candle custom op of its own: it recomputes each block's logits, forms
//! `dS = g·(softmax − onehot(t))` from the kept `lse`, and accumulates the gradients of the
//! queries, of the keys and of the parameters (the temperature). Candle's graph holds only
//! the op's inputs (queries, keys, parameters): never a logits matrix, its softmax or its
//! gradient.
//!
//! **Exactness.** The same sums in another order: a tiled loss equals the untiled one to
//! rounding (f64: relative 1e-10 in the tests, for tiles of 1, 7, the batch and more), and
//! equals it across world sizes exactly as the untiled loss does.
//!
//! # Cost
//!
//! - Memory per rank: the queries `[m, d]`, the gathered keys `[n, d]`, their gradients and
//!   `lse` `[m]` — linear in the batch — plus the blocks in flight: on the CPU (f32, f64) one
//!   `tile x tile` block (and a row) per worker thread; on other devices, or with a scores
//!   function of your own, a few block-sized temporaries. Untiled, the loss holds `m x n`
//!   logits several times over (logits, masked logits, exponentials, their gradients).
//! - Time: each logit is computed twice (forward, and again in the backward) where an
//!   untiled loss computes it once and keeps it: one more `m·n·d` GEMM and one more pass of
//!   exponentials, against the memory traffic of the whole matrix.
//! - Picking a tile: large enough that a block's GEMM is efficient and its bookkeeping
//!   (one pass per row per block) is amortised — 1024 to 4096 on a CPU, where a 4096 block is
//!   64 MiB of f32 per thread — and small enough that `threads x tile² x element size` fits
//!   beside the model. `docs/tiled_loss.md` has measurements.
//!
//! # Where the keys come from
//!
//! The built-in losses ([`crate::losses::nt_xent_tiled`], [`crate::simcse::info_nce_tiled`])
//! gather every rank's keys whole with the differentiable `all_gather` (`[B, d]`, or `[2B, d]`,
//! a small fraction of the memory the logits took), and the keys' gradient goes back through
//! its backward (a reduce-scatter: the sum rule), exactly as in the untiled losses. So the
//! tiled losses are W-invariant for the same reason the untiled ones are. A ring, in which
//! each rank's keys arrive in turn while the previous rank's blocks are computed, would
//! overlap the gather with the compute; on the CPU backend communication and compute share
//! the same cores, and the gather moves `O(B·d)` bytes against `O(B²·d / W)` multiply-adds,
//! so the whole gather is kept: simpler, and the same gradient path as the untiled losses.
//!
//! # Negatives from past batches
//!
//! A [`KeyQueue`] keeps the keys of the last K global batches (detached, identical on every
//! rank); [`scaled_dot_cross_entropy_with`] appends them to every row's candidates as
//! negatives, and the losses' `*_queued` forms ([`crate::losses::nt_xent_tiled_queued`],
//! [`crate::simcse::info_nce_tiled_queued`]) read and update the queue (`loss.queue` in a run).
//!
//! # In a run: `loss.tile` and `loss.queue`
//!
//! [`Tiling`] (`tiling.rs`) is what the two keys mean and their one check, for every loss that
//! has them (NT-Xent, SimCSE's InfoNCE, CLIP's, the last without a queue): each loss config
//! gives its checked tiling (`tiling()`), the methods of allgrad-train validate through it and
//! the objectives build from it. The functions here still refuse a tile of 0 from a caller of
//! their own.
//!
//! # Your own pairwise loss
//!
//! [`tiled_cross_entropy`] takes the per-block logits as a function ([`TileScores`]) and gives
//! the exact loss and its gradient with respect to queries, keys and a parameter tensor:
//!
//! ```
//! use allgrad_models::tiled::{tiled_cross_entropy, Pairs};
//! use candle_core::{Device, Tensor, Var};
//! # fn main() -> candle_core::Result<()> {
//! let q = Var::from_tensor(&Tensor::randn(0f64, 1.0, (5, 3), &Device::Cpu)?)?;
//! let k = Var::from_tensor(&Tensor::randn(0f64, 1.0, (8, 3), &Device::Cpu)?)?;
//! let scale = Var::from_tensor(&Tensor::new(2.0f64, &Device::Cpu)?)?;
//! // Logits: negative squared distances times a learnable scale.
//! let scores = |q: &Tensor, k: &Tensor, scale: &Tensor| -> candle_core::Result<Tensor> {
//!     let qq = q.sqr()?.sum_keepdim(1)?;
//!     let kk = k.sqr()?.sum_keepdim(1)?.t()?;
//!     let d2 = (qq.broadcast_add(&kk)? - (q.matmul(&k.t()?)? * 2.0)?)?;
//!     d2.neg()?.broadcast_mul(scale)
//! };
//! let pairs = Pairs { target: Some(vec![0, 1, 2, 3, 4]), ..Default::default() };
//! let loss = tiled_cross_entropy(q.as_tensor(), k.as_tensor(), scale.as_tensor(), pairs, scores, 2)?;
//! let grads = loss.backward()?;
//! assert!(grads.get(&q).is_some() && grads.get(&k).is_some() && grads.get(&scale).is_some());
//! # Ok(()) }
//! ```

mod cpu;
mod op;
mod pairs;
mod queue;
mod tiling;

use std::sync::Arc;

use candle_core::{DType, Result, Tensor};

pub use pairs::Pairs;
pub use queue::{load_queue_buffers, queue_buffers, KeyQueue};
pub use tiling::{Tiling, QUEUED_LOSSES, TILED_LOSSES};

use crate::temperature::Temperature;
pub(crate) use cpu::{gemm as host_gemm, Elem as KernelElem};
use op::Kernel;

/// `q·kᵀ · scale` of `m` query rows against `n` key rows (`d` wide, row-major host slices)
/// by the fused CPU kernel in `tile x tile` blocks: each row's log-sum-exp over these keys
/// alone. The ring losses combine the blocks' log-sum-exps ([`crate::clip`]).
pub(crate) fn dot_lse<T: KernelElem>(
    q: &[T],
    k: &[T],
    (m, n, d): (usize, usize, usize),
    scale: f64,
    tile: usize,
) -> Result<Vec<T>> {
    let pairs = Pairs::default();
    let p = cpu::Problem { q, k, m, n, n_grad: n, d, inv_t: T::from_f64(scale), pairs: &pairs, tile };
    Ok(cpu::forward(&p)?.0)
}

/// The gradients of `g · Σ_i (lse_i − s_{i,i})` restricted to this block of keys, `lse` each
/// row's log-sum-exp over EVERY key of the loss, by the fused CPU kernel: the queries' added to
/// `dq` (`[m, d]`), and `(dk, Σ dS ⊙ s)` returned. The `s_{i,i}` terms only with
/// `positives = Some(r0)`: the keys are the rows' own, from row `r0` on (key `j` is row
/// `r0 + j`'s positive).
#[allow(clippy::too_many_arguments)]
pub(crate) fn dot_grads<T: KernelElem>(
    q: &[T],
    k: &[T],
    (m, n, d): (usize, usize, usize),
    scale: f64,
    tile: usize,
    positives: Option<usize>,
    lse: &[T],
    g: f64,
    dq: &mut [T],
) -> Result<(Vec<T>, f64)> {
    // A row whose positive is not among these keys gets a column past them (none).
    let pairs = match positives {
        Some(r0) => {
            Pairs { target: Some((0..m).map(|i| i.checked_sub(r0).unwrap_or(usize::MAX)).collect()), ..Default::default() }
        }
        None => Pairs::default(),
    };
    let p = cpu::Problem { q, k, m, n, n_grad: n, d, inv_t: T::from_f64(scale), pairs: &pairs, tile };
    let mut dk = vec![T::from_f64(0.0); n * d];
    let ds_dot_s = cpu::backward_into(&p, lse, T::from_f64(g), [true, true, true], dq, &mut dk)?;
    Ok((dk, ds_dot_s))
}

/// The logits of a block of queries against a block of keys: what a pairwise loss of your own
/// provides to [`tiled_cross_entropy`]. Implemented by closures
/// `Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>`.
pub trait TileScores: Send + Sync + 'static {
    /// The `[tq, tk]` logits of queries `q` (`[tq, d]`, a block of rows) against keys `k`
    /// (`[tk, d]`), with the parameters `params` (the tensor given to
    /// [`tiled_cross_entropy`]). Must be differentiable in all three (Candle ops) unless
    /// [`TileScores::backward`] is implemented, and depend on nothing else that needs a
    /// gradient: only `q`, `k` and `params` receive one, and logits that carry a graph of
    /// something else (a `Var` the function captured) are an error: pass it in `params`.
    fn scores(&self, q: &Tensor, k: &Tensor, params: &Tensor) -> Result<Tensor>;

    /// Whether [`TileScores::backward`] is implemented. When it is not (the default), the
    /// backward differentiates [`TileScores::scores`] block by block with Candle's autograd.
    fn has_backward(&self) -> bool {
        false
    }

    /// The gradients of `Σ_ij ds_ij · s_ij` with respect to `q`, `k` and `params`, where `s`
    /// is what [`TileScores::scores`] returned for them.
    fn backward(&self, _q: &Tensor, _k: &Tensor, _params: &Tensor, _s: &Tensor, _ds: &Tensor) -> Result<[Tensor; 3]> {
        candle_core::bail!("this TileScores has no backward of its own")
    }
}

impl<F> TileScores for F
where
    F: Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor> + Send + Sync + 'static,
{
    fn scores(&self, q: &Tensor, k: &Tensor, params: &Tensor) -> Result<Tensor> {
        self(q, k, params)
    }
}

/// The scaled dot product `s_ij = q_i·k_j / τ`, `params` being τ (one number), with its
/// gradients written out: `dq = ds·k / τ`, `dk = dsᵀ·q / τ`, `dτ = −Σ ds ⊙ s / τ`.
/// What [`scaled_dot_cross_entropy`] computes off the CPU; on the CPU a fused kernel does.
#[derive(Clone, Copy, Debug, Default)]
pub struct ScaledDot;

impl TileScores for ScaledDot {
    fn scores(&self, q: &Tensor, k: &Tensor, t: &Tensor) -> Result<Tensor> {
        q.matmul(&k.t()?)?.broadcast_div(&t.flatten_all()?)
    }

    fn has_backward(&self) -> bool {
        true
    }

    fn backward(&self, q: &Tensor, k: &Tensor, t: &Tensor, s: &Tensor, ds: &Tensor) -> Result<[Tensor; 3]> {
        let tv = t.flatten_all()?;
        let dq = ds.matmul(k)?.broadcast_div(&tv)?;
        let dk = ds.t()?.matmul(q)?.broadcast_div(&tv)?;
        let dt = (ds * s)?.sum_all()?.neg()?.reshape(1)?.broadcast_div(&tv)?.reshape(t.shape())?;
        Ok([dq, dk, dt])
    }
}

/// `Σ_i (logsumexp_{j allowed} s_ij − s_{i, t_i})` over the rows of `queries` (`[m, d]`)
/// against `keys` (`[n, d]`) with `s_ij = q_i·k_j / τ`, in blocks of `tile x tile` (see the
/// module docs): a fused kernel on the CPU for f32 and f64, [`ScaledDot`] on blocks elsewhere.
/// Differentiable in queries, keys and a learned temperature.
///
/// # Errors
/// A tile of 0, shapes that do not fit, [`Pairs`] out of range, a temperature that is not
/// positive.
pub fn scaled_dot_cross_entropy(
    queries: &Tensor,
    keys: &Tensor,
    temperature: &Temperature,
    pairs: Pairs,
    tile: usize,
) -> Result<Tensor> {
    scaled_dot_cross_entropy_with(queries, keys, None, temperature, pairs, tile)
}

/// [`scaled_dot_cross_entropy`] with `extra` keys (`[e, d]`) after `keys`: more negatives in
/// every row's softmax (a [`KeyQueue`] of past batches), without a gradient. [`Pairs`] columns
/// number `keys` first, then `extra`.
///
/// # Errors
/// As [`scaled_dot_cross_entropy`], and when `extra` differs from `keys` in width, dtype or
/// device.
pub fn scaled_dot_cross_entropy_with(
    queries: &Tensor,
    keys: &Tensor,
    extra: Option<&Tensor>,
    temperature: &Temperature,
    pairs: Pairs,
    tile: usize,
) -> Result<Tensor> {
    temperature.check()?;
    let t = temperature.tensor(queries.dtype(), queries.device())?;
    // The fused kernel is the CPU's own; on the device path the CPU runs the block path, as a
    // device does.
    let fused = queries.device().is_cpu()
        && !allgrad_nn::transfer::takes_device_path(queries.device())
        && matches!(queries.dtype(), DType::F32 | DType::F64);
    let kernel = if fused { Kernel::FusedDot } else { Kernel::Blocks(Arc::new(ScaledDot)) };
    op::apply(queries, keys, extra, &t, pairs, kernel, tile)
}

/// As [`scaled_dot_cross_entropy`], with the logits of each block from `scores` (your own
/// pairwise logits) and `params` its parameters (any shape; pass a constant when there are
/// none): the exact loss, with gradients for queries, keys and `params`, never holding more
/// than a `tile x tile` block of logits (and the temporaries of `scores` on it).
///
/// # Errors
/// As [`scaled_dot_cross_entropy`], and when `scores` fails or returns another shape than
/// `[tq, tk]` or another dtype than its inputs'.
pub fn tiled_cross_entropy(
    queries: &Tensor,
    keys: &Tensor,
    params: &Tensor,
    pairs: Pairs,
    scores: impl TileScores,
    tile: usize,
) -> Result<Tensor> {
    op::apply(queries, keys, None, params, pairs, Kernel::Blocks(Arc::new(scores)), tile)
}
