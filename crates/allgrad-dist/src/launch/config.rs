//! What to launch ([`LaunchConfig`]), how the job ended ([`Outcome`]), and the checks and
//! defaults applied before any rank starts.

use std::time::Duration;

use super::LaunchError;

/// What to launch, and where this node sits in the job.
#[derive(Clone, Debug)]
pub struct LaunchConfig {
    /// Ranks to start on this node.
    pub nproc_per_node: usize,
    /// Nodes in the job.
    pub nnodes: usize,
    /// This node's index, `0..nnodes`.
    pub node_rank: usize,
    /// Host of rank 0 (its rendezvous store).
    pub master_addr: String,
    /// Port of rank 0's rendezvous store; 0 picks a free one (single node only).
    pub master_port: u16,
    /// Local ranks whose output is shown (all when `None`).
    pub ranks_filter: Option<Vec<usize>>,
    /// Prefix each output line with `[rankN]: `.
    pub prefix: bool,
    /// Time between SIGTERM and SIGKILL when stopping ranks.
    pub grace: Duration,
    /// Times to start every rank again after one fails (0: never; torchrun's
    /// `--max-restarts`). See [`super::launch`].
    pub max_restarts: usize,
    /// The job's run id (torchrun's `--rdzv-id`), handed to the ranks as `TORCHELASTIC_RUN_ID`
    /// when given or when `max_restarts > 0` (then it defaults to the launch's UTC time,
    /// `YYYYmmdd-HHMMSS`).
    pub run_id: Option<String>,
    /// The program and its arguments.
    pub program: Vec<String>,
}

impl LaunchConfig {
    /// `nproc_per_node` ranks of `program` on one node, with the `launch` binary's defaults:
    /// rank 0 on 127.0.0.1 at a free port, every rank's output shown and prefixed, 5 s of
    /// grace, no restarts.
    pub fn new(nproc_per_node: usize, program: Vec<String>) -> LaunchConfig {
        LaunchConfig {
            nproc_per_node,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: 0,
            ranks_filter: None,
            prefix: true,
            grace: Duration::from_secs(5),
            max_restarts: 0,
            run_id: None,
            program,
        }
    }

    /// Ranks in the whole job.
    pub fn world_size(&self) -> usize {
        self.nproc_per_node * self.nnodes
    }

    /// Global rank of this node's local rank `local`.
    pub fn global_rank(&self, local: usize) -> usize {
        self.node_rank * self.nproc_per_node + local
    }

    /// Whether local rank `local`'s output is shown (`ranks_filter`).
    pub fn shows(&self, local: usize) -> bool {
        self.ranks_filter.as_ref().is_none_or(|f| f.contains(&local))
    }

    /// Checks the sizes and returns the program and its arguments.
    pub(crate) fn validate(&self) -> Result<(&str, &[String]), LaunchError> {
        if self.nproc_per_node == 0 || self.nnodes == 0 {
            return Err(LaunchError::EmptyWorld { nproc_per_node: self.nproc_per_node, nnodes: self.nnodes });
        }
        if self.node_rank >= self.nnodes {
            return Err(LaunchError::NodeRankOutOfRange { node_rank: self.node_rank, nnodes: self.nnodes });
        }
        let (prog, args) = self.program.split_first().ok_or(LaunchError::NoProgram)?;
        Ok((prog.as_str(), args))
    }

    /// The run id handed to the ranks, if any (see [`LaunchConfig::run_id`]).
    pub(crate) fn elastic_run_id(&self, now_secs: u64) -> Option<String> {
        match &self.run_id {
            Some(id) => Some(id.clone()),
            None if self.max_restarts > 0 => Some(crate::clock::utc_stamp(now_secs)),
            None => None,
        }
    }

    /// The port of rank 0's store: the configured one, else a free one on a single node.
    pub(crate) fn port(&self) -> Result<u16, LaunchError> {
        if self.master_port != 0 {
            Ok(self.master_port)
        } else if self.nnodes == 1 {
            free_port()
        } else {
            Err(LaunchError::MasterPortRequired { nnodes: self.nnodes })
        }
    }
}

/// The program to start: `program` itself when it holds a `/` or is found on `path` (the
/// `PATH` variable; the operating system then finds it again), else the executable of that
/// name in `beside` (the launcher's own folder), so that `launch ... train ...` works right
/// after `cargo build`, where `train` sits beside `launch` but not on `PATH`.
pub(crate) fn resolve_program(
    program: &str,
    path: Option<&std::ffi::OsStr>,
    beside: Option<&std::path::Path>,
) -> Result<String, LaunchError> {
    use std::os::unix::fs::PermissionsExt;
    let executable = |p: &std::path::Path| p.metadata().is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
    if program.contains('/') || path.is_some_and(|path| std::env::split_paths(path).any(|d| executable(&d.join(program)))) {
        return Ok(program.to_string());
    }
    match beside.map(|d| d.join(program)) {
        Some(p) if executable(&p) => Ok(p.to_string_lossy().into_owned()),
        _ => Err(LaunchError::ProgramNotFound { program: program.to_string(), beside: beside.map(|d| d.to_path_buf()) }),
    }
}

/// The job token handed to the ranks: ALLGRAD_JOB_TOKEN from `env_token` when set, a fresh
/// random one on a single node, and none with several nodes (each rank then derives a weak
/// one, and the launcher says so).
pub(crate) fn job_token(env_token: Option<String>, nnodes: usize) -> Option<String> {
    match env_token {
        Some(t) if !t.is_empty() => Some(t),
        _ if nnodes == 1 => Some(format!("{:032x}", rand::random::<u128>())),
        _ => {
            eprintln!(
                "launch: ALLGRAD_JOB_TOKEN is not set; with several nodes every node needs the same secret, \
                 so ranks will derive a weak one (set ALLGRAD_JOB_TOKEN on every node)"
            );
            None
        }
    }
}

