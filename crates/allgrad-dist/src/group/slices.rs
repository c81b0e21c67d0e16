//! The plain collectives on slices of any [`Elem`] type, and point-to-point messages.

use candle_core::DType;

use super::ProcessGroup;
use crate::cpu::mesh::{Mesh, OpCode, RecvOp, SendOp};
use crate::error::{DistError, DistResult};
use crate::reduce::{dtype_code, Elem, ReduceOp};
use crate::wire;

impl ProcessGroup {
    /// All-reduces `buf` in place: afterwards every rank holds the same, bitwise-identical result.
    pub fn all_reduce_slice<T: Elem>(&self, buf: &mut [T], op: ReduceOp) -> DistResult<()> {
        let n = buf.len();
        let meta = [n as u64];
        self.call(
            OpCode::AllReduce,
            Some(op),
            &meta,
            || format!("all_reduce({op:?}) of {n} x {:?}", T::DTYPE),
            |m, c| m.all_reduce(c, op, buf),
        )
    }

    /// Gathers every rank's `own` (equal lengths on every rank) in rank order.
    pub fn all_gather_slice<T: Elem>(&self, own: &[T]) -> DistResult<Vec<T>> {
        let mut out = vec![T::zeroed(); own.len() * self.world_size()];
        self.all_gather_into(own, &mut out)?;
        Ok(out)
    }

    /// Gathers every rank's `own` (equal lengths on every rank) into `out` (W times as long),
    /// in rank order, without allocating.
    pub fn all_gather_into<T: Elem>(&self, own: &[T], out: &mut [T]) -> DistResult<()> {
        let n = own.len();
        let w = self.world_size();
        if out.len() != n * w {
            return Err(DistError::Invalid(format!("all_gather_into: output holds {} elements, needs {n} x {w}", out.len())));
        }
        let counts = vec![n; w];
        self.call(
            OpCode::AllGather,
            None,
            &[n as u64],
            || format!("all_gather of {n} x {:?}", T::DTYPE),
            |m, c| m.all_gather_v(c, own, &counts, 0, out),
        )
    }

    /// Gathers every rank's `own` in rank order when lengths may differ; `unit` is a number of
    /// elements every length is a multiple of (the row length of a tensor), checked across
    /// ranks with `meta`. Returns the data and each rank's length.
    pub fn all_gather_v_slice<T: Elem>(&self, own: &[T], meta: &[u64]) -> DistResult<(Vec<T>, Vec<usize>)> {
        let w = self.world_size();
        let max = self.inner.ctx.max_message_bytes;
        self.call(OpCode::AllGather, None, meta, || format!("all_gather of {} x {:?} (sizes may differ)", own.len(), T::DTYPE), |m, c| {
            let counts = if w == 1 {
                vec![own.len() as u64]
            } else if m.uses_tree() {
                let mut counts = vec![0u64; w];
                counts[m.rank] = own.len() as u64;
                let mut words = bytemuck::cast_slice::<u64, i64>(&counts).to_vec();
                m.tree_all_gather_v(c, &vec![1; w], 0, &mut words)?;
                bytemuck::cast_slice::<i64, u64>(&words).to_vec()
            } else {
                m.exchange_counts(c, 0, &vec![own.len() as u64; w])?
            };
            let esz = T::DTYPE.size_in_bytes() as u64;
            let total = counts.iter().try_fold(0u64, |a, b| a.checked_add(*b)).and_then(|t| t.checked_mul(esz));
            if !matches!(total, Some(t) if t <= max) {
                return Err(m.fail(DistError::Protocol {
                    peer: usize::MAX,
                    group: m.group.clone(),
                    detail: format!(
                        "all_gather would receive {counts:?} elements of {esz} bytes, over the limit of {max} bytes (ALLGRAD_MAX_MESSAGE_BYTES)"
                    ),
                }));
            }
            let counts: Vec<usize> = counts.into_iter().map(|c| c as usize).collect();
            let mut out = vec![T::zeroed(); counts.iter().sum()];
            m.all_gather_v(c, own, &counts, 1, &mut out)?;
            Ok((out, counts))
        })
    }

