//! The plain collectives on Candle tensors (not differentiable; see [`crate::ops`]): each
//! reads the tensor into a host vector of its element type and calls the slice collective.
//! CUDA tensors take their group's path instead (the `cuda` module: NCCL on the device, or
//! staged through a pinned host buffer; see [`crate::gpu`]).

use candle_core::{DType, Device, Shape, Tensor};

use super::ProcessGroup;
use crate::cpu::mesh::OpCode;
use crate::dispatch::unsupported_dtype;
use crate::error::{DistError, DistResult};
use crate::reduce::{Elem, ReduceOp};

/// Runs `$body` with `$T` bound to the Rust type of a Candle dtype; other dtypes are an error.
macro_rules! dispatch {
    ($dtype:expr, $T:ident => $body:expr) => {
        crate::with_elem_type!($dtype, $T => $body, d => Err(unsupported_dtype(d).into()))
    };
}

/// Runs a collective of CPU tensors with its host copies (the tensor read into a vector, the
/// result made a tensor) not counted as device traffic: on the device path
/// (`candle_core::host_traffic`'s CPU counted as a device) these collectives stand for NCCL's,
/// which read and write device memory in place. CUDA tensors staged through host memory are
/// counted where they are staged (`cuda/host.rs`).
fn on_host<R>(f: impl FnOnce() -> R) -> R {
    candle_core::host_traffic::uncounted(f)
}

pub(super) fn shape_words(dims: &[usize]) -> Vec<u64> {
    dims.iter().map(|d| *d as u64).collect()
}

