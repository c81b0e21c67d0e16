//! # allgrad-testkit
//!
//! Test support shared by every crate of the workspace, used as a dev-dependency only:
//!
//! - [`skip`]: the one way a test that cannot run here says so. It prints
//!   `SKIPPED <binary>::<test> [<need>]: <reason> (runs when: <condition>)` to stderr, appends the
//!   same line to the file named by `ALLGRAD_SKIP_LOG` when that is set (`.ci/run` sets it and
//!   lists the file at the end of its run), and fails the test instead when the machine is
//!   supposed to provide what it needs ([`Need::required`]).
//! - [`process`]: waiting for child processes under a watchdog that kills the child's whole
//!   process group and fails the test with a message, for every multi-process test.
//! - [`close`]: the one definition of "relative error" the tests use.
//! - [`hashed_values`]: deterministic test data that differs at every position and per salt.

#![warn(missing_docs)]

pub mod close;
pub mod process;

use std::io::Write;

/// `n` deterministic values in [-1, 1), different for every position and `salt` (a hash of the
/// two: no two tensors of a test share a pattern, and no RNG state is needed).
pub fn hashed_values(n: usize, salt: u64) -> Vec<f64> {
    (0..n as u64)
        .map(|i| {
            let h = (i.wrapping_add(salt.wrapping_mul(0x9E37_79B9_7F4A_7C15))).wrapping_mul(0xD1B5_4A32_D192_ED03);
            ((h >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        })
        .collect()
}

/// Something a test needs from the machine it runs on, and that some machines lack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// The all-MiniLM-L6-v2 weights under `data/models/` (fetched by `scripts/data/get_minilm.sh`).
    MiniLm,
    /// POSIX shared memory: a `/dev/shm` directory.
    DevShm,
    /// Network namespaces: root with CAP_NET_ADMIN and iproute2's `ip`.
    NetNs,
    /// PyTorch: torchrun and a Python that imports torch. Asked for with
    /// `ALLGRAD_WITH_TORCH=1`; never looked for without it.
    Torch,
    /// CUDA devices, one per rank.
    Gpu,
    /// The test's environment without an override of the named variable (the test checks the
    /// default the variable overrides).
    Unset(&'static str),
    /// A CPU with the named SIMD instruction set (`avx2`, `avx512`): a kernel's copy for it.
    Simd(&'static str),
    /// GNU tar on PATH (`tar --version` says GNU tar): an independent reader of written shards.
    Tar,
    /// MXNet 1.9.1 in its own Python environment, named by `ALLGRAD_MXNET_PYTHON`
    /// (`scripts/ci/get_mxnet.sh`): the writer of reference RecordIO files.
    Mxnet,
}

impl Need {
    /// The word that names this need in `ALLGRAD_REQUIRE` and in the skip lines.
    pub fn key(self) -> &'static str {
        match self {
            Need::MiniLm => "minilm",
            Need::DevShm => "shm",
            Need::NetNs => "netns",
            Need::Torch => "torch",
            Need::Gpu => "gpu",
            Need::Unset(_) => "env",
            Need::Simd(_) => "simd",
            Need::Tar => "tar",
            Need::Mxnet => "mxnet",
        }
    }

    /// What makes a test with this need run.
    pub fn runs_when(self) -> String {
        match self {
            Need::MiniLm => "data/models/all-MiniLM-L6-v2 exists: scripts/data/get_minilm.sh fetches it".into(),
            Need::DevShm => "the host has a /dev/shm directory".into(),
            Need::NetNs => "run as root with CAP_NET_ADMIN and iproute2 (`ip netns add` works)".into(),
            Need::Torch => "ALLGRAD_WITH_TORCH=1, with torchrun and a Python that imports torch \
                            (ALLGRAD_TORCHRUN / ALLGRAD_PYTHON, or on PATH; scripts/ci/get_torch.sh installs them)"
                .into(),
            Need::Gpu => "a CUDA build (--features cuda) on a machine with a CUDA device per rank".into(),
            Need::Unset(var) => format!("{var} is unset"),
            Need::Simd(set) => format!("the CPU has {set}"),
            Need::Tar => "GNU tar is on PATH (`tar --version` names GNU tar)".into(),
            Need::Mxnet => "ALLGRAD_MXNET_PYTHON names a Python with mxnet 1.9.1 (scripts/ci/get_mxnet.sh installs one)".into(),
        }
    }

    /// Whether the machine is supposed to provide this need, so that a skip for it is a
    /// failure: its key is listed in `ALLGRAD_REQUIRE` (comma-separated, e.g.
    /// `minilm,shm,netns,env`), or for [`Need::Torch`] `ALLGRAD_WITH_TORCH=1`, or for
    /// [`Need::Gpu`] `ALLGRAD_REQUIRE_GPU=1`.
    pub fn required(self) -> bool {
        let flag = |var: &str| std::env::var(var).is_ok_and(|v| v.trim() == "1");
        let listed =
            std::env::var("ALLGRAD_REQUIRE").is_ok_and(|v| v.split(',').any(|k| k.trim() == self.key() || k.trim() == "all"));
        listed
            || match self {
                Need::Torch => flag("ALLGRAD_WITH_TORCH"),
                Need::Gpu => flag("ALLGRAD_REQUIRE_GPU"),
                _ => false,
            }
    }
}

/// The running test, as `<binary>::<test>`: the test harness names each test's thread after
/// the test, and the binary is this executable's name without Cargo's hash.
pub fn current_test() -> String {
    let exe = std::env::current_exe().ok();
    let stem = exe.as_ref().and_then(|p| p.file_stem()).map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let binary = match stem.rsplit_once('-') {
        Some((name, hash)) if hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_hexdigit()) => name.to_string(),
        _ => stem,
    };
    let thread = std::thread::current();
    let test = thread.name().filter(|n| *n != "main").unwrap_or("(unnamed test thread)");
    format!("{binary}::{test}")
}

/// The line [`skip`] prints and records.
pub fn skip_line(test: &str, need: Need, reason: &str) -> String {
    format!("SKIPPED {test} [{}]: {reason} (runs when: {})", need.key(), need.runs_when())
}

/// Says that the running test does not run here because `need` is missing (`reason`: what
/// exactly is missing). Call it and return from the test:
///
/// ```no_run
/// use allgrad_testkit::{skip, Need};
/// # fn minilm() -> Option<std::path::PathBuf> { None }
/// let Some(dir) = minilm() else { return skip(Need::MiniLm, "data/models/all-MiniLM-L6-v2 is absent") };
/// # let _ = dir;
/// ```
///
/// Prints the skip line to stderr (uncaptured: it shows in `cargo test`'s output) and appends
/// it to `ALLGRAD_SKIP_LOG` when set.
///
/// # Panics
/// When `need` is [required](Need::required) here: the machine should have provided it, so
/// the test fails, saying what was missing.
pub fn skip(need: Need, reason: &str) {
    let test = current_test();
    if need.required() {
        panic!(
            "{test} cannot run: {reason}, but this machine is supposed to provide it \
             ([{}] is required by ALLGRAD_REQUIRE, ALLGRAD_WITH_TORCH or ALLGRAD_REQUIRE_GPU; runs when: {})",
            need.key(),
            need.runs_when()
        );
    }
    let line = skip_line(&test, need, reason);
    // Straight to the process's stderr, past the test harness's capture of `eprintln!`: a
    // skip shows in `cargo test`'s output although the test passes.
    let _ = std::io::stderr().lock().write_all(format!("{line}\n").as_bytes());
    if let Some(path) = std::env::var_os("ALLGRAD_SKIP_LOG").filter(|p| !p.is_empty()) {
        // One write of one line to a file opened for appending: lines of tests running at the
        // same time, in this or another process, do not interleave.
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(format!("{line}\n").as_bytes()));
        if let Err(e) = written {
            panic!("{test}: cannot record its skip in ALLGRAD_SKIP_LOG={}: {e}", std::path::Path::new(&path).display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_test_is_named_after_its_thread_and_binary() {
        let name = current_test();
        assert!(name.ends_with("::tests::the_test_is_named_after_its_thread_and_binary"), "{name}");
        assert!(name.starts_with("allgrad_testkit::"), "{name}");
    }

    #[test]
    fn the_skip_line_names_the_need_and_what_would_run_it() {
        let line = skip_line("bin::t", Need::Unset("ALLGRAD_TIMEOUT_S"), "ALLGRAD_TIMEOUT_S=3 is set");
        assert_eq!(line, "SKIPPED bin::t [env]: ALLGRAD_TIMEOUT_S=3 is set (runs when: ALLGRAD_TIMEOUT_S is unset)");
    }
}
