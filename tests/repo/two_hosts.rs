//! More than one host without a second machine: two network namespaces joined by a veth
//! pair, each running `launch --nnodes 2` with 2 ranks, the way two hosts would. Needs root
//! with CAP_NET_ADMIN and iproute2's `ip`; without them each test skips, saying why
//! (`allgrad_testkit::skip`).
//!
//! - Collectives across the link are exact, shared memory is used inside a node (its ranks
//!   share a mount namespace, hence a /dev/shm) and not across nodes (`ip netns exec` gives
//!   each node its own mount namespace, so the ranks tell the hosts apart).
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

/// Two namespaces `<name>a` and `<name>b` with one veth pair between them; removed on drop.
struct TwoHosts {
    ns: [String; 2],
    ips: [String; 2],
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("cannot run ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

impl TwoHosts {
    /// The pair, or why it cannot be made here.
    fn create() -> Result<TwoHosts, String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("not root (network namespaces need CAP_NET_ADMIN)".into());
        }
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let pid = std::process::id();
        let name = format!("ag{}x{n}", pid % 100_000);
        let ns = [format!("{name}a"), format!("{name}b")];
        let net = format!("10.{}.{}", 64 + pid % 128, n % 250);
        let ips = [format!("{net}.1"), format!("{net}.2")];
        let hosts = TwoHosts { ns: ns.clone(), ips: ips.clone() };
        ip(&["netns", "add", &ns[0]])?;
        ip(&["netns", "add", &ns[1]])?;
        let (va, vb) = (format!("{name}a"), format!("{name}b"));
        ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb])?;
        for (dev, (ns, addr)) in [&va, &vb].into_iter().zip(ns.iter().zip(&ips)) {
            ip(&["link", "set", dev, "netns", ns])?;
            ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(hosts)
    }

    /// `launch` as node `node` of 2 (2 ranks each), inside that node's namespace.
    fn launch(&self, node: usize, port: u16, program: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns[node], env!("CARGO_BIN_EXE_launch")])
            .args(["--nnodes", "2", "--node-rank", &node.to_string(), "--nproc-per-node", "2"])
            .args(["--master-addr", &self.ips[0], "--master-port", &port.to_string()])
            .args(program)
            .env("ALLGRAD_JOB_TOKEN", format!("two-hosts-{}", std::process::id()))
            .env("ALLGRAD_TIMEOUT_S", "30");
        c
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        // Deleting a namespace deletes the veth end inside it, and with it the pair.
        for ns in &self.ns {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

/// The two hosts, or `None` after [`allgrad_testkit::skip`] said why they cannot be made here.
fn hosts_or_skip() -> Option<TwoHosts> {
    match TwoHosts::create() {
        Ok(h) => Some(h),
        Err(why) => {
            allgrad_testkit::skip(allgrad_testkit::Need::NetNs, &format!("cannot make two network namespaces here: {why}"));
            None
        }
    }
}

/// Runs both nodes of `program` and returns (node 0's output, node 1's output, their times).
fn both(hosts: &TwoHosts, program: &[&str], limit: Duration) -> [(Output, Duration); 2] {
    let port = allgrad::launch::free_port().unwrap();
    let b = spawn_watched(&mut hosts.launch(1, port, program), "node 1", limit);
    let a = spawn_watched(&mut hosts.launch(0, port, program), "node 0", limit);
    [a.wait(), b.wait()]
}

fn text(o: &Output) -> String {
    format!("stdout:\n{}\nstderr:\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn collectives_across_two_hosts_are_exact_and_use_shared_memory_only_inside_a_node() {
    let Some(hosts) = hosts_or_skip() else { return };
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
    let Some(hosts) = hosts_or_skip() else { return };
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
    let Some(hosts) = hosts_or_skip() else { return };
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
