//! [`ProcessGroup`]: a set of ranks that run collectives together.
//!
//! The methods here are the plain (non-differentiable) collectives: on slices of any
//! [`Elem`] type, and on Candle tensors of the dtypes in [`SUPPORTED_DTYPES`]. Tensors on
//! other devices are staged through host memory. For collectives inside a loss, use the
//! differentiable functions of [`crate::ops`] instead.
//!
//! Every rank of a group must issue the same collectives, in the same order, from one thread
//! at a time. A rank that does otherwise gets a [`DistError::Mismatch`] naming both calls.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs, UdpSocket};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Shape, Tensor};

use crate::collectives::Call;
use crate::env::WorldInfo;
use crate::error::{DistError, DistResult};
use crate::mesh::{Mesh, OpCode, RecvOp, SendOp};
use crate::reduce::{dtype_code, Elem, ReduceOp, SUPPORTED_DTYPES};
use crate::shm_ops::ShmConfig;
use crate::store::{StoreClient, StoreServer};
use crate::wire::{self, digest, same_secret, Hello, Service};

/// Largest total a rank agrees to receive in one all_gather or all_to_all whose sizes come
/// from the peers (ALLGRAD_MAX_MESSAGE_BYTES overrides).
pub const DEFAULT_MAX_MESSAGE_BYTES: u64 = 64 << 30;
/// How long an accepted connection may take to present its handshake.
const HANDSHAKE_GRACE: Duration = Duration::from_secs(10);

/// What every group of one process shares: the job's identity and the rendezvous store.
struct Context {
    info: WorldInfo,
    store: Option<StoreClient>,
    bind_ip: IpAddr,
    max_message_bytes: u64,
    shm: ShmConfig,
    // Rank 0 hosts the store for as long as its world group lives. Declared last: dropped last.
    _server: Option<StoreServer>,
}

struct State {
    mesh: Mesh,
    seq: u64,
    p2p_sent: Vec<u64>,
    p2p_recvd: Vec<u64>,
    subgroups: u64,
}

struct Inner {
    name: String,
    rank: usize,
    members: Vec<usize>,
    state: Mutex<State>,
    ctx: Arc<Context>,
}

/// A group of ranks that run collectives together. Cheap to clone (shared handle).
#[derive(Clone)]
pub struct ProcessGroup {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ProcessGroup({}, rank {} of {})", self.inner.name, self.rank(), self.world_size())
    }
}

/// Runs `$body` with `$T` bound to the Rust type of a Candle dtype.
macro_rules! dispatch {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F64 => {
                type $T = f64;
                $body
            }
            DType::F16 => {
                type $T = half::f16;
                $body
            }
            DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            DType::I64 => {
                type $T = i64;
                $body
            }
            DType::U32 => {
                type $T = u32;
                $body
            }
            DType::U8 => {
                type $T = u8;
                $body
            }
            d => Err(DistError::Invalid(format!("collectives support the dtypes {SUPPORTED_DTYPES:?}, not {d:?}")).into()),
        }
    };
}

fn shape_words(dims: &[usize]) -> Vec<u64> {
    dims.iter().map(|d| *d as u64).collect()
}

impl ProcessGroup {
    /// Joins the job described by the launcher environment (see [`WorldInfo::from_env`]);
    /// a world of size 1 when no launcher variables are set.
    pub fn from_env() -> DistResult<ProcessGroup> {
        Self::init(&WorldInfo::from_env()?)
    }

    /// A world of one rank; every collective is a copy.
    pub fn single() -> ProcessGroup {
        Self::init(&WorldInfo::single()).expect("a single-rank group needs no network")
    }

    /// Joins the job: rank 0 hosts the rendezvous store at MASTER_ADDR:MASTER_PORT, every
    /// rank connects to every other, and the call returns once all are connected.
    pub fn init(info: &WorldInfo) -> DistResult<ProcessGroup> {
        // Under torchrun's agent store, rank 0 does not bind MASTER_PORT (crate::elastic).
        if let Some((info, server)) = crate::elastic::rendezvous_via_agent(info)? {
            return Self::join(&info, server, ShmConfig::from_env()?);
        }
        let server = if info.rank == 0 && info.world_size > 1 {
            let ip = resolve(&info.master_addr, info.master_port)?;
            Some(StoreServer::start(ip, &info.token)?)
        } else {
            None
        };
        Self::join(info, server, ShmConfig::from_env()?)
    }

