//! Ranks as threads: W ranks in one process, connected over loopback TCP exactly as
//! processes would be. The harness for unit tests, doc examples and users' own tests.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::time::Duration;

use crate::error::DistError;
use crate::group::ProcessGroup;
use crate::rendezvous::env::WorldInfo;
use crate::rendezvous::store::StoreServer;
use crate::settings::{CudaCollectives, Settings, DEFAULT_TIMEOUT};

/// Runs `f` on `world_size` ranks, each a thread with its own [`ProcessGroup`], and returns
/// every rank's result in rank order. See [`ThreadWorld`] for timeouts.
///
/// ```
/// use allgrad_dist::{run_threads, ReduceOp};
/// let sums = run_threads(3, |pg| {
///     let mut x = [pg.rank() as f32 + 1.0];
///     pg.all_reduce_slice(&mut x, ReduceOp::Sum)?;
///     Ok(x[0])
/// })
/// .unwrap();
/// assert_eq!(sums, vec![6.0, 6.0, 6.0]);
/// ```
pub fn run_threads<T, F>(world_size: usize, f: F) -> candle_core::Result<Vec<T>>
where
    T: Send,
    F: Fn(ProcessGroup) -> candle_core::Result<T> + Sync,
{
    ThreadWorld::new(world_size).run(f)
}

/// A world of ranks as threads, with its timeouts.
#[derive(Clone, Debug)]
pub struct ThreadWorld {
    world_size: usize,
    timeout: Duration,
    watchdog: Option<Duration>,
    shm: Option<bool>,
    shm_slot_bytes: Option<usize>,
    max_message_bytes: Option<u64>,
    cuda_collectives: Option<CudaCollectives>,
    /// A rank that runs with shared memory off while the others have it on (tests).
    declining: Option<usize>,
    tree_from: Option<usize>,
    on_demand_from: Option<usize>,
    peer_window: Option<usize>,
}

impl ThreadWorld {
    /// `world_size` ranks; collective timeout from ALLGRAD_TIMEOUT_S, else 60 s; a watchdog
    /// that ends the process with a message if the ranks have not all returned 60 s after that.
    pub fn new(world_size: usize) -> Self {
        let timeout = Settings::from_env().map(|s| s.timeout).ok().filter(|t| *t != DEFAULT_TIMEOUT);
        let timeout = timeout.unwrap_or(Duration::from_secs(60));
        ThreadWorld {
            world_size,
            timeout,
            watchdog: Some(timeout + Duration::from_secs(60)),
            shm: None,
            shm_slot_bytes: None,
            max_message_bytes: None,
            cuda_collectives: None,
            declining: None,
            tree_from: None,
            on_demand_from: None,
            peer_window: None,
        }
    }

    /// Groups of at least `ranks` ranks take the binomial tree, overriding ALLGRAD_TREE_FROM
    /// (tests run the tree on small worlds with 2).
    pub fn tree_from(mut self, ranks: usize) -> Self {
        self.tree_from = Some(ranks);
        self
    }

    /// Groups of at least `ranks` ranks connect on demand, overriding ALLGRAD_ON_DEMAND_FROM
    /// (tests open connections on demand in small worlds with 2).
    pub fn on_demand_from(mut self, ranks: usize) -> Self {
        self.on_demand_from = Some(ranks);
        self
    }

    /// How many connections a rank waiting on shared memory looks at each time for a dead
    /// peer, overriding ALLGRAD_PEER_WINDOW (tests make the window move on small worlds with 2).
    pub fn peer_window(mut self, connections: usize) -> Self {
        self.peer_window = Some(connections);
        self
    }

    /// The mode every rank's groups choose their path for CUDA tensors with, overriding
    /// ALLGRAD_CUDA_COLLECTIVES ([`crate::gpu`]).
    pub fn cuda_collectives(mut self, mode: CudaCollectives) -> Self {
        self.cuda_collectives = Some(mode);
        self
    }

    /// Whether the ranks' groups may use shared memory for large collectives (they are on one
    /// host), overriding ALLGRAD_SHM: `false` sends everything over loopback TCP, as ranks on
    /// different hosts would.
    pub fn shm(mut self, enabled: bool) -> Self {
        self.shm = Some(enabled);
        self
    }

    /// Bytes per rank of one shared-memory piece (tests use small ones for many pieces).
    #[cfg(test)]
    pub(crate) fn shm_slot_bytes(mut self, bytes: usize) -> Self {
        self.shm_slot_bytes = Some(bytes);
        self
    }

    /// Every rank's cap on peer-announced message sizes, as ALLGRAD_MAX_MESSAGE_BYTES would set it.
    #[cfg(test)]
    pub(crate) fn max_message_bytes_for_test(mut self, bytes: u64) -> Self {
        self.max_message_bytes = Some(bytes);
        self
    }

    /// Rank `rank` runs with shared memory off, as if its environment said ALLGRAD_SHM=0.
    #[cfg(test)]
    pub(crate) fn declining_rank_for_test(mut self, rank: usize) -> Self {
        self.declining = Some(rank);
        self
    }

