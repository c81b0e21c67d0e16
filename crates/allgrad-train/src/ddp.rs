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

/// Sums the gradients of replicated parameters across ranks, in place. Gradients on the CPU
/// travel as host vectors; gradients on another device (CUDA) are concatenated there and
/// all-reduced as one tensor, which goes through NCCL in a build with the `nccl` feature.
pub fn sync_gradients(pg: &ProcessGroup, grads: &mut [Tensor], sharded: &[bool], bucket_bytes: usize) -> Result<()> {
    if pg.world_size() == 1 {
        return Ok(());
    }
    let layout: Vec<(usize, DType)> = grads.iter().map(|g| (g.elem_count(), g.dtype())).collect();
    // Ranks whose bucket layouts differ fail in the first bucket: the collective carries the
    // bucket's length, and a mismatch names both calls.
    for (dtype, bucket) in plan_buckets(&layout, sharded, bucket_bytes) {
        // A device (and the CPU on the device path) reduces the bucket as one tensor on it.
        if allgrad_nn::transfer::takes_device_path(grads[bucket[0]].device()) {
            sync_bucket_on_device(pg, grads, &bucket)?;
            continue;
        }
        match dtype {
            DType::F32 => sync_bucket::<f32>(pg, grads, &bucket)?,
            DType::F64 => sync_bucket::<f64>(pg, grads, &bucket)?,
            DType::BF16 => sync_bucket::<half::bf16>(pg, grads, &bucket)?,
            _ => sync_bucket::<half::f16>(pg, grads, &bucket)?,
        }
    }
    Ok(())
}

/// The buckets of a gradient sync: the indices of the replicated gradients (`sharded[i]`
/// false) of each float dtype, in order (f32, f64, bf16, f16; by index within a dtype), cut
/// into consecutive runs of at most `bucket_bytes` (a gradient larger than that is a bucket
/// of its own). `layout[i]` is gradient i's element count and dtype; other dtypes are not
/// synchronised.
pub fn plan_buckets(layout: &[(usize, DType)], sharded: &[bool], bucket_bytes: usize) -> Vec<(DType, Vec<usize>)> {
    let mut plan = Vec::new();
    for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
        let cap = (bucket_bytes / dtype.size_in_bytes()).max(1);
        let mut bucket: Vec<usize> = Vec::new();
        let mut n = 0;
        for i in (0..layout.len()).filter(|i| !sharded[*i] && layout[*i].1 == dtype) {
            if !bucket.is_empty() && n + layout[i].0 > cap {
                plan.push((dtype, std::mem::take(&mut bucket)));
                n = 0;
            }
            bucket.push(i);
            n += layout[i].0;
        }
        if !bucket.is_empty() {
            plan.push((dtype, bucket));
        }
    }
    plan
}

/// One bucket on its own device: concatenated, all-reduced as one tensor, split back.
fn sync_bucket_on_device(pg: &ProcessGroup, grads: &mut [Tensor], bucket: &[usize]) -> Result<()> {
    let parts = bucket.iter().map(|&i| grads[i].flatten_all()).collect::<Result<Vec<_>>>()?;
    let summed = pg.all_reduce(&Tensor::cat(&parts, 0)?, ReduceOp::Sum)?;
    let mut off = 0;
    for &i in bucket {
        let n = grads[i].elem_count();
        grads[i] = summed.narrow(0, off, n)?.reshape(grads[i].shape())?;
        off += n;
    }
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
    fn buckets_hold_replicated_gradients_of_one_dtype_in_order_up_to_the_size() {
        use DType::{BF16, F32, F64, U32};
        // (elements, dtype) of gradients 0..8; 2 and 5 are sharded; 7 is not a float.
        let layout = [(10, F32), (20, F32), (5, F32), (4, F64), (31, F32), (1, F32), (3, BF16), (2, U32), (2, F64)];
        let sharded = [false, false, true, false, false, true, false, false, false];
        // 100 bytes: 25 f32, 12 f64, 50 bf16 elements per bucket.
        let plan = plan_buckets(&layout, &sharded, 100);
        assert_eq!(plan, vec![(F32, vec![0]), (F32, vec![1]), (F32, vec![4]), (F64, vec![3, 8]), (BF16, vec![6])]);
        // 30 f32 elements: 10 + 20 fit together; 31 is alone though it exceeds the size.
        let plan = plan_buckets(&layout, &sharded, 120);
        assert_eq!(plan[..2], [(F32, vec![0, 1]), (F32, vec![4])]);
        // Every replicated float gradient is in exactly one bucket.
        let mut seen: Vec<usize> = plan.iter().flat_map(|(_, b)| b.clone()).collect();
        seen.sort();
        assert_eq!(seen, vec![0, 1, 3, 4, 6, 8]);
        assert!(plan_buckets(&layout, &[true; 9], 100).is_empty());
    }

    #[test]
    fn the_device_path_splits_the_reduced_bucket_back_into_the_original_shapes() {
        // The path CUDA gradients take, run on CPU tensors: same sums as the host path.
        for w in [2, 3] {
            let out = run_threads(w, |pg| {
                let r = pg.rank() as f64;
                let grads = vec![
                    Tensor::new(&[[1.0f64 + r, 2.0 - r], [3.0 * r, 4.0]], &Device::Cpu)?,
                    Tensor::new(&[5.0f64 + r * r], &Device::Cpu)?,
                    Tensor::new(&[[[0.25f64 * (r + 1.0)], [-1.0]]], &Device::Cpu)?,
                ];
                let mut on_device = grads.clone();
                sync_bucket_on_device(&pg, &mut on_device, &[0, 1, 2])?;
                let mut on_host = grads;
                sync_bucket::<f64>(&pg, &mut on_host, &[0, 1, 2])?;
                let flat = |g: &[Tensor]| -> Result<Vec<(Vec<usize>, Vec<f64>)>> {
                    g.iter().map(|t| Ok((t.dims().to_vec(), t.flatten_all()?.to_vec1::<f64>()?))).collect()
                };
                Ok((flat(&on_device)?, flat(&on_host)?))
            })
            .unwrap();
            let n = w as f64;
            let sum_r = n * (n - 1.0) / 2.0;
            let sum_r2 = (0..w).map(|r| (r * r) as f64).sum::<f64>();
            for (dev, host) in out {
                assert_eq!(dev, host, "W={w}");
                assert_eq!(dev[0], (vec![2, 2], vec![n + sum_r, 2.0 * n - sum_r, 3.0 * sum_r, 4.0 * n]));
                assert_eq!(dev[1], (vec![1], vec![5.0 * n + sum_r2]));
                assert_eq!(dev[2], (vec![1, 2, 1], vec![0.25 * (sum_r + n), -n]));
            }
        }
    }

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
