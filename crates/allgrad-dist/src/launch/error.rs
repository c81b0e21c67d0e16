//! The launcher's errors: one variant per way `launch` can fail before or while starting
//! ranks. A rank that fails is not an error of the launcher but an [`Outcome`](super::Outcome).

/// Why [`launch`](super::launch) could not start or supervise the job.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// `nproc_per_node` or `nnodes` is zero.
    #[error("--nproc-per-node ({nproc_per_node}) and --nnodes ({nnodes}) must be at least 1")]
    EmptyWorld {
        /// Ranks per node asked for.
        nproc_per_node: usize,
        /// Nodes asked for.
        nnodes: usize,
    },

    /// This node's index is not below the number of nodes.
    #[error("--node-rank {node_rank} is not below --nnodes {nnodes}")]
    NodeRankOutOfRange {
        /// This node's index.
        node_rank: usize,
        /// Nodes in the job.
        nnodes: usize,
    },

    /// The program to launch is missing (an empty `program`).
    #[error("no program to launch")]
    NoProgram,

    /// A bare program name (no `/`) is neither on `PATH` nor beside the launcher's own
    /// executable.
    #[error(
        "`{program}` is not on PATH{}: give its path, e.g. `launch ... target/release/{program} ...`",
        beside.as_ref().map(|d| format!(" nor beside launch in {}", d.display())).unwrap_or_default()
    )]
    ProgramNotFound {
        /// The program, as given.
        program: String,
        /// The launcher's own folder, searched after `PATH`.
        beside: Option<std::path::PathBuf>,
    },

    /// Several nodes need one agreed port for rank 0's store; a free local port is no use.
    #[error("--master-port is required with more than one node (--nnodes {nnodes})")]
    MasterPortRequired {
        /// Nodes in the job.
        nnodes: usize,
    },

    /// No free loopback port could be found for rank 0's store.
    #[error("finding a free port for the rendezvous store: {0}")]
    FreePort(#[source] std::io::Error),

    /// The launcher's handler for a signal could not be installed.
    #[error("installing the launcher's handler for signal {signal}: {source}")]
    SignalHandler {
        /// The signal number.
        signal: i32,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// The launcher may not open the two pipes per rank that carry the ranks' output.
    #[error(
        "{nproc_per_node} ranks need about {need} open files in the launcher (two pipes each, {open} open already), \
         but it may open at most {soft} (ulimit -n; hard limit {hard}): raise the limit, e.g. `ulimit -n {suggest}`"
    )]
    TooFewFiles {
        /// Ranks to start on this node.
        nproc_per_node: usize,
        /// Descriptors needed.
        need: u64,
        /// Descriptors open now.
        open: u64,
        /// The soft limit.
        soft: u64,
        /// The hard limit.
        hard: u64,
        /// A limit to set.
        suggest: u64,
    },

    /// The thread that copies the ranks' output could not be started.
    #[error("starting the thread that copies the ranks' output: {source}")]
    Output {
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// A rank's process could not be started (the ranks already started were stopped).
    #[error("starting rank {rank}: {program}: {source}")]
    Spawn {
        /// Global rank of the process that could not start.
        rank: usize,
        /// The program, as given.
        program: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
}
