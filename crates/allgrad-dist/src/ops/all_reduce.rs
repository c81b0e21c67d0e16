//! Differentiable all_reduce for every reduction operator.

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use super::{on_host, reduction_grad};
use crate::group::host_ops::Kind;
use crate::group::ProcessGroup;
use crate::reduce::ReduceOp;

/// Element-wise reduction of `x` over all ranks; every rank gets the same result.
///
/// Backward (sum rule, see [`crate::ops`]), with `G = Σ_k g_k` the all-reduced output gradient:
/// - `Sum`: `G`; `Avg`: `G / W`;
/// - `Prod`: `G · Π_{j≠r} x_j`, computed from the gathered inputs without dividing by `x_r`,
///   so it is right when some inputs are zero;
/// - `Max`/`Min`: `G` goes to the rank(s) whose `x` equals the result; when several ranks tie,
///   each receives `G / (number of holders)`. A NaN result passes no gradient.
pub fn all_reduce(x: &Tensor, op: ReduceOp, pg: &ProcessGroup) -> Result<Tensor> {
    on_host(x, |x| x.apply_op1(AllReduce { pg: pg.clone(), op }))
}

struct AllReduce {
    pg: ProcessGroup,
    op: ReduceOp,
}

impl CustomOp1 for AllReduce {
    fn name(&self) -> &'static str {
        "allgrad.all_reduce"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        super::host_fwd(&self.pg, Kind::AllReduce(self.op), s, l, None)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda_fwd(&self.pg, Kind::AllReduce(self.op), s, l, None)
    }

    fn bwd(&self, arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let g_sum = self.pg.all_reduce(&grad.contiguous()?, ReduceOp::Sum)?;
        Ok(Some(reduction_grad(&self.pg, self.op, arg, res, &g_sum)?))
    }
}
