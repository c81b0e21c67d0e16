//! Starting one rank: its torchrun environment, its own process group, and its death with
//! the launcher.
//!
//! Between fork and exec the child makes itself a process-group leader (the launcher signals
//! the whole tree of a rank at once), asks the kernel to SIGKILL it when the launcher dies
//! (`PR_SET_PDEATHSIG`, Linux only), and then checks that its parent is still the launcher by
//! comparing getppid() with the launcher's pid captured before the fork: had the launcher
//! died before the request took effect, the child would already belong to another process
//! (init, or a subreaper such as a container's init or systemd --user, so "getppid() == 1"
//! is not the test) and exits at once. On other Unix systems the check still runs, but a
//! launcher killed later with SIGKILL leaves its ranks to their own timeouts.

use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};

use super::{LaunchConfig, LaunchError};

/// Where a rank's stderr goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stderr {
    /// Piped to the launcher, which prefixes and copies it.
    Piped,
    /// The launcher's own stderr (a terminal), so the rank can draw on it.
    Inherited,
}

/// What one rank needs from the job.
pub(crate) struct Job<'a> {
    pub cfg: &'a LaunchConfig,
    pub program: &'a str,
    pub args: &'a [String],
    pub port: u16,
    pub token: Option<&'a str>,
    /// The run id, when the ranks get torchrun's elastic variables (see
    /// [`LaunchConfig::run_id`]).
    pub run_id: Option<&'a str>,
    /// How many times the ranks were started again before this start.
    pub restart: usize,
}

/// Starts local rank `local`; stdout is always piped, stderr as `stderr` says.
pub(crate) fn spawn_rank(job: &Job, local: usize, stderr: Stderr) -> Result<Child, LaunchError> {
    let cfg = job.cfg;
    let rank = cfg.global_rank(local);
    let mut cmd = Command::new(job.program);
    cmd.args(job.args)
        .env("RANK", rank.to_string())
        .env("LOCAL_RANK", local.to_string())
        .env("WORLD_SIZE", cfg.world_size().to_string())
        .env("LOCAL_WORLD_SIZE", cfg.nproc_per_node.to_string())
        .env("GROUP_RANK", cfg.node_rank.to_string())
        .env("MASTER_ADDR", &cfg.master_addr)
        .env("MASTER_PORT", job.port.to_string())
        .env("ALLGRAD_LAUNCHED", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(match stderr {
            Stderr::Piped => Stdio::piped(),
            Stderr::Inherited => Stdio::inherit(),
        });
    if let Some(t) = job.token {
        cmd.env("ALLGRAD_JOB_TOKEN", t);
    }
    if let Some(id) = job.run_id {
        // What torchrun's agent tells its workers, minus its store (rank 0 serves allgrad's).
        cmd.env("TORCHELASTIC_RUN_ID", id)
            .env("TORCHELASTIC_RESTART_COUNT", job.restart.to_string())
            .env("TORCHELASTIC_MAX_RESTARTS", cfg.max_restarts.to_string())
            .env_remove("TORCHELASTIC_USE_AGENT_STORE");
    }
    let launcher = std::process::id() as libc::pid_t;
    // SAFETY: only async-signal-safe calls (setpgid, prctl, getppid, _exit) between fork and
    // exec, on values captured before the fork.
    unsafe {
        cmd.pre_exec(move || {
            // Own process group: the whole tree of this rank can be signalled at once.
            libc::setpgid(0, 0);
            // Die with the launcher, even if it is killed with SIGKILL.
            #[cfg(any(target_os = "linux", target_os = "android"))]
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            // The launcher may have died before that: then this process has been adopted.
            if libc::getppid() != launcher {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    cmd.spawn().map_err(|source| LaunchError::Spawn { rank, program: job.program.to_string(), source })
}
