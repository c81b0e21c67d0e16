//! Data-parallel gradient synchronisation.
//!
//! After backward, every gradient has been scaled by 1/W (the loss was divided by W).
//! Replicated parameters are then SUMMED across ranks, which is DDP's average; sharded
//! parameters are not communicated. Gradients travel in flattened buckets of about
//! `bucket_bytes`, filled in parameter-name order, so every rank issues the same collectives.

use allgrad_dist::{Elem, ProcessGroup, ReduceOp};
use candle_core::{DType, Result, Tensor};

/// Default bucket size, as in PyTorch DDP.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// Sums the gradients of replicated parameters across ranks, in place.
pub fn sync_gradients(pg: &ProcessGroup, grads: &mut [Tensor], sharded: &[bool], bucket_bytes: usize) -> Result<()> {
    if pg.world_size() == 1 {
        return Ok(());
    }
    for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
        let members: Vec<usize> = (0..grads.len()).filter(|i| !sharded[*i] && grads[*i].dtype() == dtype).collect();
        if members.is_empty() {
            continue;
        }
        let cap = (bucket_bytes / dtype.size_in_bytes()).max(1);
        let mut start = 0;
        while start < members.len() {
            let mut end = start;
            let mut n = 0;
            while end < members.len() && (end == start || n + grads[members[end]].elem_count() <= cap) {
                n += grads[members[end]].elem_count();
                end += 1;
            }
            let bucket = &members[start..end];
            match dtype {
                DType::F32 => sync_bucket::<f32>(pg, grads, bucket)?,
                DType::F64 => sync_bucket::<f64>(pg, grads, bucket)?,
                DType::BF16 => sync_bucket::<half::bf16>(pg, grads, bucket)?,
                _ => sync_bucket::<half::f16>(pg, grads, bucket)?,
            }
            start = end;
        }
    }
    // Ranks whose bucket layouts differ fail in the first bucket: the collective carries the
    // bucket's length, and a mismatch names both calls.
    Ok(())
}

fn sync_bucket<T: Elem>(pg: &ProcessGroup, grads: &mut [Tensor], bucket: &[usize]) -> Result<()> {
    let mut flat: Vec<T> = Vec::new();
    for &i in bucket {
        flat.extend(grads[i].flatten_all()?.to_vec1::<T>()?);
    }
    pg.all_reduce_slice(&mut flat, ReduceOp::Sum)?;
    let mut off = 0;
    for &i in bucket {
        let n = grads[i].elem_count();
        grads[i] = Tensor::from_slice(&flat[off..off + n], grads[i].shape(), grads[i].device())?;
        off += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use allgrad_dist::run_threads;
    use candle_core::Device;

    #[test]
    fn replicated_gradients_are_summed_and_sharded_ones_left_alone() {
        for w in [1, 2, 3] {
            let out = run_threads(w, |pg| {
                let r = pg.rank() as f32;
                let mut grads = vec![
                    Tensor::new(&[1.0f32 + r, 2.0], &Device::Cpu)?,
                    Tensor::new(&[10.0f32 * (r + 1.0)], &Device::Cpu)?,
                    Tensor::new(&[0.5f64 * (r as f64 + 1.0); 3], &Device::Cpu)?,
                ];
                // A tiny bucket size forces one bucket per tensor.
                sync_gradients(&pg, &mut grads, &[false, true, false], 4)?;
                Ok((grads[0].to_vec1::<f32>()?, grads[1].to_vec1::<f32>()?, grads[2].to_vec1::<f64>()?))
            })
            .unwrap();
            let n = w as f32;
            for (rank, (a, sharded, c)) in out.into_iter().enumerate() {
                assert_eq!(a, vec![n + n * (n - 1.0) / 2.0, 2.0 * n], "W={w}");
                assert_eq!(sharded, vec![10.0 * (rank as f32 + 1.0)], "W={w}: a sharded gradient was communicated");
                assert_eq!(c, vec![0.5 * (n as f64) * (n as f64 + 1.0) / 2.0; 3], "W={w}");
            }
        }
    }
}
