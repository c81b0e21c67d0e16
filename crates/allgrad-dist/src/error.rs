//! Errors of the distributed layer. Every variant says what failed, on which group and
//! rank, and (where it helps) what to do about it.

use std::time::Duration;

/// Result alias of this crate's low-level functions. The tensor-level API returns
/// `candle_core::Result`, into which [`DistError`] converts.
pub type DistResult<T> = std::result::Result<T, DistError>;

/// What can go wrong in rendezvous, the store or a collective.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// The launcher environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) is incomplete or invalid.
    #[error("invalid distributed environment: {0}")]
    Env(String),

    /// A socket operation failed at a place named by `context`.
    #[error("{context}: {source}")]
    Io {
        /// Where it happened (which address, which peer, which call).
        context: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// A blocking call did not complete within the configured timeout.
    #[error("timed out after {timeout:?} {what} (set ALLGRAD_TIMEOUT_S to change the timeout)")]
    Timeout {
        /// What was being waited for.
        what: String,
        /// The timeout in force.
        timeout: Duration,
    },

    /// A peer closed its connection or died while this rank was exchanging data with it.
    #[error("rank {peer} closed its connection during {during} on group {group} (rank {peer} probably failed or was killed)")]
    PeerClosed {
        /// Global rank of the peer.
        peer: usize,
        /// The collective in progress.
        during: String,
        /// Group name.
        group: String,
    },

    /// A peer failed and told the others why before leaving the group.
    #[error("rank {peer} aborted group {group}: {reason}")]
    PeerAborted {
        /// Global rank of the peer that aborted.
        peer: usize,
        /// Group name.
        group: String,
        /// The peer's own error message.
        reason: String,
    },

    /// Ranks called different collectives (or the same one with incompatible arguments) at
    /// the same point of their program.
    #[error("collective mismatch on group {group}: rank {rank} called {ours}, but rank {peer} called {theirs}")]
    Mismatch {
        /// Group name.
        group: String,
        /// This rank (global).
        rank: usize,
        /// This rank's call.
        ours: String,
        /// The peer (global rank).
        peer: usize,
        /// The peer's call.
        theirs: String,
    },

    /// A peer sent bytes that are not a valid allgrad frame (wrong magic, impossible length).
    #[error("malformed frame from rank {peer} on group {group}: {detail}")]
    Protocol {
        /// The peer (global rank), or `usize::MAX` when not yet known.
        peer: usize,
        /// Group name.
        group: String,
        /// What was wrong.
        detail: String,
    },

    /// A connection failed the job-token handshake.
    #[error("rejected connection from {addr}: {detail}")]
    Unauthenticated {
        /// The remote address.
        addr: String,
        /// Why it was rejected.
        detail: String,
    },

    /// A connection a call needed could not be opened (groups that connect on demand): refused,
    /// rejected in the handshake, or past this process's limit on open files.
    #[error("rank {rank} could not open its connection to rank {peer} on group {group}: {cause}")]
    Connect {
        /// The rank that tried to connect.
        rank: usize,
        /// The rank it tried to reach.
        peer: usize,
        /// Group name.
        group: String,
        /// What went wrong.
        cause: String,
    },

    /// The group was already broken by an earlier failure; no further collective can run.
    #[error("group {group} is unusable after an earlier failure: {first}")]
    Poisoned {
        /// Group name.
        group: String,
        /// The first error seen on this group.
        first: String,
    },

    /// The caller passed arguments that cannot work (a rank out of range, a split that does
    /// not sum to the length, ...).
    #[error("{0}")]
    Invalid(String),

    /// NCCL (or the CUDA driver under it) failed in a collective on CUDA tensors.
    #[error("NCCL failed in {call} on group {group}: {detail}")]
    Nccl {
        /// Group name.
        group: String,
        /// The call and the step of it that failed.
        call: String,
        /// NCCL's or CUDA's own words.
        detail: String,
    },

    /// The path chosen for a group's collectives of CUDA tensors (`cuda_collectives`) cannot
    /// be taken: `nccl` where ranks share a GPU or the build has no NCCL.
    #[error("collectives of CUDA tensors on group {group}: {detail}")]
    CudaCollectives {
        /// Group name.
        group: String,
        /// What is wrong, naming the ranks and GPUs, and what to do.
        detail: String,
    },

    /// The rendezvous store answered with an error.
    #[error("store: {0}")]
    Store(String),
}

impl DistError {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        DistError::Io { context: context.into(), source }
    }

    /// True when this error was caused by another rank's failure rather than by this rank.
    /// Harnesses use it to report the root cause first.
    pub fn is_secondary(&self) -> bool {
        matches!(self, DistError::PeerAborted { .. } | DistError::PeerClosed { .. } | DistError::Poisoned { .. })
    }
}

impl From<DistError> for candle_core::Error {
    fn from(e: DistError) -> Self {
        candle_core::Error::wrap(e)
    }
}
