//! One collective of a tensor's values, described by a [`Kind`] and run by the CPU backend
//! on host memory: the forward of every differentiable op on the CPU, and the `host` path of
//! collectives of CUDA tensors, which copies the tensor into a host buffer, runs
//! [`run_staged`] on it and copies the result back (`group/cuda/host.rs`). Both run the same calls
//! on the same values, so a CUDA tensor staged through the host gets the bits a CPU tensor
//! gets.

// The staged half and `Reduce` serve CUDA tensors (feature `cuda`); tested in every build.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use super::ProcessGroup;
use crate::error::{DistError, DistResult};
use crate::reduce::{Elem, ReduceOp};

/// Which collective a call runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Element-wise reduction, result on every rank.
    AllReduce(ReduceOp),
    /// Concatenation along dim 0 (sizes may differ).
    AllGather,
    /// Reduction, then rank r keeps `rows[r]` rows of dim 0.
    ReduceScatter(ReduceOp, Vec<usize>),
    /// Rank `root`'s tensor everywhere.
    Broadcast(usize),
    /// Reduction to `root`; the others keep their input.
    Reduce(ReduceOp, usize),
    /// `rows[j]` rows of dim 0 to rank j.
    AllToAll(Vec<usize>),
    /// The whole tensor to rank `dst_of[rank]` (a permutation of the ranks); the result is
    /// the tensor of the rank that sends here.
    Permute(Vec<usize>),
}

impl Kind {
    /// Whether the result has the input's shape and can overwrite it.
    pub(crate) fn in_place(&self) -> bool {
        matches!(self, Kind::AllReduce(_) | Kind::Broadcast(_) | Kind::Reduce(..))
    }
}

/// A collective's result on the host: the values, their dims and, for all_gather and
/// all_to_all, the rows each rank contributed.
pub(crate) struct HostOut<T> {
    pub data: Vec<T>,
    pub dims: Vec<usize>,
    pub sizes: Option<Vec<usize>>,
}

/// Runs an in-place kind (all_reduce, broadcast, reduce) on `buf`, which holds this rank's
/// input and receives the result.
pub(crate) fn run_in_place<T: Elem>(pg: &ProcessGroup, kind: &Kind, buf: &mut [T]) -> DistResult<()> {
    match kind {
        Kind::AllReduce(op) => pg.all_reduce_slice(buf, *op),
        Kind::Broadcast(root) => pg.broadcast_slice(buf, *root),
        Kind::Reduce(op, root) => pg.reduce_slice(buf, *root, *op),
        k => Err(DistError::Invalid(format!("{k:?} does not run in place"))),
    }
}

/// Runs `kind` on this rank's input `v` of shape `dims` (at least one dimension for the
/// kinds that split dim 0) and returns the result.
pub(crate) fn run<T: Elem>(pg: &ProcessGroup, kind: &Kind, v: &[T], dims: &[usize]) -> DistResult<HostOut<T>> {
    if kind.in_place() {
        let mut data = v.to_vec();
        run_in_place(pg, kind, &mut data)?;
        return Ok(HostOut { data, dims: dims.to_vec(), sizes: None });
    }
    let Some((&rows, rest)) = dims.split_first() else {
        return Err(DistError::Invalid(format!("{kind:?} needs a tensor with at least one dimension, got a scalar")));
    };
    let row: usize = rest.iter().product();
    let with_rows = |rows: usize| -> Vec<usize> { std::iter::once(rows).chain(rest.iter().copied()).collect() };
    match kind {
        Kind::AllGather => {
            let (data, sizes) = pg.all_gather_rows(v, rows, rest)?;
            Ok(HostOut { data, dims: with_rows(sizes.iter().sum()), sizes: Some(sizes) })
        }
        Kind::ReduceScatter(op, blocks) => {
            let counts: Vec<usize> = blocks.iter().map(|b| b * row).collect();
            let data = pg.reduce_scatter_slice(v, *op, &counts)?;
            Ok(HostOut { data, dims: with_rows(blocks[pg.rank()]), sizes: None })
        }
        Kind::AllToAll(send) => {
            let (data, recv) = pg.all_to_all_rows(v, send, rest)?;
            Ok(HostOut { data, dims: with_rows(recv.iter().sum()), sizes: Some(recv) })
        }
        Kind::Permute(dst_of) => {
            let (data, got) = pg.permute_rows(v, rows, dst_of, rest)?;
            Ok(HostOut { data, dims: with_rows(got), sizes: None })
        }
        Kind::AllReduce(_) | Kind::Broadcast(_) | Kind::Reduce(..) => unreachable!("in-place kinds return above"),
    }
}

