//! Differentiable reduce_scatter along dim 0.

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use super::{on_host, reduction_grad};
use crate::group::host_ops::Kind;
use crate::group::ProcessGroup;
use crate::reduce::ReduceOp;

/// Reduces `x` element-wise over all ranks and returns this rank's block of dim 0, which is
/// split into W equal blocks (dim 0 must be divisible by W).
///
/// Backward (sum rule, see [`crate::ops`]): for `Sum`, the all_gather of the output
/// gradients (rank r's input gradient is the concatenation of every rank's block gradient);
/// `Avg` divides that by W; `Prod`, `Max` and `Min` follow the all_reduce rules applied to
/// each block.
pub fn reduce_scatter(x: &Tensor, op: ReduceOp, pg: &ProcessGroup) -> Result<Tensor> {
    let w = pg.world_size();
    match x.dims().first() {
        None => candle_core::bail!("reduce_scatter needs a tensor with at least one dimension, got a scalar"),
        Some(d0) if d0 % w != 0 => candle_core::bail!(
            "reduce_scatter on {}: dim 0 of the input (shape {:?}) is {d0}, not divisible by the group size {w}",
            pg.name(),
            x.dims()
        ),
        _ => {}
    }
    on_host(x, |x| x.apply_op1(ReduceScatter { pg: pg.clone(), op }))
}

struct ReduceScatter {
    pg: ProcessGroup,
    op: ReduceOp,
}

impl ReduceScatter {
    /// W equal blocks of dim 0.
    fn kind(&self, l: &Layout) -> Kind {
        let w = self.pg.world_size();
        Kind::ReduceScatter(self.op, vec![l.dims()[0] / w; w])
    }
}

impl CustomOp1 for ReduceScatter {
    fn name(&self) -> &'static str {
        "allgrad.reduce_scatter"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        super::host_fwd(&self.pg, self.kind(l), s, l, None)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda_fwd(&self.pg, self.kind(l), s, l, None)
    }

    fn bwd(&self, arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        // reduce_scatter(x) is this rank's block of all_reduce(x): the all-reduced output
        // gradient is every rank's block gradient in rank order, i.e. their all_gather.
        let g_sum = self.pg.all_gather(&grad.contiguous()?)?;
        if matches!(self.op, ReduceOp::Sum | ReduceOp::Avg) {
            return Ok(Some(reduction_grad(&self.pg, self.op, arg, res, &g_sum)?));
        }
        let out_full = self.pg.all_gather(&res.contiguous()?)?;
        Ok(Some(reduction_grad(&self.pg, self.op, arg, &out_full, &g_sum)?))
    }
}
