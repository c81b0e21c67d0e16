//! Differentiable broadcast.

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use super::on_host;
use crate::group::host_ops::Kind;
use crate::group::ProcessGroup;
use crate::reduce::ReduceOp;

/// Returns rank `src`'s `x` on every rank (every rank passes a tensor of the same shape).
///
/// Backward (sum rule, see [`crate::ops`]): rank `src` receives the sum over ranks of the
/// output gradients (a reduce to `src`); the other ranks' inputs did not affect the result
/// and receive zeros.
pub fn broadcast(x: &Tensor, src: usize, pg: &ProcessGroup) -> Result<Tensor> {
    if src >= pg.world_size() {
        candle_core::bail!("broadcast source {src} is not a rank of {} (size {})", pg.name(), pg.world_size());
    }
    on_host(x, |x| x.apply_op1(Broadcast { pg: pg.clone(), src }))
}

struct Broadcast {
    pg: ProcessGroup,
    src: usize,
}

impl CustomOp1 for Broadcast {
    fn name(&self) -> &'static str {
        "allgrad.broadcast"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        super::host_fwd(&self.pg, Kind::Broadcast(self.src), s, l, None)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda_fwd(&self.pg, Kind::Broadcast(self.src), s, l, None)
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let summed = self.pg.reduce(&grad.contiguous()?, self.src, ReduceOp::Sum)?;
        if self.pg.rank() == self.src {
            Ok(Some(summed))
        } else {
            Ok(Some(grad.zeros_like()?))
        }
    }
}