/// The host half of a staged collective: `buf` holds this rank's input (of shape `dims`),
/// copied from wherever the tensor lives; `upload` makes the output from host values and
/// their dims. In-place kinds run on `buf` and upload it; the others upload the CPU
/// backend's result. Returns the output and, for all_gather and all_to_all, the rows per rank.
pub(crate) fn run_staged<T: Elem, R>(
    pg: &ProcessGroup,
    kind: &Kind,
    buf: &mut [T],
    dims: &[usize],
    upload: impl FnOnce(&[T], &[usize]) -> candle_core::Result<R>,
) -> candle_core::Result<(R, Option<Vec<usize>>)> {
    if kind.in_place() {
        run_in_place(pg, kind, buf)?;
        return Ok((upload(buf, dims)?, None));
    }
    let out = run(pg, kind, buf, dims)?;
    Ok((upload(&out.data, &out.dims)?, out.sizes))
}

/// Stages a CPU tensor through [`run_staged`] as a device tensor is staged, with copies for
/// the transfers: what the `host` path does to a CUDA tensor, minus the device. For tests.
#[cfg(test)]
pub(crate) fn stage_cpu_tensor(
    pg: &ProcessGroup,
    x: &candle_core::Tensor,
    kind: &Kind,
) -> candle_core::Result<(candle_core::Tensor, Option<Vec<usize>>)> {
    crate::with_elem_type!(x.dtype(), T => {
        let mut buf = x.flatten_all()?.to_vec1::<T>()?;
        run_staged(pg, kind, &mut buf, x.dims(), |v, dims| candle_core::Tensor::from_slice(v, dims, x.device()))
    }, d => Err(crate::dispatch::unsupported_dtype(d).into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::threads::run_threads;
    use candle_core::{Device, Tensor};

    /// Rank r's input: `rows` x 3 dyadic values (sums of them are exact, so every reduction
    /// order gives the same bits), different on every rank and position.
    fn input(rank: usize, rows: usize) -> Vec<f64> {
        (0..rows * 3).map(|i| (i as f64 * 0.25 - 3.0) * (rank as f64 + 1.0) + 0.5 * rank as f64).collect()
    }

    /// Rows rank r holds for a kind at world size w (uneven where the kind allows it).
    fn rows(kind: &str, r: usize, w: usize) -> usize {
        match kind {
            "all_gather" => 1 + r,
            "reduce_scatter" => (0..w).map(|j| j + 1).sum(),
            "all_to_all" => (0..w).map(|j| (r + j) % 2 + 1).sum(),
            "permute" => 1 + r % 2,
            _ => 2,
        }
    }

    fn kind_of(kind: &str, r: usize, w: usize) -> Kind {
        match kind {
            "all_reduce" => Kind::AllReduce(ReduceOp::Sum),
            "all_reduce_max" => Kind::AllReduce(ReduceOp::Max),
            "broadcast" => Kind::Broadcast(w - 1),
            "reduce" => Kind::Reduce(ReduceOp::Sum, w / 2),
            "all_gather" => Kind::AllGather,
            "reduce_scatter" => Kind::ReduceScatter(ReduceOp::Sum, (0..w).map(|j| j + 1).collect()),
            "all_to_all" => Kind::AllToAll((0..w).map(|j| (r + j) % 2 + 1).collect()),
            "permute" => Kind::Permute((0..w).map(|j| (j + 1) % w).collect()),
            _ => unreachable!(),
        }
    }

    /// Rank r's expected output, computed here from every rank's input.
    fn reference(kind: &str, r: usize, w: usize) -> Vec<f64> {
        let x: Vec<Vec<f64>> = (0..w).map(|j| input(j, rows(kind, j, w))).collect();
        let fold = |f: fn(f64, f64) -> f64| -> Vec<f64> {
            (0..x[0].len()).map(|i| x.iter().skip(1).fold(x[0][i], |a, xj| f(a, xj[i]))).collect()
        };
        match kind {
            "all_reduce" => fold(|a, b| a + b),
            "all_reduce_max" => fold(f64::max),
            "broadcast" => x[w - 1].clone(),
            "reduce" if r == w / 2 => fold(|a, b| a + b),
            "reduce" => x[r].clone(),
            "all_gather" => x.concat(),
            "reduce_scatter" => {
                let start: usize = (0..r).map(|j| j + 1).sum::<usize>() * 3;
                fold(|a, b| a + b)[start..start + (r + 1) * 3].to_vec()
            }
            "all_to_all" => (0..w)
                .flat_map(|j| {
                    // Rank j sends (j + k) % 2 + 1 rows to rank k, in order of k.
                    let start: usize = (0..r).map(|k| (j + k) % 2 + 1).sum::<usize>() * 3;
                    x[j][start..start + ((j + r) % 2 + 1) * 3].to_vec()
                })
                .collect(),
            // A ring shift by one: rank r holds rank r - 1's rows.
            "permute" => x[(r + w - 1) % w].clone(),
            _ => unreachable!(),
        }
    }

    /// The same collective through the tensor methods of the CPU backend.
    fn plain(pg: &ProcessGroup, kind: &Kind, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(match kind {
            Kind::AllReduce(op) => pg.all_reduce(x, *op)?,
            Kind::Broadcast(root) => pg.broadcast(x, *root)?,
            Kind::Reduce(op, root) => pg.reduce(x, *root, *op)?,
            Kind::AllGather => pg.all_gather(x)?,
            Kind::ReduceScatter(op, blocks) => pg.reduce_scatter_sizes(x, *op, blocks)?,
            Kind::AllToAll(send) => pg.all_to_all_sizes(x, send)?.0,
            Kind::Permute(dst_of) => pg.permute(x, dst_of)?,
        })
    }

    #[test]
    fn staging_a_cpu_tensor_gives_the_bits_of_the_cpu_backend_and_of_a_serial_reference() {
        let kinds =
            ["all_reduce", "all_reduce_max", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "permute"];
        for w in 1..=4 {
            for kind in kinds {
                let outs = run_threads(w, |pg| {
                    let r = pg.rank();
                    let x = Tensor::from_vec(input(r, rows(kind, r, w)), (rows(kind, r, w), 3), &Device::Cpu)?;
                    let k = kind_of(kind, r, w);
                    let (staged, sizes) = stage_cpu_tensor(&pg, &x, &k)?;
                    let direct = plain(&pg, &k, &x)?;
                    // The f32 copy of the same values takes the f32 instantiation.
                    let (staged32, _) = stage_cpu_tensor(&pg, &x.to_dtype(candle_core::DType::F32)?, &k)?;
                    let flat = |t: &Tensor| t.flatten_all()?.to_dtype(candle_core::DType::F64)?.to_vec1::<f64>();
                    Ok((staged.dims().to_vec(), direct.dims().to_vec(), flat(&staged)?, flat(&direct)?, flat(&staged32)?, sizes))
                })
                .unwrap();
                for (r, (sdims, ddims, staged, direct, staged32, sizes)) in outs.into_iter().enumerate() {
                    let want = reference(kind, r, w);
                    assert_eq!(sdims, ddims, "{kind} W={w} rank {r}: dims");
                    assert_eq!(sdims.iter().product::<usize>(), want.len(), "{kind} W={w} rank {r}: {sdims:?}");
                    assert_eq!(staged, want, "{kind} W={w} rank {r}: staged vs the serial reference");
                    assert_eq!(direct, want, "{kind} W={w} rank {r}: the tensor method vs the serial reference");
                    // Every value is a small dyadic number, exact in f32 too.
                    assert_eq!(staged32, want, "{kind} W={w} rank {r}: staged f32");
                    match kind {
                        "all_gather" => assert_eq!(sizes, Some((0..w).map(|j| 1 + j).collect())),
                        "all_to_all" => assert_eq!(sizes, Some((0..w).map(|j| (j + r) % 2 + 1).collect())),
                        _ => assert_eq!(sizes, None, "{kind}"),
                    }
                }
            }
        }
    }

    #[test]
    fn in_place_kinds_run_on_the_staging_buffer_and_upload_it() {
        // The buffer is the pinned one on the host path: in-place kinds must leave the result
        // there (and upload from it), out-of-place ones must leave it alone.
        let out = run_threads(2, |pg| {
            let mut buf = input(pg.rank(), 2);
            let before = buf.clone();
            let (up, _) = run_staged(&pg, &Kind::AllReduce(ReduceOp::Sum), &mut buf, &[2, 3], |v, _| Ok(v.as_ptr() as usize))?;
            let in_place = (up == buf.as_ptr() as usize, buf != before);
            let mut buf2 = input(pg.rank(), 2);
            let (up2, _) = run_staged(&pg, &Kind::AllGather, &mut buf2, &[2, 3], |v, dims| Ok((v.len(), dims.to_vec())))?;
            Ok((in_place, up2, buf2 == input(pg.rank(), 2)))
        })
        .unwrap();
        for (in_place, gathered, untouched) in out {
            assert_eq!(in_place, (true, true));
            assert_eq!(gathered, (12, vec![4, 3]));
            assert!(untouched);
        }
    }

    #[test]
    fn a_bad_split_is_an_error_not_a_panic() {
        let e = run_threads(2, |pg| {
            let mut buf = input(pg.rank(), 2);
            Ok(run_staged(&pg, &Kind::ReduceScatter(ReduceOp::Sum, vec![2]), &mut buf, &[2, 3], |_, _| Ok(()))
                .unwrap_err()
                .to_string())
        })
        .unwrap();
        assert!(e[0].contains("reduce_scatter") && e[0].contains("[6]"), "{}", e[0]);
        let e = run_threads(1, |pg| {
            let mut buf = [1.0f64];
            Ok(run_staged(&pg, &Kind::AllGather, &mut buf, &[], |_, _| Ok(())).unwrap_err().to_string())
        })
        .unwrap();
        assert!(e[0].contains("at least one dimension"), "{}", e[0]);
    }
}
