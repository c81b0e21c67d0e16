//! The collectives on CUDA tensors through NCCL (feature `nccl`): [`forward`] runs one for a
//! group whose CUDA path is `nccl` (the dispatch beside this file sends the plain collectives
//! and the `cuda_fwd` of the differentiable ops here). Each checks its call over TCP
//! (`group/checked.rs`), then moves the data with NCCL on the device's stream, through the
//! group's communicator (`gpu::nccl`).
//!
//! Uneven sizes: all_gather pads every rank's rows to the largest count, gathers, and
//! compacts on the device; reduce_scatter with uneven blocks all-reduces and keeps its block;
//! all_to_all is a group of NCCL sends and receives (the row counts travel over TCP first).
//! Max and Min follow NCCL's comparison (the CPU backend lets NaN win), and Avg is `ncclAvg`.

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc;
use candle_core::cuda::CudaDType;
use candle_core::{CudaStorage, Layout, Result, Shape};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::{result, NcclType};

use super::Out;
use crate::cpu::mesh::OpCode;
use crate::dispatch::unsupported_dtype;
use crate::error::{DistError, DistResult};
use crate::gpu::cuda::cuda;
use crate::gpu::nccl::{comm_for, nccl_op};
use crate::group::host_ops::Kind;
use crate::group::ProcessGroup;
use crate::reduce::Elem;

/// Runs `kind` on the CUDA storage `s` (layout `l`, contiguous); returns the output, its shape
/// and, for all_gather and all_to_all, the rows per rank.
pub(crate) fn forward(pg: &ProcessGroup, kind: &Kind, s: &CudaStorage, l: &Layout) -> Result<Out> {
    crate::with_elem_type!(s.dtype(), T => typed::<T>(pg, kind, s, l), d => Err(unsupported_dtype(d).into()))
}

fn words(dims: &[usize]) -> Vec<u64> {
    dims.iter().map(|d| *d as u64).collect()
}

fn shape_of(rows: usize, rest: &[usize]) -> Shape {
    let mut d = vec![rows];
    d.extend_from_slice(rest);
    Shape::from(d)
}

