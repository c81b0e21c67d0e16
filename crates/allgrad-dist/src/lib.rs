//! # allgrad-dist
//!
//! Process groups, a rendezvous store, a CPU collectives backend over TCP, and
//! differentiable collectives for Candle.
//!
//! - [`ProcessGroup::from_env`] joins a job launched by torchrun, `srun` or allgrad's
//!   `launch` (a world of one process without them). [`run_threads`] runs W ranks as
//!   threads of one process, for tests and examples.
//! - The plain collectives are methods of [`ProcessGroup`]: all_reduce (sum, avg, prod, max,
//!   min), all_gather (uneven sizes too), reduce_scatter, broadcast, reduce, all_to_all,
//!   send/recv, barrier, on f32, f64, f16, bf16, i64, u32 and u8.
//! - The differentiable collectives ([`all_gather`], [`all_reduce`], [`reduce_scatter`],
//!   [`broadcast`], [`all_to_all`]) are Candle custom ops with a correct backward, under the
//!   convention documented in [`ops`]. [`testing::check_world_size_invariance`] checks a
//!   user's own distributed loss against a single process.
//! - [`launch`] starts the ranks of one node as processes, torchrun-style (the `launch`
//!   binary of the `allgrad` crate).
//! - Every blocking call has a timeout (ALLGRAD_TIMEOUT_S, default 300 s). A rank that fails
//!   or dies makes every other rank's collectives fail within milliseconds, naming it. Ranks
//!   that call different collectives fail with a message naming both calls.
//! - Every connection is authenticated with the job token (ALLGRAD_JOB_TOKEN) and every
//!   length read from the network is bounded before allocation.
//! - Members of a group that all run on one host move the data of large all_reduce,
//!   all_gather and reduce_scatter calls (64 KiB and more) through a shared-memory segment
//!   instead of loopback TCP; the calls are still checked against each other over TCP, and
//!   failures and timeouts behave as above. The segment (under `/dev/shm`, mode 0600) loses
//!   its name as soon as every member has mapped it. ALLGRAD_SHM=0 keeps a process on TCP
//!   (its groups then use TCP throughout); ALLGRAD_SHM_SLOT_BYTES sets the bytes each rank
//!   moves per step (default 1 MiB). [`ProcessGroup::shared_memory`] tells which path a group
//!   takes.
//! - Collectives of CUDA tensors (feature `cuda`) go through NCCL (feature `nccl`) when every
//!   rank of the group has a GPU of its own, and through a pinned host buffer and the CPU
//!   backend otherwise (ranks sharing a GPU, or a build without NCCL); `dist.cuda_collectives`
//!   / ALLGRAD_CUDA_COLLECTIVES force either ([`gpu`], [`ProcessGroup::cuda_path`]).
//! - Every `ALLGRAD_*` variable is read once, when the group is made, into [`Settings`]
//!   (the table of variables, defaults and meanings is in [`settings`]); a bad value is an
//!   error naming the variable and the value. Peers cannot make a rank allocate more than
//!   [`ProcessGroup::max_message_bytes`] in one call (by default its share of the host's
//!   memory, [`settings::message_cap`]).

#![warn(missing_docs)]

/// The `tracing` target of messages that say the same thing on every rank (a skipped
/// evaluation file, a resume without a checkpoint): `train`'s logger shows them on rank 0
/// only, so a job of W ranks prints them once, not W times. Use it as
/// `tracing::warn!(target: allgrad_dist::JOB_LOG, "...")`.
pub const JOB_LOG: &str = "allgrad_job";

pub mod clock;
mod cpu;
mod dispatch;
mod error;
pub mod gpu;
mod group;
pub mod launch;
pub mod ops;
mod reduce;
mod rendezvous;
pub mod settings;
pub mod testing;
mod threads;
mod wire;

pub use rendezvous::{elastic, env, slurm, store, torch_store};

#[doc(hidden)]
pub use cpu::mesh::{AllReducePaths, PairwisePaths, RootedPaths, WireCounts};
pub use cpu::shm::job::{remove_job_segments, shm_job_prefix, shm_rank_prefix};
#[doc(hidden)]
pub use dispatch::__private;
pub use elastic::Elastic;
pub use env::WorldInfo;
pub use error::{DistError, DistResult};
pub use gpu::CudaPath;
pub use group::{ProcessGroup, RingCounts, RingMessage, RingPass, RingSchedule, RingSetting};
pub use ops::{
    all_gather, all_reduce, all_to_all, all_to_all_sizes, broadcast, ppermute, reduce_scatter, ring_destinations, ring_shift,
};
pub use reduce::{Elem, ReduceOp, SUPPORTED_DTYPES};
pub use settings::{CudaCollectives, Settings, DEFAULT_MAX_MESSAGE_BYTES};
pub use threads::{run_threads, ThreadWorld};
