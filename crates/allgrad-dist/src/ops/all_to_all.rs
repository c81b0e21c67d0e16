//! Differentiable all_to_all along dim 0.

use std::sync::OnceLock;

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use super::on_host;
use crate::group::host_ops::Kind;
use crate::group::ProcessGroup;

/// Splits dim 0 of `x` into W equal blocks (dim 0 must be divisible by W) and sends block j
/// to rank j; returns the blocks received, in rank order.
///
/// Backward (sum rule, see [`crate::ops`]): the inverse all_to_all of the output gradients
/// (block j of the gradient goes back to rank j).
pub fn all_to_all(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    let w = pg.world_size();
    match x.dims().first() {
        None => candle_core::bail!("all_to_all needs a tensor with at least one dimension, got a scalar"),
        Some(d0) if d0 % w != 0 => candle_core::bail!(
            "all_to_all on {}: dim 0 of the input (shape {:?}) is {d0}, not divisible by the group size {w}",
            pg.name(),
            x.dims()
        ),
        Some(d0) => all_to_all_sizes(x, &vec![d0 / w; w], pg),
    }
}

/// As [`all_to_all`] with uneven blocks: `send_sizes[j]` rows (consecutive along dim 0) go
/// to rank j. The result holds the rows every rank sent here, in rank order.
pub fn all_to_all_sizes(x: &Tensor, send_sizes: &[usize], pg: &ProcessGroup) -> Result<Tensor> {
    let rows = x.dims().first().copied().unwrap_or(0);
    if x.rank() == 0 || send_sizes.len() != pg.world_size() || send_sizes.iter().sum::<usize>() != rows {
        candle_core::bail!(
            "all_to_all on {}: split sizes {send_sizes:?} must have {} entries summing to dim 0 of the input (shape {:?})",
            pg.name(),
            pg.world_size(),
            x.dims()
        );
    }
    on_host(x, |x| x.apply_op1(AllToAll { pg: pg.clone(), send_sizes: send_sizes.to_vec(), recv_sizes: OnceLock::new() }))
}

struct AllToAll {
    pg: ProcessGroup,
    send_sizes: Vec<usize>,
    recv_sizes: OnceLock<Vec<usize>>,
}

impl CustomOp1 for AllToAll {
    fn name(&self) -> &'static str {
        "allgrad.all_to_all"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        super::host_fwd(&self.pg, Kind::AllToAll(self.send_sizes.clone()), s, l, Some(&self.recv_sizes))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda_fwd(&self.pg, Kind::AllToAll(self.send_sizes.clone()), s, l, Some(&self.recv_sizes))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let recv = self.recv_sizes.get().ok_or_else(|| candle_core::Error::Msg("all_to_all backward before forward".into()))?;
        Ok(Some(self.pg.all_to_all_sizes(&grad.contiguous()?, recv)?.0))
    }
}
