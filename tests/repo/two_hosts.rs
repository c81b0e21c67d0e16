//! More than one host without a second machine: network namespaces joined by a bridge (one veth
//! pair from each into a bridge in a namespace of its own), each running `launch --nnodes K`
//! with 2 ranks, the way K hosts would. Needs root with CAP_NET_ADMIN and iproute2's `ip`;
//! without them each test skips, saying why (`allgrad_testkit::skip`).
//!
//! - Collectives across the link are exact, shared memory is used inside a node (its ranks
//!   share a mount namespace, hence a /dev/shm) and not across nodes (`ip netns exec` gives
//!   each node its own mount namespace, so the ranks tell the hosts apart): with two hosts and
//!   with four.
//! - A 4-rank training run across the two "hosts" ends bit for bit where a 4-rank run on one
//!   host ends.
//! - When a rank of one node dies, the other node's ranks fail with an error, promptly, and
//!   its launcher exits non-zero.

use std::path::Path;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::common::{self, example, run_with_watchdog, spawn_watched};

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// Namespaces `<name>0` .. `<name>{K-1}`, each with a veth interface into one bridge in the
/// namespace `<name>br`; removed on drop.
struct Hosts {
    ns: Vec<String>,
    ips: Vec<String>,
    bridge: String,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("cannot run ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

impl Hosts {
    /// `k` hosts, or why they cannot be made here.
    fn create(k: usize) -> Result<Hosts, String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("not root (network namespaces need CAP_NET_ADMIN)".into());
        }
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let pid = std::process::id();
        // At most 10 characters, so that "<name>h<k>" fits an interface name (15).
        let name = format!("ag{}x{n}", pid % 100_000);
        let net = format!("10.{}.{}", 64 + pid % 128, n % 250);
        let hosts = Hosts {
            ns: (0..k).map(|i| format!("{name}{i}")).collect(),
            ips: (1..=k).map(|i| format!("{net}.{i}")).collect(),
            bridge: format!("{name}br"),
        };
        ip(&["netns", "add", &hosts.bridge])?;
        ip(&["-n", &hosts.bridge, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &hosts.bridge, "link", "set", "br0", "up"])?;
        for (i, (ns, addr)) in hosts.ns.iter().zip(&hosts.ips).enumerate() {
            let (dev, port) = (format!("{name}h{i}"), format!("{name}b{i}"));
            ip(&["netns", "add", ns])?;
            ip(&["link", "add", &dev, "type", "veth", "peer", "name", &port])?;
            ip(&["link", "set", &dev, "netns", ns])?;
            ip(&["link", "set", &port, "netns", &hosts.bridge])?;
            ip(&["-n", &hosts.bridge, "link", "set", &port, "master", "br0"])?;
            ip(&["-n", &hosts.bridge, "link", "set", &port, "up"])?;
            ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", &dev])?;
            ip(&["-n", ns, "link", "set", &dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(hosts)
    }

    /// `launch` as node `node` of all (2 ranks each), inside that node's namespace.
    fn launch(&self, node: usize, port: u16, program: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns[node], env!("CARGO_BIN_EXE_launch")])
            .args(["--nnodes", &self.ns.len().to_string(), "--node-rank", &node.to_string(), "--nproc-per-node", "2"])
            .args(["--master-addr", &self.ips[0], "--master-port", &port.to_string()])
            .args(program)
            .env("ALLGRAD_JOB_TOKEN", format!("hosts-{}", std::process::id()))
            .env("ALLGRAD_TIMEOUT_S", "30");
        c
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        // Deleting a namespace deletes the veth end inside it, and with it the pair.
        for ns in self.ns.iter().chain([&self.bridge]) {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

/// `k` hosts, or `None` after [`allgrad_testkit::skip`] said why they cannot be made here.
fn hosts_or_skip(k: usize) -> Option<Hosts> {
    match Hosts::create(k) {
        Ok(h) => Some(h),
        Err(why) => {
            allgrad_testkit::skip(allgrad_testkit::Need::NetNs, &format!("cannot make {k} network namespaces here: {why}"));
            None
        }
    }
}

/// Runs every node of `program` and returns each node's output and time, node 0 first.
fn all_nodes(hosts: &Hosts, program: &[&str], limit: Duration) -> Vec<(Output, Duration)> {
    let port = allgrad::launch::free_port().unwrap();
    // The other nodes first, node 0 (the store's) last, as in the two-host runs.
    let others: Vec<_> =
        (1..hosts.ns.len()).map(|k| spawn_watched(&mut hosts.launch(k, port, program), &format!("node {k}"), limit)).collect();
    let a = spawn_watched(&mut hosts.launch(0, port, program), "node 0", limit);
    let mut out = vec![a.wait()];
    out.extend(others.into_iter().map(|w| w.wait()));
    out
}

/// Runs both nodes of `program` and returns (node 0's output, node 1's output, their times).
fn both(hosts: &Hosts, program: &[&str], limit: Duration) -> [(Output, Duration); 2] {
    let mut v = all_nodes(hosts, program, limit);
    let b = v.pop().unwrap();
    [v.pop().unwrap(), b]
}

fn text(o: &Output) -> String {
    format!("stdout:\n{}\nstderr:\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn collectives_across_two_hosts_are_exact_and_use_shared_memory_only_inside_a_node() {
    let Some(hosts) = hosts_or_skip(2) else { return };
    let probe = example("host_probe");
    let [(a, _), (b, _)] = both(&hosts, &[probe.to_str().unwrap()], Duration::from_secs(120));
    assert!(a.status.success() && b.status.success(), "node 0:\n{}\nnode 1:\n{}", text(&a), text(&b));
    let out = format!("{}{}", String::from_utf8_lossy(&a.stdout), String::from_utf8_lossy(&b.stdout));
    for rank in 0..4 {
        let line =
            format!("rank {rank} node {}: world shm=false node shm=true; all_reduce and all_gather exact in both", rank / 2);
        assert!(out.contains(&line), "missing {line:?} in:\n{out}");
    }
}

#[test]
fn training_across_two_hosts_ends_bitwise_where_one_host_does() {
    let Some(hosts) = hosts_or_skip(2) else { return };
    let d = tempfile::tempdir().unwrap();
    let config = d.path().join("run.yaml");
    let run_config = "train: {global_batch: 24, epochs: 4}\ncheckpoint: {every: 4, keep_last: 1}\nlog: {every: 1, progress: quiet, plot: false}\n";
    std::fs::write(&config, common::vectors_config(run_config)).unwrap();
    let run = |dir: &Path| {
        vec![
            env!("CARGO_BIN_EXE_train").to_string(),
            "--config".into(),
            config.display().to_string(),
            "--output-dir".into(),
            dir.display().to_string(),
        ]
    };
    let one_host = d.path().join("one-host");
    let mut single = Command::new(env!("CARGO_BIN_EXE_launch"));
    single.args(["--nproc-per-node", "4"]).args(run(&one_host));
    let (o, _) = run_with_watchdog(&mut single, Duration::from_secs(120));
    assert!(o.status.success(), "{}", text(&o));

    let two_hosts = d.path().join("two-hosts");
    let program = run(&two_hosts);
    let program: Vec<&str> = program.iter().map(|s| s.as_str()).collect();
    let [(a, _), (b, _)] = both(&hosts, &program, Duration::from_secs(120));
    assert!(a.status.success() && b.status.success(), "node 0:\n{}\nnode 1:\n{}", text(&a), text(&b));
    let model = |dir: &Path| std::fs::read(dir.join("checkpoints/step_16/model.safetensors")).expect("a final checkpoint");
    assert!(model(&one_host) == model(&two_hosts), "the two-host run's parameters differ from the one-host run's");
}

#[test]
fn a_rank_dying_on_one_host_fails_the_other_hosts_ranks_promptly() {
    let Some(hosts) = hosts_or_skip(2) else { return };
    // Rank 3 (node 1) kills itself with SIGKILL at its 4th all_reduce.
    let drill = example("failure_drill");
    let [(a, ta), (b, _)] = both(&hosts, &[drill.to_str().unwrap(), "3"], Duration::from_secs(60));
    assert!(!a.status.success() && !b.status.success(), "node 0:\n{}\nnode 1:\n{}", text(&a), text(&b));
    let err = String::from_utf8_lossy(&a.stderr);
    // Node 0's ranks learn it from the network (rank 2 relays nothing: it may die first).
    assert!(err.contains("failed after"), "node 0's ranks did not report the failure:\n{err}");
    assert!(ta < Duration::from_secs(20), "node 0 took {ta:?} to stop (its timeout is 30 s):\n{err}");
    assert!(String::from_utf8_lossy(&b.stderr).contains("rank 3 exited with code 137"), "{}", text(&b));
}

#[test]
fn collectives_across_four_hosts_are_exact_and_use_shared_memory_only_inside_each() {
    let Some(hosts) = hosts_or_skip(4) else { return };
    let probe = example("host_probe");
    let nodes = all_nodes(&hosts, &[probe.to_str().unwrap()], Duration::from_secs(120));
    let all: String = nodes.iter().enumerate().map(|(k, (o, _))| format!("node {k}:\n{}\n", text(o))).collect();
    assert!(nodes.iter().all(|(o, _)| o.status.success()), "{all}");
    let out: String = nodes.iter().map(|(o, _)| String::from_utf8_lossy(&o.stdout).into_owned()).collect();
    for rank in 0..8 {
        let line =
            format!("rank {rank} node {}: world shm=false node shm=true; all_reduce and all_gather exact in both", rank / 2);
        assert!(out.contains(&line), "missing {line:?} in:\n{all}");
    }
}
