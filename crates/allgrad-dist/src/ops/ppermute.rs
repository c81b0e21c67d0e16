//! Differentiable point-to-point exchange: a permutation of the ranks' tensors, and the ring
//! shift made of it.

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use super::on_host;
use crate::group::host_ops::Kind;
use crate::group::ProcessGroup;

/// Sends `x` to rank `dst_of[rank]` and returns the tensor of the rank that sends here.
/// `dst_of` is a permutation of the group's ranks, the same on every rank; dim 0 may differ
/// from rank to rank (uneven shards), the other dims may not. On the CPU (and for CUDA tensors
/// staged through the host) the data and their row count travel between the two peers only;
/// through NCCL the row counts go to every peer over TCP and the data move point to point.
///
/// Backward (sum rule, see [`crate::ops`]): output k is input `src(k)`, so rank r receives the
/// gradient of the output on rank `dst_of[r]` — the inverse permutation of the gradients.
pub fn ppermute(x: &Tensor, dst_of: &[usize], pg: &ProcessGroup) -> Result<Tensor> {
    pg.check_permutation(dst_of)?;
    if x.rank() == 0 {
        candle_core::bail!("ppermute on {} needs a tensor with at least one dimension, got a scalar", pg.name());
    }
    on_host(x, |x| x.apply_op1(Permute { pg: pg.clone(), dst_of: dst_of.to_vec() }))
}

/// The ring shift: rank r's `x` goes to rank `(r + shift) mod W`, so rank r gets the tensor of
/// rank `(r - shift) mod W`. A [`ppermute`]; its backward shifts the gradients by `-shift`.
pub fn ring_shift(x: &Tensor, shift: isize, pg: &ProcessGroup) -> Result<Tensor> {
    ppermute(x, &ring_destinations(pg.world_size(), shift), pg)
}

/// The destinations of a ring shift by `shift` over `w` ranks: rank r sends to `(r + shift) mod w`.
pub fn ring_destinations(w: usize, shift: isize) -> Vec<usize> {
    let w_i = w as isize;
    (0..w_i).map(|r| (r + shift).rem_euclid(w_i.max(1)) as usize).collect()
}

struct Permute {
    pg: ProcessGroup,
    dst_of: Vec<usize>,
}

impl CustomOp1 for Permute {
    fn name(&self) -> &'static str {
        "allgrad.ppermute"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        super::host_fwd(&self.pg, Kind::Permute(self.dst_of.clone()), s, l, None)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda_fwd(&self.pg, Kind::Permute(self.dst_of.clone()), s, l, None)
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let mut back = vec![0; self.dst_of.len()];
        for (from, &to) in self.dst_of.iter().enumerate() {
            back[to] = from;
        }
        Ok(Some(self.pg.permute(&grad.contiguous()?, &back)?))
    }
}