/// How the job ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Every rank exited with status 0.
    Success,
    /// A rank failed first; the others were stopped.
    RankFailed {
        /// Global rank of the first failing process.
        rank: usize,
        /// Its exit code (128 + signal number when killed by a signal).
        code: i32,
    },
    /// The launcher was interrupted by a signal and stopped every rank.
    Interrupted(i32),
}

impl Outcome {
    /// The launcher's exit code.
    pub fn exit_code(&self) -> i32 {
        match self {
            Outcome::Success => 0,
            Outcome::RankFailed { code, .. } => (*code).max(1),
            Outcome::Interrupted(sig) => 128 + sig,
        }
    }
}

/// A free TCP port on loopback (bound, read, released).
pub fn free_port() -> Result<u16, LaunchError> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(LaunchError::FreePort)?;
    Ok(l.local_addr().map_err(LaunchError::FreePort)?.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(nproc_per_node: usize, nnodes: usize, node_rank: usize, program: &[&str]) -> LaunchConfig {
        LaunchConfig { nnodes, node_rank, ..LaunchConfig::new(nproc_per_node, program.iter().map(|s| s.to_string()).collect()) }
    }

    #[test]
    fn invalid_configs_are_typed_errors_naming_the_values() {
        let e = cfg(0, 1, 0, &["true"]).validate().unwrap_err();
        assert!(matches!(e, LaunchError::EmptyWorld { nproc_per_node: 0, nnodes: 1 }), "{e:?}");
        assert_eq!(e.to_string(), "--nproc-per-node (0) and --nnodes (1) must be at least 1");
        let e = cfg(2, 2, 2, &["true"]).validate().unwrap_err();
        assert!(matches!(e, LaunchError::NodeRankOutOfRange { node_rank: 2, nnodes: 2 }), "{e:?}");
        assert_eq!(e.to_string(), "--node-rank 2 is not below --nnodes 2");
        assert!(matches!(cfg(1, 1, 0, &[]).validate(), Err(LaunchError::NoProgram)));
        let e = cfg(1, 3, 0, &["true"]).port().unwrap_err();
        assert!(matches!(e, LaunchError::MasterPortRequired { nnodes: 3 }), "{e:?}");
        assert_eq!(cfg(2, 1, 0, &["prog", "a"]).validate().unwrap(), ("prog", &["a".to_string()][..]));
    }

    #[test]
    fn a_bare_program_name_is_found_on_path_then_beside_the_launcher() {
        use std::os::unix::fs::PermissionsExt;
        let (on_path, beside) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let exe = |dir: &std::path::Path, name: &str, mode: u32| {
            let p = dir.join(name);
            std::fs::write(&p, "#!/bin/sh\n").unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        };
        exe(on_path.path(), "both", 0o755);
        exe(beside.path(), "both", 0o755);
        exe(beside.path(), "train", 0o755);
        exe(beside.path(), "notes", 0o644);
        let path = std::env::join_paths([on_path.path()]).unwrap();
        let resolve = |p: &str| resolve_program(p, Some(&path), Some(beside.path()));
        // PATH first (the name is kept: the operating system finds it again), then beside.
        assert_eq!(resolve("both").unwrap(), "both");
        assert_eq!(resolve("train").unwrap(), beside.path().join("train").to_string_lossy());
        // A path is taken as given, even when it does not exist (spawning then says so).
        assert_eq!(resolve("./nowhere/train").unwrap(), "./nowhere/train");
        // Neither: an error naming the program and both places; a file without the
        // executable bit does not count.
        for missing in ["absent", "notes"] {
            let e = resolve(missing).unwrap_err();
            assert!(matches!(&e, LaunchError::ProgramNotFound { program, .. } if program == missing), "{e:?}");
            let msg = e.to_string();
            assert!(
                msg.contains(&format!("`{missing}` is not on PATH nor beside launch in {}", beside.path().display())),
                "{msg}"
            );
            assert!(msg.contains(&format!("target/release/{missing}")), "{msg}");
        }
        assert!(resolve_program("absent", None, None)
            .unwrap_err()
            .to_string()
            .starts_with("`absent` is not on PATH: give its path"));
    }

    #[test]
    fn ranks_are_numbered_by_node_and_filtered_by_local_rank() {
        let mut c = cfg(4, 3, 2, &["true"]);
        assert_eq!((c.world_size(), c.global_rank(0), c.global_rank(3)), (12, 8, 11));
        c.ranks_filter = Some(vec![1]);
        assert!(c.shows(1) && !c.shows(0));
    }

    #[test]
    fn a_run_id_is_handed_out_when_given_or_when_restarts_are_allowed() {
        let mut c = cfg(2, 1, 0, &["true"]);
        assert_eq!(c.elastic_run_id(0), None);
        c.max_restarts = 2;
        assert_eq!(c.elastic_run_id(1_767_225_600).as_deref(), Some("20260101-000000"));
        c.run_id = Some("job-7".into());
        assert_eq!(c.elastic_run_id(0).as_deref(), Some("job-7"));
    }

    #[test]
    fn the_token_comes_from_the_environment_or_is_fresh_on_one_node() {
        assert_eq!(job_token(Some("abc".into()), 2).as_deref(), Some("abc"));
        let (a, b) = (job_token(None, 1).unwrap(), job_token(Some(String::new()), 1).unwrap());
        assert!(a.len() == 32 && b.len() == 32 && a != b, "{a} {b}");
        assert_eq!(job_token(None, 2), None);
    }
}