impl ProcessGroup {
    /// All-reduces a tensor (not differentiable; see [`crate::all_reduce`]).
    pub fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> candle_core::Result<Tensor> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            return super::cuda::all_reduce(self, x, op);
        }
        on_host(|| {
            dispatch!(x.dtype(), T => {
                let mut v = x.flatten_all()?.to_vec1::<T>()?;
                let meta = shape_words(x.dims());
                let what = || format!("all_reduce({op:?}) of {:?} {:?}", x.dtype(), x.dims());
                self.call(OpCode::AllReduce, Some(op), &meta, what, |m, c| m.all_reduce(c, op, &mut v))?;
                Tensor::from_vec(v, x.shape(), x.device())
            })
        })
    }

    /// Concatenates every rank's tensor along dim 0 (sizes along dim 0 may differ; the other
    /// dims must agree). Returns the result and each rank's dim-0 size.
    pub fn all_gather_with_sizes(&self, x: &Tensor) -> candle_core::Result<(Tensor, Vec<usize>)> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            return super::cuda::all_gather(self, x);
        }
        let (rows, rest) = split_first_dim(x, "all_gather")?;
        on_host(|| {
            dispatch!(x.dtype(), T => {
                let v = x.flatten_all()?.to_vec1::<T>()?;
                let (out, sizes) = self.all_gather_rows(&v, rows, &rest)?;
                let mut dims = vec![sizes.iter().sum::<usize>()];
                dims.extend_from_slice(&rest);
                Ok((Tensor::from_vec(out, dims, x.device())?, sizes))
            })
        })
    }

    /// Gathers `rows` rows of shape `rest` (row-major in `data`) from every rank, in rank
    /// order; returns the data and each rank's row count.
    pub fn all_gather_rows<T: Elem>(&self, data: &[T], rows: usize, rest: &[usize]) -> DistResult<(Vec<T>, Vec<usize>)> {
        let row: usize = rest.iter().product();
        let (out, counts) = self.all_gather_v_slice(data, &shape_words(rest))?;
        let sizes = if row == 0 {
            // Rows of zero elements: the element counts say nothing, so share the row counts.
            self.all_gather_slice(&[rows as i64])?.into_iter().map(|s| s as usize).collect()
        } else {
            counts.iter().map(|c| c / row).collect()
        };
        Ok((out, sizes))
    }

    /// Concatenates every rank's tensor along dim 0 (not differentiable; see [`crate::all_gather`]).
    pub fn all_gather(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(self.all_gather_with_sizes(x)?.0)
    }

    /// Reduces across ranks and returns this rank's part of dim 0, which is split into
    /// `sizes[j]` rows for rank j (not differentiable; see [`crate::reduce_scatter`]).
    pub fn reduce_scatter_sizes(&self, x: &Tensor, op: ReduceOp, sizes: &[usize]) -> candle_core::Result<Tensor> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            return super::cuda::reduce_scatter(self, x, op, sizes);
        }
        let (rows, rest) = split_first_dim(x, "reduce_scatter")?;
        if sizes.len() != self.world_size() || sizes.iter().sum::<usize>() != rows {
            return Err(DistError::Invalid(format!(
                "reduce_scatter on {}: dim-0 sizes {sizes:?} must have {} entries summing to {rows} (input shape {:?})",
                self.name(),
                self.world_size(),
                x.dims()
            ))
            .into());
        }
        let row: usize = rest.iter().product();
        on_host(|| {
            dispatch!(x.dtype(), T => {
                let v = x.flatten_all()?.to_vec1::<T>()?;
                let counts: Vec<usize> = sizes.iter().map(|s| s * row).collect();
                let out = self.reduce_scatter_slice(&v, op, &counts)?;
                let mut dims = vec![sizes[self.rank()]];
                dims.extend_from_slice(&rest);
                Tensor::from_vec(out, dims, x.device())
            })
        })
    }

    /// Reduces across ranks and returns this rank's 1/W of dim 0 (which must be divisible by W).
    pub fn reduce_scatter(&self, x: &Tensor, op: ReduceOp) -> candle_core::Result<Tensor> {
        let sizes = self.equal_split(x, "reduce_scatter")?;
        self.reduce_scatter_sizes(x, op, &sizes)
    }

    /// Returns rank `root`'s tensor on every rank (not differentiable; see [`crate::broadcast`]).
    /// Every rank passes a tensor of the same shape and dtype.
    pub fn broadcast(&self, x: &Tensor, root: usize) -> candle_core::Result<Tensor> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            return super::cuda::broadcast(self, x, root);
        }
        on_host(|| {
            dispatch!(x.dtype(), T => {
                let mut v = x.flatten_all()?.to_vec1::<T>()?;
                self.check_rank("broadcast root", root)?;
                let mut meta = shape_words(x.dims());
                meta.push(root as u64);
                self.call(OpCode::Broadcast, None, &meta, || format!("broadcast from rank {root} of {:?} {:?}", x.dtype(), x.dims()), |m, c| {
                    m.broadcast(c, &mut v, root)
                })?;
                Tensor::from_vec(v, x.shape(), x.device())
            })
        })
    }

    /// Reduces every rank's tensor to rank `root`; other ranks get their input back.
    pub fn reduce(&self, x: &Tensor, root: usize, op: ReduceOp) -> candle_core::Result<Tensor> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            return super::cuda::reduce(self, x, root, op);
        }
        on_host(|| {
            dispatch!(x.dtype(), T => {
                let mut v = x.flatten_all()?.to_vec1::<T>()?;
                self.check_rank("reduce root", root)?;
                let mut meta = shape_words(x.dims());
                meta.push(root as u64);
                self.call(OpCode::Reduce, Some(op), &meta, || format!("reduce({op:?}) to rank {root} of {:?} {:?}", x.dtype(), x.dims()), |m, c| {
                    m.reduce(c, op, &mut v, root)
                })?;
                Tensor::from_vec(v, x.shape(), x.device())
            })
        })
    }

    /// Sends `send_sizes[j]` rows of `x` (consecutive along dim 0) to rank j; returns the rows
    /// every rank sent here, concatenated in rank order, and how many came from each.
    pub fn all_to_all_sizes(&self, x: &Tensor, send_sizes: &[usize]) -> candle_core::Result<(Tensor, Vec<usize>)> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            return super::cuda::all_to_all(self, x, send_sizes);
        }
        let (rows, rest) = split_first_dim(x, "all_to_all")?;
        if send_sizes.len() != self.world_size() || send_sizes.iter().sum::<usize>() != rows {
            return Err(DistError::Invalid(format!(
                "all_to_all on {}: split sizes {send_sizes:?} must have {} entries summing to dim 0 = {rows} (input shape {:?})",
                self.name(),
                self.world_size(),
                x.dims()
            ))
            .into());
        }
        on_host(|| {
            dispatch!(x.dtype(), T => {
                let v = x.flatten_all()?.to_vec1::<T>()?;
                let (out, recv_sizes) = self.all_to_all_rows(&v, send_sizes, &rest)?;
                let mut dims = vec![recv_sizes.iter().sum::<usize>()];
                dims.extend_from_slice(&rest);
                Ok((Tensor::from_vec(out, dims, x.device())?, recv_sizes))
            })
        })
    }

    /// Sends `send_rows[j]` rows of shape `rest` (row-major in `data`, consecutive) to rank j;
    /// returns the rows received, in rank order, and how many came from each rank.
    pub fn all_to_all_rows<T: Elem>(&self, data: &[T], send_rows: &[usize], rest: &[usize]) -> DistResult<(Vec<T>, Vec<usize>)> {
        let row: usize = rest.iter().product();
        if row == 0 {
            // Rows of zero elements: exchange the row counts themselves.
            let counts: Vec<i64> = send_rows.iter().map(|r| *r as i64).collect();
            let (got, _) = self.all_to_all_v_slice(&counts, &vec![1; self.world_size()], &shape_words(rest))?;
            return Ok((Vec::new(), got.into_iter().map(|r| r as usize).collect()));
        }
        let counts: Vec<usize> = send_rows.iter().map(|s| s * row).collect();
        let (out, got) = self.all_to_all_v_slice(data, &counts, &shape_words(rest))?;
        Ok((out, got.iter().map(|c| c / row).collect()))
    }

    /// Splits dim 0 (divisible by W) into W equal blocks and sends block j to rank j.
    pub fn all_to_all(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let sizes = self.equal_split(x, "all_to_all")?;
        Ok(self.all_to_all_sizes(x, &sizes)?.0)
    }

    /// Sends `rows` rows of shape `rest` (row-major in `data`) to rank `dst_of[rank]`; returns
    /// the rows received from the rank that sends here, and how many there are.
    pub fn permute_rows<T: Elem>(
        &self,
        data: &[T],
        rows: usize,
        dst_of: &[usize],
        rest: &[usize],
    ) -> DistResult<(Vec<T>, usize)> {
        let row: usize = rest.iter().product();
        if row == 0 {
            // Rows of zero elements: send the row count itself.
            let got = self.permute_slice(&[rows as i64], dst_of, 1, &shape_words(rest))?;
            return Ok((Vec::new(), got[0] as usize));
        }
        let out = self.permute_slice(data, dst_of, row, &shape_words(rest))?;
        let n = out.len() / row;
        Ok((out, n))
    }

    /// Sends `x` to rank `dst_of[rank]` and returns the tensor of the rank that sends here
    /// (`dst_of` is a permutation of the ranks; dim 0 may differ from rank to rank, the other
    /// dims may not). Not differentiable; see [`crate::ppermute`].
    pub fn permute(&self, x: &Tensor, dst_of: &[usize]) -> candle_core::Result<Tensor> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            return super::cuda::permute(self, x, dst_of);
        }
        let (rows, rest) = split_first_dim(x, "permute")?;
        on_host(|| {
            dispatch!(x.dtype(), T => {
                let v = x.flatten_all()?.to_vec1::<T>()?;
                let (out, n) = self.permute_rows(&v, rows, dst_of, &rest)?;
                let mut dims = vec![n];
                dims.extend_from_slice(&rest);
                Tensor::from_vec(out, dims, x.device())
            })
        })
    }

    /// Sends a tensor to rank `dst` (which calls [`ProcessGroup::recv`] with the same shape and dtype).
    pub fn send(&self, x: &Tensor, dst: usize) -> candle_core::Result<()> {
        on_host(|| {
            dispatch!(x.dtype(), T => {
                let v = x.flatten_all()?.to_vec1::<T>()?;
                Ok(self.send_slice(&v, dst)?)
            })
        })
    }

    /// Receives a tensor of the given shape and dtype from rank `src`, on `device`.
    pub fn recv(&self, shape: impl Into<Shape>, dtype: DType, device: &Device, src: usize) -> candle_core::Result<Tensor> {
        let shape = shape.into();
        on_host(|| {
            dispatch!(dtype, T => {
                let mut v = vec![<T as bytemuck::Zeroable>::zeroed(); shape.elem_count()];
                self.recv_slice(&mut v, src)?;
                Tensor::from_vec(v, shape, device)
            })
        })
    }

    /// Waits until every rank has reached this point on `device`: for a CUDA device, an
    /// all_reduce of one element on it (through the group's CUDA path) that this call waits
    /// for, so the work queued on the device before it has finished everywhere; otherwise
    /// [`ProcessGroup::barrier`].
    pub fn device_barrier(&self, device: &Device) -> candle_core::Result<()> {
        #[cfg(feature = "cuda")]
        if device.is_cuda() {
            return super::cuda::device_barrier(self, device);
        }
        let _ = device;
        Ok(self.barrier()?)
    }

    fn equal_split(&self, x: &Tensor, what: &str) -> candle_core::Result<Vec<usize>> {
        let (rows, _) = split_first_dim(x, what)?;
        let w = self.world_size();
        if rows % w != 0 {
            return Err(DistError::Invalid(format!(
                "{what} on {}: dim 0 of the input (shape {:?}) is {rows}, not divisible by the group size {w}",
                self.name(),
                x.dims()
            ))
            .into());
        }
        Ok(vec![rows / w; w])
    }
}

fn split_first_dim(x: &Tensor, what: &str) -> candle_core::Result<(usize, Vec<usize>)> {
    match x.dims().split_first() {
        Some((d0, rest)) => Ok((*d0, rest.to_vec())),
        None => Err(DistError::Invalid(format!("{what} needs a tensor with at least one dimension, got a scalar")).into()),
    }
}