    /// Joins a job whose store is hosted elsewhere (by [`crate::run_threads`], say).
    pub(crate) fn join(info: &WorldInfo, server: Option<StoreServer>, shm: ShmConfig) -> DistResult<ProcessGroup> {
        let members: Vec<usize> = (0..info.world_size).collect();
        if info.world_size == 1 {
            let ctx = Arc::new(Context {
                info: info.clone(),
                store: None,
                bind_ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
                max_message_bytes: max_message_bytes()?,
                shm,
                _server: None,
            });
            let mesh = Mesh::new("world".into(), 0, members.clone(), vec![None], info.timeout);
            return Ok(Self::from_mesh("world".into(), 0, members, mesh, ctx));
        }
        let store_addr = format!("{}:{}", info.master_addr, info.master_port);
        let store = StoreClient::connect(&store_addr, &info.token, info.rank, info.timeout)?;
        let bind_ip = bind_ip_toward(&info.master_addr, info.master_port)?;
        let ctx = Arc::new(Context {
            info: info.clone(),
            store: Some(store),
            bind_ip,
            max_message_bytes: max_message_bytes()?,
            shm,
            _server: server,
        });
        let mesh = connect_mesh(&ctx, "world", info.rank, &members)?;
        let pg = Self::from_mesh("world".into(), info.rank, members, mesh, ctx);
        tracing::debug!("rank {} joined a world of {}", info.rank, info.world_size);
        Ok(pg)
    }

    fn from_mesh(name: String, rank: usize, members: Vec<usize>, mesh: Mesh, ctx: Arc<Context>) -> ProcessGroup {
        let n = members.len();
        let state = State { mesh, seq: 0, p2p_sent: vec![0; n], p2p_recvd: vec![0; n], subgroups: 0 };
        ProcessGroup { inner: Arc::new(Inner { name, rank, members, state: Mutex::new(state), ctx }) }
    }

    /// This rank's index in the group, `0..world_size()`.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }
    /// Number of ranks in the group.
    pub fn world_size(&self) -> usize {
        self.inner.members.len()
    }
    /// The group's name (`world`, `world/1`, ...), as used in error messages.
    pub fn name(&self) -> &str {
        &self.inner.name
    }
    /// Global rank of each member, in group-rank order.
    pub fn members(&self) -> &[usize] {
        &self.inner.members
    }
    /// The job this group belongs to (global rank, local rank, timeout, ...).
    pub fn world_info(&self) -> &WorldInfo {
        &self.inner.ctx.info
    }
    /// The timeout of every blocking call on this group.
    pub fn timeout(&self) -> Duration {
        self.inner.ctx.info.timeout
    }
    /// The first error that broke this group, and whether another rank caused it (`true`)
    /// rather than this one.
    pub fn failure(&self) -> Option<(String, bool)> {
        self.lock().mesh.failure().cloned()
    }
    /// Breaks the group on purpose: every peer's pending and later collectives on it fail
    /// with `reason`, naming this rank. Used when a rank fails outside a collective.
    pub fn abort(&self, reason: &str) {
        let mut st = self.lock();
        if st.mesh.failure().is_none() {
            st.mesh.fail(DistError::Invalid(reason.to_string()));
        }
    }

    /// Whether large collectives of this group (all_reduce, all_gather and reduce_scatter of
    /// 64 KiB and more) move their data through shared memory rather than TCP: true when every
    /// member runs on this host and none set ALLGRAD_SHM=0. Decided when the group is made.
    pub fn shared_memory(&self) -> bool {
        self.lock().mesh.shm.is_some()
    }

