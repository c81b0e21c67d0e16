//! A torchrun-style launcher: starts the ranks of one node as child processes.
//!
//! Each child gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
//! MASTER_PORT and ALLGRAD_JOB_TOKEN; its output lines are prefixed with its rank
//! (`output.rs`, one thread for every rank's output). When one rank fails the others are stopped (SIGTERM, then SIGKILL after a
//! grace period) and the launcher exits with the failing rank's code (`supervise.rs`).
//! SIGINT/SIGTERM sent to the launcher reach every rank; the handlers that catch them are
//! installed only while [`launch`] runs and the previous ones are restored when it returns
//! (`signals.rs`). Each rank runs in its own process group (so its own children are stopped
//! with it) and, on Linux, is killed by the kernel if the launcher itself dies, so no process
//! is left behind (`spawn.rs`). Once every rank has exited, the shared-memory files that one
//! of this launcher's ranks created and left under `/dev/shm` by dying during a group's setup
//! are removed ([`remove_job_segments`](crate::remove_job_segments)); other nodes' files of
//! the job are not touched.
//!
//! `max_restarts` starts every rank again after a failure, as torchrun's `--max-restarts`
//! does ([`launch`]).
//!
//! Errors before or while starting ranks are [`LaunchError`]s; a failing rank is an
//! [`Outcome`].

mod config;
mod error;
mod output;
mod signals;
mod spawn;
mod supervise;

pub use config::{free_port, LaunchConfig, Outcome};
pub use error::LaunchError;

use output::Stream;
use spawn::Job;

/// Starts the ranks and supervises them until they all end; see the module docs.
///
/// With `max_restarts > 0`, a failed job (a rank that exits non-zero or is killed; not a
/// signal to the launcher) is started again, every rank, up to `max_restarts` times: the
/// others are stopped first, the reason is printed, and the ranks get torchrun's elastic
/// variables (`TORCHELASTIC_RUN_ID`, `TORCHELASTIC_RESTART_COUNT`,
/// `TORCHELASTIC_MAX_RESTARTS`), so `train` resumes from the newest checkpoint of the same
/// run directory without being told. On a single node without `master_port`, each start gets
/// a fresh free port.
pub fn launch(cfg: &LaunchConfig) -> Result<Outcome, LaunchError> {
    let (program, args) = cfg.validate()?;
    // Two pipes per rank (stdout, stderr): with a thousand ranks on a node, past the soft limit
    // of 1024 that many systems set; raised within the hard limit, or refused with the numbers.
    crate::group::fd_limit::make_room(2 * cfg.nproc_per_node as u64).map_err(|s| LaunchError::TooFewFiles {
        nproc_per_node: cfg.nproc_per_node,
        need: s.need,
        open: s.open,
        soft: s.soft,
        hard: s.hard,
        suggest: s.suggest(),
    })?;
    let beside = std::env::current_exe().ok().and_then(|e| e.parent().map(std::path::Path::to_path_buf));
    let program = config::resolve_program(program, std::env::var_os("PATH").as_deref(), beside.as_deref())?;
    let program = program.as_str();
    let token = config::job_token(std::env::var("ALLGRAD_JOB_TOKEN").ok(), cfg.nnodes);
    let run_id = cfg.elastic_run_id(crate::clock::now_secs());
    let signals = signals::SignalGuard::install()?;
    let mut restart = 0;
    loop {
        let port = cfg.port()?;
        let job = Job { cfg, program, args, port, token: token.as_deref(), run_id: run_id.as_deref(), restart };
        let outcome = run_once(&job, &signals)?;
        match outcome {
            Outcome::RankFailed { rank, code } if restart < cfg.max_restarts => {
                eprintln!(
                    "launch: rank {rank} exited with code {code}; restart {} of {}: starting all {} ranks again \
                     (run id {}; they resume from their newest checkpoint)",
                    restart + 1,
                    cfg.max_restarts,
                    cfg.nproc_per_node,
                    run_id.as_deref().unwrap_or("?"),
                );
                restart += 1;
            }
            outcome => return Ok(outcome),
        }
    }
}

/// One start of every rank of this node, supervised until they all end (or one fails, or a
/// signal arrives); the job's shared-memory files are removed before returning.
fn run_once(job: &Job, signals: &signals::SignalGuard) -> Result<Outcome, LaunchError> {
    let cfg = job.cfg;
    let mut children: Vec<(usize, std::process::Child)> = Vec::with_capacity(cfg.nproc_per_node);
    let mut pumps = output::Pumps::start(output::launcher_streams()).map_err(|source| LaunchError::Output { source })?;
    let terminal = output::stderr_is_terminal();
    for local in 0..cfg.nproc_per_node {
        let rank = cfg.global_rank(local);
        let show = cfg.shows(local);
        let stderr = output::stderr_for(rank, show, terminal);
        let mut child = match spawn::spawn_rank(job, local, stderr) {
            Ok(c) => c,
            Err(e) => {
                let pids: Vec<u32> = children.iter().map(|(_, c)| c.id()).collect();
                supervise::stop_all(&mut children, cfg.grace);
                remove_segments(job.token, &pids);
                return Err(e);
            }
        };
        let prefix = if cfg.prefix { format!("[rank{rank}]: ") } else { String::new() };
        if let Some(out) = child.stdout.take() {
            pumps.add(out, prefix.clone(), show, Stream::Out);
        }
        if let Some(err) = child.stderr.take() {
            pumps.add(err, prefix, show, Stream::Err);
        }
        children.push((rank, child));
    }
    let pumps = pumps.finish();

    let pids: Vec<u32> = children.iter().map(|(_, c)| c.id()).collect();
    let outcome = supervise::supervise(&mut children, signals, cfg.grace);
    let _ = pumps.join();
    remove_segments(job.token, &pids);
    Ok(outcome)
}

/// Removes the shared-memory files this launcher's ranks (`pids`) left (a rank that died while
/// setting up a group), once every rank has exited. Without a token (several nodes, none set)
/// the ranks' segment names are not known here and nothing is removed.
fn remove_segments(token: Option<&str>, pids: &[u32]) {
    let Some(token) = token else { return };
    let removed = crate::cpu::shm::job::remove_job_segments(token, pids);
    if !removed.is_empty() {
        let names: Vec<String> = removed.iter().map(|p| p.display().to_string()).collect();
        eprintln!("launch: removed shared-memory files left by the job's ranks: {}", names.join(", "));
    }
}
