//! A crate outside the workspace that depends on allgrad with one line, `allgrad = { path }`,
//! and has no `[patch]` section: it resolves to the Candle that allgrad carries (no crates.io
//! candle-core or candle-nn anywhere in its graph), builds offline, and runs the README's
//! custom loss, which names its tensors through `allgrad::candle`.
//!
//! The crate is written into a temporary folder. It builds into this build's target directory,
//! with the workspace's profiles and a copy of its Cargo.lock: neither is needed for it to build,
//! they let it reuse the crates.io dependencies already built (see [`profiles`]).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use crate::common;

/// Building allgrad's own packages and its Candle once more, unoptimised (see [`profiles`]),
/// and linking: a few minutes on a 2-core machine, more on a busy one.
const BUILD_LIMIT: Duration = Duration::from_secs(1200);

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).canonicalize().unwrap()
}

/// The target directory this test binary was built in (target/<profile>/deps/repo-*).
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.ancestors().nth(3).unwrap().to_path_buf()
}

fn ok(what: &str, out: &Output) {
    assert!(
        out.status.success(),
        "{what} failed\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The first ```rust block of the README's "## Your own loss" section.
fn readme_custom_loss() -> String {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let section = &readme[readme.find("\n## Your own loss").expect("README has a `## Your own loss` section")..];
    let start = section.find("```rust\n").expect("the section has a ```rust block") + "```rust\n".len();
    let len = section[start..].find("```").unwrap();
    section[start..start + len].to_string()
}

/// The packages of allgrad's repository in the outside crate's graph (path dependencies).
const PATH_PACKAGES: &[&str] = &[
    "allgrad",
    "allgrad-candle-core",
    "allgrad-candle-nn",
    "allgrad-data",
    "allgrad-dist",
    "allgrad-models",
    "allgrad-nn",
    "allgrad-rng",
    "allgrad-train",
];

/// The workspace's `[profile.*]` sections, so that every crates.io dependency is built as the
/// workspace builds it (and its artefacts are reused), with allgrad's own packages unoptimised:
/// cargo hashes a path dependency's artefacts with its path relative to the workspace that builds
/// it, so this crate builds them once more in any case (once per target directory: the hash does
/// not depend on where this crate is), and unoptimised they build several times faster.
fn profiles() -> String {
    let manifest = std::fs::read_to_string(repo().join("Cargo.toml")).unwrap();
    let profiles = &manifest[manifest.find("\n[profile.").expect("the workspace's Cargo.toml has profiles")..];
    assert!(!profiles.contains("\n[dependencies") && !profiles.contains("\n[patch"), "profiles come last in Cargo.toml");
    let mut out = profiles.to_string();
    for p in PATH_PACKAGES {
        out.push_str(&format!("[profile.dev.package.{p}]\nopt-level = 0\n"));
    }
    out
}

#[test]
fn a_crate_with_only_the_allgrad_dependency_builds_offline_and_runs_the_readme_loss() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let dependency = format!("allgrad = {{ path = {:?} }}", repo().display().to_string());
    let manifest = format!(
        "[package]\nname = \"outside\"\nversion = \"0.1.0\"\nedition = \"2021\"\npublish = false\n\n\
         [dependencies]\n{dependency}\n\n\
         # A workspace of its own: the crate is not part of any folder above it.\n[workspace]\n{}",
        profiles()
    );
    assert!(!manifest.contains("[patch"), "{manifest}");
    std::fs::write(root.join("Cargo.toml"), &manifest).unwrap();
    std::fs::copy(repo().join("Cargo.lock"), root.join("Cargo.lock")).unwrap();
    std::fs::create_dir(root.join("src")).unwrap();
    let source = readme_custom_loss();
    assert!(source.contains("allgrad::candle::") && !source.contains("candle_core"), "{source}");
    std::fs::write(root.join("src/main.rs"), &source).unwrap();

    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let target = target_dir();
    let cargo_cmd = |args: &[&str]| {
        let mut c = Command::new(&cargo);
        c.current_dir(root).args(args).env("CARGO_TARGET_DIR", &target);
        c
    };

    // Its whole graph, as cargo resolves it offline: Candle only as allgrad carries it.
    let (out, _) = common::run_with_watchdog(
        &mut cargo_cmd(&["tree", "--offline", "--prefix", "none", "--edges", "normal,build"]),
        BUILD_LIMIT,
    );
    ok("cargo tree", &out);
    let tree = String::from_utf8_lossy(&out.stdout).into_owned();
    let packages: Vec<&str> = tree.lines().filter_map(|l| l.split_whitespace().next()).collect();
    let mut local: Vec<&str> = tree.lines().filter(|l| l.contains(" (/")).filter_map(|l| l.split_whitespace().next()).collect();
    local.sort();
    local.dedup();
    local.retain(|p| *p != "outside");
    assert_eq!(local, PATH_PACKAGES, "the repository's packages in the graph (update PATH_PACKAGES):\n{tree}");
    for p in &packages {
        assert!(*p != "candle-core" && *p != "candle-nn", "the graph pulls crates.io's {p}:\n{tree}");
    }

    let (out, took) = common::run_with_watchdog(&mut cargo_cmd(&["build", "--offline"]), BUILD_LIMIT);
    ok("cargo build --offline", &out);
    eprintln!("the outside crate built in {:.0} s", took.as_secs_f64());
    let lock = std::fs::read_to_string(root.join("Cargo.lock")).unwrap();
    assert!(!lock.contains("name = \"candle-core\"") && !lock.contains("name = \"candle-nn\""), "{lock}");

    let (out, _) = common::run_with_watchdog(&mut Command::new(target.join("debug/outside")), Duration::from_secs(120));
    ok("the README's custom loss", &out);
}
