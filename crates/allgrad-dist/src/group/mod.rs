//! [`ProcessGroup`]: a set of ranks that run collectives together; its lifecycle (joining a
//! job, subgroups, failure) lives here.
//!
//! The collectives are methods too, in the files beside this one: `slices` (on slices of any
//! [`Elem`] type) and `tensors` (on Candle tensors of the dtypes in [`SUPPORTED_DTYPES`]:
//! CUDA tensors through NCCL or staged through host memory (`cuda`, feature `cuda`), the
//! group's CUDA path chosen in `cuda_path`; tensors on other devices are staged through host
//! memory). `host_ops` runs one collective, described as a `Kind`, on host values (for the
//! differentiable ops and the host path of CUDA tensors); `checked` checks a call whose data
//! moves through NCCL. `connect` sets up the network of a group. For collectives inside a
//! loss, use the differentiable functions of [`crate::ops`] instead.
//!
//! Every rank of a group must issue the same collectives, in the same order, from one thread
//! at a time. A rank that does otherwise gets a [`DistError::Mismatch`] naming both calls.

mod checked;
mod connect;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod cuda_path;
pub(crate) mod fd_limit;
pub(crate) mod host_ops;
mod on_demand;
#[cfg(test)]
mod on_demand_tests;
mod ring;
mod slices;
mod tensors;

use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::cpu::call::Call;
use crate::cpu::mesh::{Mesh, OpCode};
use crate::error::{DistError, DistResult};
use crate::reduce::ReduceOp;
#[allow(unused_imports)] // named in the rustdoc above
use crate::reduce::{Elem, SUPPORTED_DTYPES};
use crate::rendezvous::env::WorldInfo;
use crate::rendezvous::store::{StoreClient, StoreServer};
use crate::settings::{host_memory, message_cap, CudaCollectives, Settings};
use crate::wire::digest;
use connect::{bind_ip_toward, connect_mesh, resolve};
use cuda_path::CudaDecision;
pub use ring::{RingCounts, RingMessage, RingPass, RingSchedule, RingSetting};

/// What every group of one process shares: the job's identity and the rendezvous store.
struct Context {
    info: WorldInfo,
    store: Option<StoreClient>,
    bind_ip: IpAddr,
    /// Cap on the total bytes peers may announce for one all_gather or all_to_all.
    max_message_bytes: u64,
    settings: Settings,
    /// The mode groups choose their CUDA path with (ALLGRAD_CUDA_COLLECTIVES, then
    /// [`ProcessGroup::set_cuda_collectives`]).
    cuda_mode: Mutex<CudaCollectives>,
    // Rank 0 hosts the store for as long as its world group lives. Declared last: dropped last.
    _server: Option<StoreServer>,
}

struct State {
    mesh: Mesh,
    seq: u64,
    p2p_sent: Vec<u64>,
    p2p_recvd: Vec<u64>,
    subgroups: u64,
    /// What this group's ring passes did so far (`ring`).
    ring: ring::RingCounts,
    /// The group's path for CUDA tensors, once chosen (`cuda_path`).
    cuda: Option<CudaDecision>,
    /// The group's NCCL communicator, made by its first collective on a CUDA tensor.
    #[cfg(feature = "nccl")]
    nccl: Option<crate::gpu::nccl::GroupComm>,
}

struct Inner {
    name: String,
    rank: usize,
    members: Vec<usize>,
    state: Mutex<State>,
    /// The pinned host buffer of the group's `host` path, reused from call to call.
    #[cfg(feature = "cuda")]
    staging: Mutex<crate::gpu::cuda::Staging>,
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

impl ProcessGroup {
    /// Joins the job described by the launcher environment (see [`WorldInfo::from_env`]);
    /// a world of size 1 when no launcher variables are set. Every `ALLGRAD_*` variable is
    /// read here, once ([`Settings`]).
    pub fn from_env() -> DistResult<ProcessGroup> {
        let vars = std::env::vars().collect();
        Self::init_with(&WorldInfo::from_vars(&vars)?, Settings::from_vars(&vars)?)
    }