    /// Timeout of every blocking collective call.
    pub fn timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self.watchdog = self.watchdog.map(|_| t + Duration::from_secs(60));
        self
    }

    /// Watchdog limit for the whole run (`None` turns it off). When it expires the process
    /// prints which ranks are still running and exits with status 1: a test fails instead of
    /// hanging.
    pub fn watchdog(mut self, limit: Option<Duration>) -> Self {
        self.watchdog = limit;
        self
    }

    /// Runs `f` on every rank; see [`run_threads`]. When ranks fail, the error reports the
    /// root cause first (a rank that failed on its own, rather than because a peer did).
    pub fn run<T, F>(&self, f: F) -> candle_core::Result<Vec<T>>
    where
        T: Send,
        F: Fn(ProcessGroup) -> candle_core::Result<T> + Sync,
    {
        let w = self.world_size;
        if w == 0 {
            return Err(DistError::Invalid("run_threads needs at least one rank".into()).into());
        }
        let mut settings = Settings::from_env()?;
        settings.shm = self.shm.unwrap_or(settings.shm);
        settings.shm_slot_bytes = self.shm_slot_bytes.unwrap_or(settings.shm_slot_bytes);
        settings.max_message_bytes = self.max_message_bytes.or(settings.max_message_bytes);
        settings.cuda_collectives = self.cuda_collectives.or(settings.cuda_collectives);
        settings.timeout = self.timeout;
        settings.tree_from = self.tree_from.unwrap_or(settings.tree_from).max(2);
        settings.on_demand_from = self.on_demand_from.unwrap_or(settings.on_demand_from).max(2);
        settings.peer_window = self.peer_window.unwrap_or(settings.peer_window).max(1);
        let token = format!("threads-{:032x}", rand::random::<u128>());
        let server = if w > 1 { Some(StoreServer::start("127.0.0.1:0", &token)?) } else { None };
        let port = server.as_ref().map(|s| s.addr().port()).unwrap_or(crate::rendezvous::env::DEFAULT_MASTER_PORT);
        let info = |rank| WorldInfo {
            rank,
            world_size: w,
            local_rank: rank,
            local_world_size: w,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            token: token.clone(),
            timeout: self.timeout,
            elastic: None,
        };
        let (done_tx, done_rx) = mpsc::channel::<usize>();
        let _dog = self.watchdog.map(|limit| Watchdog::start(limit, w, done_rx));
        let f = &f;
        let outcomes: Vec<(candle_core::Result<T>, bool)> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..w)
                .map(|rank| {
                    let info = info(rank);
                    let done = done_tx.clone();
                    let settings = Settings { shm: settings.shm && self.declining != Some(rank), ..settings.clone() };
                    std::thread::Builder::new()
                        .name(format!("rank-{rank}"))
                        .spawn_scoped(scope, move || {
                            let out = run_rank(rank, &info, settings, f);
                            let _ = done.send(rank);
                            out
                        })
                        .expect("spawning a rank thread")
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("rank threads catch their panics")).collect()
        });
        drop(server);

        let mut results = Vec::with_capacity(w);
        let mut errors = Vec::new();
        for (rank, (out, secondary)) in outcomes.into_iter().enumerate() {
            match out {
                Ok(v) => results.push(v),
                Err(e) => errors.push((rank, e, secondary)),
            }
        }
        if errors.is_empty() {
            return Ok(results);
        }
        // Root cause first: a rank whose own failure was not caused by another rank.
        let pick = errors.iter().position(|(_, _, secondary)| !secondary).unwrap_or(0);
        let (rank, err, _) = errors.swap_remove(pick);
        let others: Vec<usize> = errors.iter().map(|(r, _, _)| *r).collect();
        let tail = if others.is_empty() { String::new() } else { format!(" (ranks {others:?} failed after it)") };
        Err(candle_core::Error::Msg(format!("rank {rank} of {w} failed: {err}{tail}")))
    }
}

/// Runs one rank; returns its outcome and whether its failure was caused by another rank.
fn run_rank<T, F>(rank: usize, info: &WorldInfo, settings: Settings, f: &F) -> (candle_core::Result<T>, bool)
where
    F: Fn(ProcessGroup) -> candle_core::Result<T>,
{
    let pg = match ProcessGroup::join(info, None, settings) {
        Ok(pg) => pg,
        Err(e) => {
            let secondary = e.is_secondary();
            return (Err(e.into()), secondary);
        }
    };
    let probe = pg.clone();
    let out = match catch_unwind(AssertUnwindSafe(|| f(pg))) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "non-string panic".into());
            Err(candle_core::Error::Msg(format!("rank {rank} panicked: {msg}")))
        }
    };
    let secondary = match (&out, probe.failure()) {
        (Err(e), None) => {
            // The rank failed outside a collective: tell the others why before leaving.
            probe.abort(&e.to_string());
            false
        }
        (_, Some((_, secondary))) => secondary,
        (Ok(_), None) => false,
    };
    (out, secondary)
}

struct Watchdog {
    stop: mpsc::Sender<()>,
}

impl Watchdog {
    fn start(limit: Duration, w: usize, done: mpsc::Receiver<usize>) -> Watchdog {
        let (stop, stop_rx) = mpsc::channel::<()>();
        std::thread::spawn(move || {
            let deadline = std::time::Instant::now() + limit;
            let mut finished = vec![false; w];
            loop {
                if stop_rx.try_recv().is_ok() {
                    return;
                }
                while let Ok(r) = done.try_recv() {
                    finished[r] = true;
                }
                if std::time::Instant::now() >= deadline {
                    let stuck: Vec<usize> = (0..w).filter(|r| !finished[*r]).collect();
                    eprintln!(
                        "watchdog: ranks {stuck:?} of a {w}-rank run_threads world did not finish within {limit:?}; exiting"
                    );
                    std::process::exit(1);
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        Watchdog { stop }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        let _ = self.stop.send(());
    }
}
