//! Differentiable all_gather along dim 0, with sizes that may differ between ranks.

use std::sync::OnceLock;

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use super::on_host;
use crate::group::host_ops::Kind;
use crate::group::ProcessGroup;
use crate::reduce::ReduceOp;

/// Concatenates every rank's `x` along dim 0, in rank order. Ranks may differ in dim-0 size;
/// the other dims must agree.
///
/// Backward (sum rule, see [`crate::ops`]): reduce_scatter(Sum) of the output gradients,
/// split by the ranks' sizes, so rank r receives `Σ_k ∂L_k/∂(its rows)` — not only its own
/// loss's share, which is 1/W of the truth when every rank computes the same loss.
pub fn all_gather(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    if x.rank() == 0 {
        candle_core::bail!("all_gather needs a tensor with at least one dimension, got a scalar");
    }
    on_host(x, |x| x.apply_op1(AllGather { pg: pg.clone(), sizes: OnceLock::new() }))
}

struct AllGather {
    pg: ProcessGroup,
    /// Every rank's dim-0 size, learned in the forward pass, needed by the backward.
    sizes: OnceLock<Vec<usize>>,
}

impl CustomOp1 for AllGather {
    fn name(&self) -> &'static str {
        "allgrad.all_gather"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        super::host_fwd(&self.pg, Kind::AllGather, s, l, Some(&self.sizes))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda_fwd(&self.pg, Kind::AllGather, s, l, Some(&self.sizes))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let sizes = self.sizes.get().ok_or_else(|| candle_core::Error::Msg("all_gather backward before forward".into()))?;
        Ok(Some(self.pg.reduce_scatter_sizes(&grad.contiguous()?, ReduceOp::Sum, sizes)?))
    }
}