    /// Reduces `input` across ranks and returns this rank's block; `counts[j]` elements go to
    /// rank j (they must sum to `input.len()` and agree across ranks).
    pub fn reduce_scatter_slice<T: Elem>(&self, input: &[T], op: ReduceOp, counts: &[usize]) -> DistResult<Vec<T>> {
        self.check_counts("reduce_scatter", input.len(), counts)?;
        let mut out = vec![T::zeroed(); counts[self.rank()]];
        self.reduce_scatter_into(input, op, counts, &mut out)?;
        Ok(out)
    }

    /// As [`ProcessGroup::reduce_scatter_slice`], writing this rank's block into `out`
    /// (`counts[rank]` long) without allocating.
    pub fn reduce_scatter_into<T: Elem>(&self, input: &[T], op: ReduceOp, counts: &[usize], out: &mut [T]) -> DistResult<()> {
        self.check_counts("reduce_scatter", input.len(), counts)?;
        if out.len() != counts[self.rank()] {
            return Err(DistError::Invalid(format!(
                "reduce_scatter_into: output holds {} elements, this rank's block has {}",
                out.len(),
                counts[self.rank()]
            )));
        }
        let meta: Vec<u64> = counts.iter().map(|c| *c as u64).collect();
        let what = || format!("reduce_scatter({op:?}) of {} x {:?} into {counts:?}", input.len(), T::DTYPE);
        self.call(OpCode::ReduceScatter, Some(op), &meta, what, |m, c| m.reduce_scatter_v(c, op, input, counts, out))
    }

    /// Copies rank `root`'s `buf` to every rank.
    pub fn broadcast_slice<T: Elem>(&self, buf: &mut [T], root: usize) -> DistResult<()> {
        self.check_rank("broadcast root", root)?;
        let n = buf.len();
        let meta = [n as u64, root as u64];
        self.call(
            OpCode::Broadcast,
            None,
            &meta,
            || format!("broadcast from rank {root} of {n} x {:?}", T::DTYPE),
            |m, c| m.broadcast(c, buf, root),
        )
    }

    /// Reduces every rank's `buf` into rank `root`'s; other ranks' buffers are unchanged.
    pub fn reduce_slice<T: Elem>(&self, buf: &mut [T], root: usize, op: ReduceOp) -> DistResult<()> {
        self.check_rank("reduce root", root)?;
        let n = buf.len();
        let meta = [n as u64, root as u64];
        self.call(
            OpCode::Reduce,
            Some(op),
            &meta,
            || format!("reduce({op:?}) to rank {root} of {n} x {:?}", T::DTYPE),
            |m, c| m.reduce(c, op, buf, root),
        )
    }

    /// Sends `send_counts[j]` elements of `input` (consecutive blocks) to rank j; returns what
    /// every rank sent here, in rank order, and the block sizes.
    pub fn all_to_all_v_slice<T: Elem>(
        &self,
        input: &[T],
        send_counts: &[usize],
        meta: &[u64],
    ) -> DistResult<(Vec<T>, Vec<usize>)> {
        self.check_counts("all_to_all", input.len(), send_counts)?;
        let max = self.inner.ctx.max_message_bytes;
        self.call(
            OpCode::AllToAll,
            None,
            meta,
            || format!("all_to_all of {} x {:?} split {send_counts:?}", input.len(), T::DTYPE),
            |m, c| m.all_to_all_v(c, input, send_counts, max),
        )
    }