    /// A world of one rank; every collective is a copy. Reads no environment (default
    /// [`Settings`]).
    pub fn single() -> ProcessGroup {
        Self::init_with(&WorldInfo::single(), Settings::default()).expect("a single-rank group needs no network")
    }

    /// Joins the job: rank 0 hosts the rendezvous store at MASTER_ADDR:MASTER_PORT, every
    /// rank connects to every other, and the call returns once all are connected. The
    /// `ALLGRAD_*` settings are read from the environment now ([`Settings::from_env`]).
    pub fn init(info: &WorldInfo) -> DistResult<ProcessGroup> {
        Self::init_with(info, Settings::from_env()?)
    }

    /// As [`ProcessGroup::init`], with the given settings (the timeout and token are those of
    /// `info`). Reads no environment.
    pub fn init_with(info: &WorldInfo, settings: Settings) -> DistResult<ProcessGroup> {
        // Under torchrun's agent store, rank 0 does not bind MASTER_PORT (crate::rendezvous::agent).
        if let Some((info, server)) = crate::rendezvous::agent::rendezvous_via_agent(info)? {
            return Self::join(&info, server, settings);
        }
        let server = if info.rank == 0 && info.world_size > 1 {
            let ip = resolve(&info.master_addr, info.master_port)?;
            Some(StoreServer::start(ip, &info.token)?)
        } else {
            None
        };
        Self::join(info, server, settings)
    }

    /// Joins a job whose store is hosted elsewhere (by [`crate::run_threads`], say).
    pub(crate) fn join(info: &WorldInfo, server: Option<StoreServer>, settings: Settings) -> DistResult<ProcessGroup> {
        let members: Vec<usize> = (0..info.world_size).collect();
        let max_message_bytes = settings.max_message_bytes.unwrap_or_else(|| message_cap(host_memory(), info.local_world_size));
        if info.world_size == 1 {
            let ctx = Arc::new(Context {
                info: info.clone(),
                store: None,
                bind_ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
                max_message_bytes,
                cuda_mode: Mutex::new(settings.cuda_collectives.unwrap_or_default()),
                settings,
                _server: None,
            });
            let mesh = Mesh::new("world".into(), 0, members.clone(), vec![None], info.timeout);
            return Ok(Self::from_mesh("world".into(), 0, members, mesh, ctx));
        }
        let store_addr = format!("{}:{}", info.master_addr, info.master_port);
        let store = StoreClient::connect(&store_addr, &info.token, info.rank, info.timeout)?;
        let bind_ip = bind_ip_toward(settings.bind_addr, &info.master_addr, info.master_port)?;
        let ctx = Arc::new(Context {
            info: info.clone(),
            store: Some(store),
            bind_ip,
            max_message_bytes,
            cuda_mode: Mutex::new(settings.cuda_collectives.unwrap_or_default()),
            settings,
            _server: server,
        });
        // The connection to the store stays open while the group forms, and closes after: rank 0
        // serves no connection per rank for the life of the job (`StoreClient`'s notes).
        let mesh = {
            let store = ctx.store.as_ref().expect("set above");
            let _forming = store.hold();
            store.set_close_when_idle(true);
            connect_mesh(&ctx, "world", info.rank, &members)?
        };
        let pg = Self::from_mesh("world".into(), info.rank, members, mesh, ctx);
        tracing::debug!("rank {} joined a world of {}", info.rank, info.world_size);
        Ok(pg)
    }