fn typed<T>(pg: &ProcessGroup, kind: &Kind, s: &CudaStorage, l: &Layout) -> Result<Out>
where
    T: Elem + NcclType + CudaDType + DeviceRepr + ValidAsZeroBits,
{
    let (start, end) =
        l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("collective input is not contiguous".into()))?;
    let dev = s.device.clone();
    let all = s.as_cuda_slice::<T>()?;
    let src = all.slice(start..end);
    let dims = l.dims();
    let n = end - start;
    let dtype = T::DTYPE;
    let wrap = |out: CudaSlice<T>, shape: Shape, sizes: Option<Vec<usize>>| -> Out {
        (T::wrap_cuda_slice(out, dev.clone()), shape, sizes)
    };
    let stream = dev.cuda_stream();
    let alloc =
        |len: usize| -> DistResult<CudaSlice<T>> { cuda(stream.alloc_zeros::<T>(len), "allocating a collective's output") };
    let w = pg.world_size();
    match kind {
        Kind::AllReduce(op) => {
            let mut out = alloc(n)?;
            let what = || format!("all_reduce({op:?}) of {dtype:?} {dims:?} on CUDA");
            pg.call_checked::<T, _>(OpCode::AllReduce, Some(*op), &words(dims), what, |mut p| {
                let (names, mesh) = (p.names(), p.mesh);
                let gc = comm_for(&mut p, &dev)?;
                let (sp, _rs) = src.device_ptr(&stream);
                let (op_, _ro) = out.device_ptr_mut(&stream);
                // SAFETY: both buffers hold `n` elements of T on the communicator's device.
                gc.run(names, mesh, |c, st| {
                    unsafe { result::all_reduce(sp as _, op_ as _, n, T::as_nccl_type(), nccl_op(*op), c, st) }.map(|_| ())
                })
            })?;
            Ok(wrap(out, l.shape().clone(), None))
        }
        Kind::Broadcast(root) | Kind::Reduce(_, root) => {
            pg.check_rank("root", *root)?;
            let mut out = alloc(n)?;
            cuda(stream.memcpy_dtod(&src, &mut out), "copying a collective's input")?;
            let (code, redop) = match kind {
                Kind::Reduce(op, _) => (OpCode::Reduce, Some(*op)),
                _ => (OpCode::Broadcast, None),
            };
            let mut meta = words(dims);
            meta.push(*root as u64);
            let what = || format!("{kind:?} of {dtype:?} {dims:?} on CUDA");
            pg.call_checked::<T, _>(code, redop, &meta, what, |mut p| {
                let (names, mesh) = (p.names(), p.mesh);
                let gc = comm_for(&mut p, &dev)?;
                let (sp, _rs) = src.device_ptr(&stream);
                let (op_, _ro) = out.device_ptr_mut(&stream);
                let r = *root as i32;
                // SAFETY: both buffers hold `n` elements of T; on non-roots a reduce leaves
                // `out` (a copy of the input) alone.
                gc.run(names, mesh, |c, st| match redop {
                    Some(op) => {
                        unsafe { result::reduce(sp as _, op_ as _, n, T::as_nccl_type(), nccl_op(op), r, c, st) }.map(|_| ())
                    }
                    None => unsafe { result::broadcast(sp as _, op_ as _, n, T::as_nccl_type(), r, c, st) }.map(|_| ()),
                })
            })?;
            Ok(wrap(out, l.shape().clone(), None))
        }
        Kind::AllGather => {
            let (rows, rest) = split(dims, "all_gather")?;
            let row: usize = rest.iter().product();
            // Every rank's row count, over TCP (a checked call of its own).
            let sizes: Vec<usize> = pg.all_gather_slice(&[rows as i64])?.into_iter().map(|r| r as usize).collect();
            let max = sizes.iter().copied().max().unwrap_or(0);
            let total: usize = sizes.iter().sum();
            let mut out = alloc(total * row)?;
            let even = sizes.iter().all(|s| *s == max);
            // Uneven: every rank sends `max` rows (its own, then zeros) into a padded buffer.
            let mut padded_in = if even { None } else { Some(alloc(max * row)?) };
            if let Some(p) = padded_in.as_mut() {
                cuda(stream.memcpy_dtod(&src, &mut p.slice_mut(0..n)), "padding an all_gather input")?;
            }
            let mut padded_out = if even { None } else { Some(alloc(w * max * row)?) };
            let what = || format!("all_gather of {dtype:?} rows {sizes:?} x {rest:?} on CUDA");
            pg.call_checked::<T, _>(OpCode::AllGather, None, &words(&rest), what, |mut p| {
                let (names, mesh) = (p.names(), p.mesh);
                let gc = comm_for(&mut p, &dev)?;
                let (sp, _rs) = match &padded_in {
                    Some(b) => b.device_ptr(&stream),
                    None => src.device_ptr(&stream),
                };
                let (op_, _ro) = match padded_out.as_mut() {
                    Some(b) => b.device_ptr_mut(&stream),
                    None => out.device_ptr_mut(&stream),
                };
                let count = max * row;
                // SAFETY: the input holds `count` elements, the output W x `count`.
                gc.run(names, mesh, |c, st| {
                    unsafe { result::all_gather(sp as _, op_ as _, count, T::as_nccl_type(), c, st) }.map(|_| ())
                })
            })?;
            if let Some(g) = padded_out {
                let mut at = 0;
                for (j, s) in sizes.iter().enumerate() {
                    let piece = g.slice(j * max * row..(j * max + s) * row);
                    cuda(stream.memcpy_dtod(&piece, &mut out.slice_mut(at..at + s * row)), "compacting an all_gather")?;
                    at += s * row;
                }
            }
            Ok(wrap(out, shape_of(total, &rest), Some(sizes)))
        }
        Kind::ReduceScatter(op, blocks) => {
            let (rows, rest) = split(dims, "reduce_scatter")?;
            if blocks.len() != w || blocks.iter().sum::<usize>() != rows {
                return Err(DistError::Invalid(format!(
                    "reduce_scatter on {}: dim-0 sizes {blocks:?} must have {w} entries summing to {rows}",
                    pg.name()
                ))
                .into());
            }
            let row: usize = rest.iter().product();
            let me = blocks[pg.rank()] * row;
            let mut out = alloc(me)?;
            let even = blocks.iter().all(|b| *b == blocks[0]);
            let mut full = if even { None } else { Some(alloc(n)?) };
            let mut meta = words(dims);
            meta.extend(blocks.iter().map(|b| *b as u64));
            let what = || format!("reduce_scatter({op:?}) of {dtype:?} {dims:?} into {blocks:?} on CUDA");
            pg.call_checked::<T, _>(OpCode::ReduceScatter, Some(*op), &meta, what, |mut p| {
                let (names, mesh) = (p.names(), p.mesh);
                let gc = comm_for(&mut p, &dev)?;
                let (sp, _rs) = src.device_ptr(&stream);
                let nop = nccl_op(*op);
                match full.as_mut() {
                    // SAFETY: the input holds W x `me` elements, the output `me`.
                    None => {
                        let (op_, _ro) = out.device_ptr_mut(&stream);
                        gc.run(names, mesh, |c, st| {
                            unsafe { result::reduce_scatter(sp as _, op_ as _, me, T::as_nccl_type(), nop, c, st) }.map(|_| ())
                        })
                    }
                    // SAFETY: both buffers hold `n` elements.
                    Some(f) => {
                        let (fp, _rf) = f.device_ptr_mut(&stream);
                        gc.run(names, mesh, |c, st| {
                            unsafe { result::all_reduce(sp as _, fp as _, n, T::as_nccl_type(), nop, c, st) }.map(|_| ())
                        })
                    }
                }
            })?;
            if let Some(f) = full {
                let at: usize = blocks[..pg.rank()].iter().sum::<usize>() * row;
                cuda(stream.memcpy_dtod(&f.slice(at..at + me), &mut out), "keeping this rank's reduce_scatter block")?;
            }
            Ok(wrap(out, shape_of(blocks[pg.rank()], &rest), None))
        }
        Kind::Permute(dst_of) => {
            // Through NCCL a permutation is an all_to_all whose only non-empty block goes to
            // `dst_of[rank]`: the row counts are exchanged over TCP, and NCCL moves the data
            // between the two peers only (empty blocks post no send or receive).
            pg.check_permutation(dst_of)?;
            let (rows, _) = split(dims, "permute")?;
            let mut send = vec![0; w];
            send[dst_of[pg.rank()]] = rows;
            let (out, shape, _) = typed::<T>(pg, &Kind::AllToAll(send), s, l)?;
            Ok((out, shape, None))
        }
        Kind::AllToAll(send_rows) => {
            let (rows, rest) = split(dims, "all_to_all")?;
            if send_rows.len() != w || send_rows.iter().sum::<usize>() != rows {
                return Err(DistError::Invalid(format!(
                    "all_to_all on {}: split sizes {send_rows:?} must have {w} entries summing to dim 0 = {rows}",
                    pg.name()
                ))
                .into());
            }
            let row: usize = rest.iter().product();
            let counts: Vec<i64> = send_rows.iter().map(|r| *r as i64).collect();
            let (got, _) = pg.all_to_all_v_slice(&counts, &vec![1; w], &words(&rest))?;
            let recv_rows: Vec<usize> = got.into_iter().map(|r| r as usize).collect();
            let total: usize = recv_rows.iter().sum();
            let mut out = alloc(total * row)?;
            let offsets =
                |rows: &[usize]| -> Vec<usize> { rows.iter().scan(0, |a, r| Some(std::mem::replace(a, *a + r * row))).collect() };
            let (soff, roff) = (offsets(send_rows), offsets(&recv_rows));
            let me = pg.rank();
            // This rank's own block is a device copy.
            let own = src.slice(soff[me]..soff[me] + send_rows[me] * row);
            cuda(
                stream.memcpy_dtod(&own, &mut out.slice_mut(roff[me]..roff[me] + recv_rows[me] * row)),
                "all_to_all's own block",
            )?;
            let what = || format!("all_to_all of {dtype:?} rows {send_rows:?} x {rest:?} on CUDA");
            pg.call_checked::<T, _>(OpCode::AllToAll, None, &words(&rest), what, |mut p| {
                let (names, mesh) = (p.names(), p.mesh);
                let gc = comm_for(&mut p, &dev)?;
                let (sp, _rs) = src.device_ptr(&stream);
                let (op_, _ro) = out.device_ptr_mut(&stream);
                let elem = std::mem::size_of::<T>() as u64;
                gc.run(names, mesh, |c, st| {
                    result::group_start()?;
                    let launched = (0..w).filter(|j| *j != me).try_for_each(|j| {
                        let (sn, rn) = (send_rows[j] * row, recv_rows[j] * row);
                        // SAFETY: the pointers address blocks inside the input and output,
                        // whose lengths the row counts (exchanged over TCP) bound.
                        unsafe {
                            if sn > 0 {
                                result::send((sp + soff[j] as u64 * elem) as _, sn, T::as_nccl_type(), j as i32, c, st)?;
                            }
                            if rn > 0 {
                                result::recv((op_ + roff[j] as u64 * elem) as _, rn, T::as_nccl_type(), j as i32, c, st)?;
                            }
                        }
                        Ok(())
                    });
                    // The group is closed even when a send or receive failed to enqueue.
                    let ended = result::group_end();
                    launched.and(ended.map(|_| ()))
                })
            })?;
            Ok(wrap(out, shape_of(total, &rest), Some(recv_rows)))
        }
    }
}

fn split(dims: &[usize], what: &str) -> DistResult<(usize, Vec<usize>)> {
    match dims.split_first() {
        Some((d0, rest)) => Ok((*d0, rest.to_vec())),
        None => Err(DistError::Invalid(format!("{what} needs a tensor with at least one dimension, got a scalar"))),
    }
}