    /// The rendezvous store, when the world has more than one rank.
    pub fn store(&self) -> Option<&StoreClient> {
        self.inner.ctx.store.as_ref()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.inner.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` as the next collective call of this group.
    fn call<R>(
        &self,
        op: OpCode,
        redop: Option<ReduceOp>,
        meta: &[u64],
        what: impl FnOnce() -> String,
        f: impl FnOnce(&mut Mesh, &Call) -> DistResult<R>,
    ) -> DistResult<R> {
        let mut st = self.lock();
        st.mesh.check_usable()?;
        st.seq += 1;
        let what = what();
        let call = Call { op, redop, seq: st.seq, meta: digest(meta), what: &what };
        f(&mut st.mesh, &call)
    }

    /// Makes a subgroup of the given ranks of this group (group ranks, in the order given;
    /// they become ranks 0.. of the subgroup). Every rank of this group must call it, in the
    /// same order as its other `new_group` calls; members get `Some(group)`, the others `None`.
    pub fn new_group(&self, ranks: &[usize]) -> DistResult<Option<ProcessGroup>> {
        let n = self.world_size();
        let mut seen = vec![false; n];
        for &r in ranks {
            if r >= n || std::mem::replace(&mut seen[r], true) {
                return Err(DistError::Invalid(format!(
                    "new_group({ranks:?}) on {}: ranks must be distinct and below {n}",
                    self.name()
                )));
            }
        }
        if ranks.is_empty() {
            return Err(DistError::Invalid("new_group needs at least one rank".into()));
        }
        let id = {
            let mut st = self.lock();
            st.subgroups += 1;
            st.subgroups
        };
        let name = format!("{}/{id}", self.name());
        let Some(me) = ranks.iter().position(|r| *r == self.rank()) else { return Ok(None) };
        let members: Vec<usize> = ranks.iter().map(|r| self.inner.members[*r]).collect();
        let ctx = self.inner.ctx.clone();
        let mesh = if members.len() == 1 {
            Mesh::new(name.clone(), 0, members.clone(), vec![None], ctx.info.timeout)
        } else {
            connect_mesh(&ctx, &name, me, &members)?
        };
        Ok(Some(Self::from_mesh(name, me, members, mesh, ctx)))
    }

    // ---------------------------------------------------------------- slices

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
            let counts = if w == 1 { vec![own.len() as u64] } else { m.exchange_counts(c, 0, &vec![own.len() as u64; w])? };
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

    fn check_rank(&self, what: &str, r: usize) -> DistResult<()> {
        if r >= self.world_size() {
            return Err(DistError::Invalid(format!("{what} {r} is not a rank of {} (size {})", self.name(), self.world_size())));
        }
        Ok(())
    }

    fn check_counts(&self, what: &str, len: usize, counts: &[usize]) -> DistResult<()> {
        if counts.len() != self.world_size() || counts.iter().sum::<usize>() != len {
            return Err(DistError::Invalid(format!(
                "{what} on {}: split sizes {counts:?} must have {} entries summing to the input length {len}",
                self.name(),
                self.world_size()
            )));
        }
        Ok(())
    }

    // ---------------------------------------------------------------- tensors

    /// All-reduces a tensor (not differentiable; see [`crate::all_reduce`]).
    pub fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> candle_core::Result<Tensor> {
        dispatch!(x.dtype(), T => {
            let mut v = x.flatten_all()?.to_vec1::<T>()?;
            let meta = shape_words(x.dims());
            let what = || format!("all_reduce({op:?}) of {:?} {:?}", x.dtype(), x.dims());
            self.call(OpCode::AllReduce, Some(op), &meta, what, |m, c| m.all_reduce(c, op, &mut v))?;
            Tensor::from_vec(v, x.shape(), x.device())
        })
    }

    /// Concatenates every rank's tensor along dim 0 (sizes along dim 0 may differ; the other
    /// dims must agree). Returns the result and each rank's dim-0 size.
    pub fn all_gather_with_sizes(&self, x: &Tensor) -> candle_core::Result<(Tensor, Vec<usize>)> {
        let (rows, rest) = split_first_dim(x, "all_gather")?;
        dispatch!(x.dtype(), T => {
            let v = x.flatten_all()?.to_vec1::<T>()?;
            let (out, sizes) = self.all_gather_rows(&v, rows, &rest)?;
            let mut dims = vec![sizes.iter().sum::<usize>()];
            dims.extend_from_slice(&rest);
            Ok((Tensor::from_vec(out, dims, x.device())?, sizes))
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
        dispatch!(x.dtype(), T => {
            let v = x.flatten_all()?.to_vec1::<T>()?;
            let counts: Vec<usize> = sizes.iter().map(|s| s * row).collect();
            let out = self.reduce_scatter_slice(&v, op, &counts)?;
            let mut dims = vec![sizes[self.rank()]];
            dims.extend_from_slice(&rest);
            Tensor::from_vec(out, dims, x.device())
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
    }

    /// Reduces every rank's tensor to rank `root`; other ranks get their input back.
    pub fn reduce(&self, x: &Tensor, root: usize, op: ReduceOp) -> candle_core::Result<Tensor> {
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
    }

    /// Sends `send_sizes[j]` rows of `x` (consecutive along dim 0) to rank j; returns the rows
    /// every rank sent here, concatenated in rank order, and how many came from each.
    pub fn all_to_all_sizes(&self, x: &Tensor, send_sizes: &[usize]) -> candle_core::Result<(Tensor, Vec<usize>)> {
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
        dispatch!(x.dtype(), T => {
            let v = x.flatten_all()?.to_vec1::<T>()?;
            let (out, recv_sizes) = self.all_to_all_rows(&v, send_sizes, &rest)?;
            let mut dims = vec![recv_sizes.iter().sum::<usize>()];
            dims.extend_from_slice(&rest);
            Ok((Tensor::from_vec(out, dims, x.device())?, recv_sizes))
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

    /// Sends a tensor to rank `dst` (which calls [`ProcessGroup::recv`] with the same shape and dtype).
    pub fn send(&self, x: &Tensor, dst: usize) -> candle_core::Result<()> {
        dispatch!(x.dtype(), T => {
            let v = x.flatten_all()?.to_vec1::<T>()?;
            Ok(self.send_slice(&v, dst)?)
        })
    }

    /// Receives a tensor of the given shape and dtype from rank `src`, on `device`.
    pub fn recv(&self, shape: impl Into<Shape>, dtype: DType, device: &Device, src: usize) -> candle_core::Result<Tensor> {
        let shape = shape.into();
        dispatch!(dtype, T => {
            let mut v = vec![<T as bytemuck::Zeroable>::zeroed(); shape.elem_count()];
            self.recv_slice(&mut v, src)?;
            Tensor::from_vec(v, shape, device)
        })
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

fn max_message_bytes() -> DistResult<u64> {
    match std::env::var("ALLGRAD_MAX_MESSAGE_BYTES") {
        Err(_) => Ok(DEFAULT_MAX_MESSAGE_BYTES),
        Ok(v) => v
            .trim()
            .parse::<u64>()
            .map_err(|_| DistError::Env(format!("ALLGRAD_MAX_MESSAGE_BYTES={v:?} is not a number of bytes"))),
    }
}

fn resolve(host: &str, port: u16) -> DistResult<SocketAddr> {
    (host, port)
        .to_socket_addrs()
        .map_err(|e| DistError::io(format!("resolving MASTER_ADDR {host}"), e))?
        .next()
        .ok_or_else(|| DistError::Env(format!("MASTER_ADDR {host} resolves to no address")))
}

/// The local address this rank's data plane binds to: ALLGRAD_BIND_ADDR if set, else the
/// interface the OS would use to reach the master (found without sending a packet).
fn bind_ip_toward(master: &str, port: u16) -> DistResult<IpAddr> {
    if let Ok(a) = std::env::var("ALLGRAD_BIND_ADDR") {
        return a.trim().parse().map_err(|_| DistError::Env(format!("ALLGRAD_BIND_ADDR={a:?} is not an IP address")));
    }
    let target = resolve(master, port)?;
    if target.ip().is_loopback() {
        return Ok(target.ip());
    }
    let any: SocketAddr = if target.is_ipv4() { "0.0.0.0:0".parse().unwrap() } else { "[::]:0".parse().unwrap() };
    let probe = UdpSocket::bind(any).map_err(|e| DistError::io("finding the local interface", e))?;
    probe.connect(target).map_err(|e| DistError::io(format!("finding the interface that reaches {master}"), e))?;
    Ok(probe.local_addr().map_err(|e| DistError::io("finding the local interface", e))?.ip())
}

/// Connects this rank to every other member of a group: members publish their listening
/// address in the store, each connects to the lower ranks and accepts the higher ones. Every
/// connection is authenticated with the job token both ways. Then the members find out
/// whether they share this host, and set up shared memory if so (`shm_ops`).
fn connect_mesh(ctx: &Context, group: &str, me: usize, members: &[usize]) -> DistResult<Mesh> {
    let info = &ctx.info;
    let store = ctx.store.as_ref().expect("a multi-rank group has a store");
    let deadline = Instant::now() + info.timeout;
    let n = members.len();
    let listener = TcpListener::bind((ctx.bind_ip, 0))
        .map_err(|e| DistError::io(format!("binding the data plane on {}", ctx.bind_ip), e))?;
    let addr = listener.local_addr().map_err(|e| DistError::io("data-plane address", e))?;
    store.set(&format!("{group}/addr/{me}"), addr.to_string().as_bytes())?;

    let hello = Hello {
        service: Service::Data,
        rank: members[me] as u32,
        world: n as u32,
        token: info.token.clone(),
        group: group.to_string(),
    };
    let mut peers: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();

    for p in 0..me {
        let who = format!("rank {} ({group})", members[p]);
        let raw = store.get(&format!("{group}/addr/{p}"))?;
        let target: SocketAddr = String::from_utf8_lossy(&raw).parse().map_err(|_| DistError::Protocol {
            peer: members[p],
            group: group.into(),
            detail: "unreadable address in the store".into(),
        })?;
        let mut s = loop {
            match TcpStream::connect_timeout(&target, Duration::from_secs(5)) {
                Ok(s) => break s,
                Err(e) if Instant::now() < deadline => {
                    tracing::debug!("connecting to {who} at {target}: {e}; retrying");
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(DistError::io(format!("connecting to {who} at {target}"), e)),
            }
        };
        wire::write_all_by(&mut s, &hello.encode(), deadline, &who)?;
        let reply = Hello::read(&mut s, deadline, &who)?;
        if reply.service != Service::Data
            || !same_secret(&reply.token, &info.token)
            || reply.group != group
            || reply.rank as usize != members[p]
        {
            return Err(DistError::Unauthenticated { addr: target.to_string(), detail: format!("expected {who} of this job") });
        }
        peers[p] = Some(s);
    }

    // Accept the higher ranks. Each handshake is read on its own short-lived thread, so a
    // stray or hostile connection that sends nothing cannot hold up the others.
    listener.set_nonblocking(true).map_err(|e| DistError::io("data-plane listener", e))?;
    let (tx, rx) = std::sync::mpsc::channel::<(TcpStream, String, DistResult<Hello>)>();
    let mut missing = n - 1 - me;
    while missing > 0 {
        match listener.accept() {
            Ok((mut s, from)) => {
                let tx = tx.clone();
                let limit = deadline.min(Instant::now() + HANDSHAKE_GRACE);
                std::thread::spawn(move || {
                    let who = from.to_string();
                    let h = s
                        .set_nonblocking(false)
                        .map_err(|e| DistError::io("accepted connection", e))
                        .and_then(|_| Hello::read(&mut s, limit, &who));
                    let _ = tx.send((s, who, h));
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(DistError::io("accepting a data-plane connection", e)),
        }
        while let Ok((mut s, who, h)) = rx.try_recv() {
            let checked = h.and_then(|h| {
                if h.service != Service::Data || !same_secret(&h.token, &info.token) {
                    return Err(DistError::Unauthenticated { addr: who.clone(), detail: "wrong job token".into() });
                }
                match members.iter().position(|m| *m == h.rank as usize).filter(|i| *i > me && h.group == group) {
                    Some(i) if peers[i].is_none() => {
                        wire::write_all_by(&mut s, &hello.encode(), deadline, &who)?;
                        Ok(i)
                    }
                    _ => Err(DistError::Unauthenticated {
                        addr: who.clone(),
                        detail: format!("unexpected peer rank {} for group {:?}", h.rank, h.group),
                    }),
                }
            });
            match checked {
                Ok(i) => {
                    peers[i] = Some(s);
                    missing -= 1;
                }
                Err(e) => tracing::warn!("dropped a connection to the data plane of {group}: {e}"),
            }
        }
        if missing > 0 {
            if Instant::now() >= deadline {
                let waiting: Vec<usize> = (me + 1..n).filter(|p| peers[*p].is_none()).map(|p| members[p]).collect();
                return Err(DistError::Timeout {
                    what: format!("waiting for rank(s) {waiting:?} to connect ({group})"),
                    timeout: info.timeout,
                });
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    drop(listener);
    for s in peers.iter().flatten() {
        s.set_nonblocking(true).map_err(|e| DistError::io("configuring a data-plane socket", e))?;
        wire::tune_data_socket(s);
    }
    let mut mesh = Mesh::new(group.to_string(), me, members.to_vec(), peers, info.timeout);
    mesh.setup_shm(&info.token, ctx.shm)?;
    Ok(mesh)
}