    fn from_mesh(name: String, rank: usize, members: Vec<usize>, mesh: Mesh, ctx: Arc<Context>) -> ProcessGroup {
        let n = members.len();
        let state = State {
            mesh,
            seq: 0,
            p2p_sent: vec![0; n],
            p2p_recvd: vec![0; n],
            subgroups: 0,
            ring: ring::RingCounts::default(),
            cuda: None,
            #[cfg(feature = "nccl")]
            nccl: None,
        };
        ProcessGroup {
            inner: Arc::new(Inner {
                name,
                rank,
                members,
                state: Mutex::new(state),
                #[cfg(feature = "cuda")]
                staging: Mutex::new(crate::gpu::cuda::Staging::default()),
                ctx,
            }),
        }
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
    /// The `ALLGRAD_*` settings this group was made with.
    pub fn settings(&self) -> &Settings {
        &self.inner.ctx.settings
    }
    /// The most bytes peers may make this rank receive in one all_gather or all_to_all whose
    /// sizes they announce (ALLGRAD_MAX_MESSAGE_BYTES, else this rank's share of the host's
    /// memory: see [`crate::settings::message_cap`]). A larger announcement fails the call and
    /// poisons the group before anything is allocated.
    pub fn max_message_bytes(&self) -> u64 {
        self.inner.ctx.max_message_bytes
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

    /// How many peers this rank holds a connection to (for tests and benchmarks): every other
    /// rank in groups that connect every pair at formation, fewer in groups that connect on
    /// demand (ALLGRAD_ON_DEMAND_FROM) until their calls have needed more.
    #[doc(hidden)]
    pub fn connection_count(&self) -> usize {
        self.lock().mesh.connections()
    }

    /// How many of this group's all_reduce calls took each path so far (for tests).
    #[doc(hidden)]
    pub fn all_reduce_paths(&self) -> crate::cpu::mesh::AllReducePaths {
        self.lock().mesh.paths
    }

    /// How many of this group's broadcast and reduce calls took each path so far (for tests).
    #[doc(hidden)]
    pub fn rooted_paths(&self) -> crate::cpu::mesh::RootedPaths {
        self.lock().mesh.rooted_paths
    }

    /// How many of this group's all_to_all and barrier calls took each path so far (for tests).
    #[doc(hidden)]
    pub fn pairwise_paths(&self) -> crate::cpu::mesh::PairwisePaths {
        self.lock().mesh.pairwise_paths
    }

    /// How many of its connections this rank looks at each time for a dead or failed peer
    /// while it waits on shared memory or NCCL (ALLGRAD_PEER_WINDOW; for tests).
    #[doc(hidden)]
    pub fn peer_window(&self) -> usize {
        self.lock().mesh.peer_window
    }

    /// The global ranks whose connections this rank's look `k` covers while it waits on
    /// shared memory or NCCL (each wait starts again at look 0; for tests).
    #[doc(hidden)]
    pub fn peer_look(&self, k: usize) -> Vec<usize> {
        let g = self.lock();
        let mesh = &g.mesh;
        mesh.peer_watch().covers(k).filter(|p| *p != mesh.rank).map(|p| mesh.members[p]).collect()
    }

    /// Frames this rank exchanged on this group so far, and its poll(2) calls (for
    /// benchmarks that count what a collective costs).
    #[doc(hidden)]
    pub fn wire_counts(&self) -> crate::cpu::mesh::WireCounts {
        self.lock().mesh.counts
    }

    /// The rendezvous store, when the world has more than one rank. Its connection closes
    /// after each request ([`StoreClient::set_close_when_idle`]); hold it open across a run of
    /// requests with [`StoreClient::hold`].
    pub fn store(&self) -> Option<&StoreClient> {
        self.inner.ctx.store.as_ref()
    }

    /// Client connections rank 0's store serves now, on rank 0 of the world (`None` elsewhere;
    /// for tests and benchmarks).
    #[doc(hidden)]
    pub fn store_connections(&self) -> Option<usize> {
        self.inner.ctx._server.as_ref().map(StoreServer::connections)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.inner.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The group's staging buffer for the `host` path of CUDA tensors.
    #[cfg(feature = "cuda")]
    pub(crate) fn staging(&self) -> MutexGuard<'_, crate::gpu::cuda::Staging> {
        self.inner.staging.lock().unwrap_or_else(|p| p.into_inner())
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

    pub(crate) fn check_rank(&self, what: &str, r: usize) -> DistResult<()> {
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
}