    /// Sends `data` to rank `dst_of[rank]` and returns what the rank whose entry names this
    /// one sent here; `dst_of` is a permutation of the group's ranks, the same on every rank
    /// (checked against the peers through `meta`, with the permutation itself). Data move
    /// between those two peers only; lengths may differ from rank to rank, each a multiple of
    /// `unit` elements (0: any length).
    pub fn permute_slice<T: Elem>(&self, data: &[T], dst_of: &[usize], unit: usize, meta: &[u64]) -> DistResult<Vec<T>> {
        let src = self.check_permutation(dst_of)?;
        let dst = dst_of[self.rank()];
        let max = self.inner.ctx.max_message_bytes;
        let mut words = meta.to_vec();
        words.extend(dst_of.iter().map(|d| *d as u64));
        self.call(
            OpCode::Permute,
            None,
            &words,
            || format!("permute of {} x {:?} to rank {dst}, from rank {src} (ranks to {dst_of:?})", data.len(), T::DTYPE),
            |m, c| m.permute(c, data, dst, src, unit, max),
        )
    }

    /// Checks that `dst_of` sends every rank of the group to a distinct rank; returns the rank
    /// that sends here.
    pub(crate) fn check_permutation(&self, dst_of: &[usize]) -> DistResult<usize> {
        let w = self.world_size();
        let mut src = vec![usize::MAX; w];
        for (from, &to) in dst_of.iter().enumerate() {
            if to >= w || src[to] != usize::MAX {
                break;
            }
            src[to] = from;
        }
        if dst_of.len() != w || src.contains(&usize::MAX) {
            return Err(DistError::Invalid(format!(
                "permute on {}: destinations {dst_of:?} must name each of the {w} ranks of the group exactly once",
                self.name()
            )));
        }
        Ok(src[self.rank()])
    }

    /// Waits until every rank of the group has reached the barrier.
    pub fn barrier(&self) -> DistResult<()> {
        self.call(OpCode::Barrier, None, &[], || "barrier".to_string(), |m, c| m.barrier(c))
    }

    /// Sends `data` to rank `dst`, which must call [`ProcessGroup::recv_slice`] with a buffer of
    /// the same length and type. Messages between two ranks arrive in order.
    pub fn send_slice<T: Elem>(&self, data: &[T], dst: usize) -> DistResult<()> {
        self.p2p(
            dst,
            |m, h| {
                let mut sends = [SendOp {
                    peer: dst,
                    header: h(data.len() * T::DTYPE.size_in_bytes(), T::DTYPE),
                    data: bytemuck::cast_slice(data),
                }];
                m.exchange(&mut sends, &mut [], &format!("send of {} x {:?} to rank {dst}", data.len(), T::DTYPE))
            },
            true,
        )
    }

    /// Receives into `buf` what rank `src` sent with [`ProcessGroup::send_slice`].
    pub fn recv_slice<T: Elem>(&self, buf: &mut [T], src: usize) -> DistResult<()> {
        self.p2p(
            src,
            |m, h| {
                let what = format!("recv of {} x {:?} from rank {src}", buf.len(), T::DTYPE);
                let expect = h(buf.len() * T::DTYPE.size_in_bytes(), T::DTYPE);
                let mut recvs = [RecvOp { peer: src, expect, data: bytemuck::cast_slice_mut(buf), acc: None }];
                m.exchange(&mut [], &mut recvs, &what)
            },
            false,
        )
    }

    fn p2p(
        &self,
        peer: usize,
        f: impl FnOnce(&mut Mesh, &dyn Fn(usize, DType) -> wire::Header) -> DistResult<()>,
        sending: bool,
    ) -> DistResult<()> {
        self.check_rank(if sending { "send destination" } else { "recv source" }, peer)?;
        if peer == self.rank() {
            return Err(DistError::Invalid(format!("rank {peer} cannot send to or receive from itself")));
        }
        let mut st = self.lock();
        st.mesh.check_usable()?;
        let counter = if sending { &mut st.p2p_sent[peer] } else { &mut st.p2p_recvd[peer] };
        *counter += 1;
        let seq = *counter;
        let header = move |len: usize, dt: DType| wire::Header {
            kind: wire::KIND_DATA,
            op: OpCode::SendRecv as u8,
            dtype: dtype_code(dt),
            redop: 0,
            seq,
            step: 0,
            len: len as u64,
            meta: 0,
        };
        f(&mut st.mesh, &header)
    }
}
