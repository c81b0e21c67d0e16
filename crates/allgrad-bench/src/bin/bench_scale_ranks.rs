//! `bench_scale_ranks`: what one job of W ranks (processes) costs allgrad's control plane on
//! one machine: starting the processes and, apart from it, forming the group once the last
//! one has started; latency of small and 1 MiB collectives, the frames each call exchanges,
//! file descriptors, threads and memory per rank, and how long the survivors take to name a
//! SIGKILLed rank.
//!
//! ```text
//! cargo run --release -p allgrad-bench --bin bench_scale_ranks -- --nproc 128 \
//!     [--nnodes 4 [--node-netns h0,h1,h2,h3 --master-addr 10.231.0.1]] [--iters 20] \
//!     [--time-limit-s 600] [--no-kill] [--start-only] [--json rows.jsonl]
//! ```
//!
//! Run without RANK it is the harness: it starts `--nnodes` launchers (itself again, each
//! calling `allgrad::launch` for its node's `--nproc / --nnodes` ranks with the same master
//! address, port and job token, as separate hosts would), waits for them at most
//! `--time-limit-s`, then reads the report every rank wrote and prints one row.
//!
//! Several nodes on one machine, two ways:
//! - `--node-netns` (root): node k's launcher runs under `ip netns exec` in the k-th network
//!   namespace (`scripts/bench/netns_hosts.sh` makes them, joined by a bridge), and rank 0's
//!   store listens on `--master-addr`, node 0's address. The ranks of a node reach each other
//!   over the namespace's loopback and share memory; the nodes reach each other only through
//!   their addresses on the bridge. A group decides whether its members share a host from the
//!   kernel's boot id, the host name and the mount namespace (`cpu/shm/setup.rs`), and `ip netns
//!   exec` gives each launcher a mount namespace of its own: the world group, which spans
//!   nodes, talks TCP, and each node's group (`new_group` of its ranks, measured too) uses
//!   shared memory. Every rank reports which of its groups use it, and the row says whether
//!   that held on every rank.
//! - without it (no root needed): every node on the one loopback, with ALLGRAD_SHM=0, since
//!   all the ranks then share the host and only turning shared memory off keeps the nodes on
//!   TCP to each other (node groups are not measured then: they would not use shared memory).
//!
//! Each rank: joins the job (`ProcessGroup::from_env`), runs one barrier, counts its open file
//! descriptors, connections, threads and memory (rank 0 also the store connections it serves;
//! descriptors and connections are counted again after the collectives, and the row shows rank 0
//! apart from the median and max, as it serves the store), times `--iters` calls of each
//! measured collective (the max over ranks of the mean per call; frames per call from the
//! group's counters; for the 4-byte all_reduce also each call's time on its slowest rank, whose
//! median and 90th percentile the row shows), with `--node-netns` the same on its node's group,
//! writes its report, then (unless `--no-kill`) enters a 4-byte all_reduce that rank `--victim`
//! (by default W/2, the first rank of node K/2) never joins: the victim sleeps a moment, notes
//! the time and SIGKILLs itself; every survivor notes when its all_reduce failed and whether the
//! error names the victim, and the row counts them per node. Survivors
//! ignore SIGTERM in this last phase, so that the launcher stopping the job after the victim's
//! death does not cut the measurement short (they are SIGKILLed at the time limit).
//!
//! Times are wall-clock (`CLOCK_REALTIME`, one machine), from the moment the harness started
//! the launchers. Each rank notes when the launcher forked it (its start time in
//! `/proc/self/stat`, to the kernel's clock tick, 10 ms on most systems), when its `main` ran,
//! when its group was formed and when its first barrier was done. The row shows the
//! start (first to last rank forked and started, fork to `main` per rank) apart from the
//! group's formation after the last rank started: while the later ranks are being started the
//! earlier ones already connect to each other, so a start that takes long may be the
//! formation's work competing with it. `--start-only` tells them apart: its ranks note their
//! start and exit without joining, so the row is the cost of starting W processes alone.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use allgrad_dist::{ProcessGroup, ReduceOp};
use anyhow::{bail, Context, Result};
use clap::Parser;

/// Environment of the ranks and node launchers (set by the harness).
const ENV_T0: &str = "ALLGRAD_SCALE_T0_NS";
const ENV_OUT: &str = "ALLGRAD_SCALE_OUT";
const ENV_NODE: &str = "ALLGRAD_SCALE_NODE";
const ENV_PORT: &str = "ALLGRAD_SCALE_PORT";

#[derive(Parser, Clone, Debug)]
#[command(name = "bench_scale_ranks", about = "allgrad's control plane at W ranks (processes) on one machine")]
struct Args {
    /// Ranks in the job (all nodes together).
    #[arg(long, default_value_t = 8)]
    nproc: usize,
    /// Simulated nodes (launchers); must divide --nproc. Above 1 without --node-netns, ranks
    /// use TCP only (ALLGRAD_SHM=0).
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// One network namespace per node, comma-separated: node k's launcher runs in the k-th
    /// (`ip netns exec`, needs root), shared memory inside a node and TCP between nodes.
    #[arg(long, value_delimiter = ',')]
    node_netns: Vec<String>,
    /// Address of rank 0's store: node 0's address on the namespaces' bridge with
    /// --node-netns, loopback without.
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Timed calls per measured collective (after 2 untimed ones).
    #[arg(long, default_value_t = 20)]
    iters: u64,
    /// Seconds the whole job may take before every process is killed.
    #[arg(long, default_value_t = 600.0)]
    time_limit_s: f64,
    /// Skip the kill phase.
    #[arg(long)]
    no_kill: bool,
    /// The rank that SIGKILLs itself in the kill phase (default W/2).
    #[arg(long)]
    victim: Option<usize>,
    /// Ranks note when they were forked and started, and exit without joining the group: the
    /// cost of starting W processes through the launcher alone.
    #[arg(long)]
    start_only: bool,
    /// Folder for the ranks' reports (default: a new temporary folder, removed at the end).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Also append the row as a JSON line to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

impl Args {
    /// Whether each node runs in a network namespace of its own, hence its own host, and its
    /// node's group is measured (with shared memory) beside the world group.
    fn hosts(&self) -> bool {
        self.nnodes > 1 && !self.node_netns.is_empty()
    }
}

fn main() {
    let args = Args::parse();
    let res = if std::env::var_os("RANK").is_some() {
        rank_main(&args)
    } else if let Ok(node) = std::env::var(ENV_NODE) {
        node_main(&args, &node)
    } else {
        harness(&args)
    };
    if let Err(e) = res {
        let who = std::env::var("RANK").map(|r| format!("[rank {r}] ")).unwrap_or_default();
        eprintln!("{who}error: {e:#}");
        std::process::exit(1);
    }
}

fn now_ns() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0)
}

// ------------------------------------------------------------------------------ harness

fn harness(args: &Args) -> Result<()> {
    let w = args.nproc;
    if w < 2 || args.nnodes == 0 || !w.is_multiple_of(args.nnodes) {
        bail!("--nproc ({w}) must be at least 2 and a multiple of --nnodes ({})", args.nnodes);
    }
    let victim = args.victim.unwrap_or(w / 2);
    if victim == 0 || victim >= w {
        bail!("--victim {victim} must be a rank in 1..{w} (rank 0 hosts the store)");
    }
    if !args.node_netns.is_empty() && args.node_netns.len() != args.nnodes {
        bail!("--node-netns names {} namespace(s) for --nnodes {}: one per node", args.node_netns.len(), args.nnodes);
    }
    let (out, temp) = match &args.out {
        Some(p) => (p.clone(), false),
        None => (std::env::temp_dir().join(format!("allgrad-scale-{}-{w}", std::process::id())), true),
    };
    if out.exists() {
        std::fs::remove_dir_all(&out).with_context(|| format!("clearing {}", out.display()))?;
    }
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let port = allgrad::launch::free_port()?;
    let token = format!("{:032x}", rand_u128());
    let exe = std::env::current_exe()?;
    let listen_before = listen_counters(&args.node_netns);
    let t0 = now_ns();
    let mut nodes: Vec<Child> = Vec::new();
    for node in 0..args.nnodes {
        let mut cmd = match args.node_netns.get(node) {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        cmd.args(std::env::args().skip(1))
            .env(ENV_NODE, node.to_string())
            .env(ENV_PORT, port.to_string())
            .env(ENV_T0, t0.to_string())
            .env(ENV_OUT, &out)
            .env("ALLGRAD_JOB_TOKEN", &token)
            .env("ALLGRAD_SCALE_VICTIM", victim.to_string());
        if args.nnodes > 1 && args.node_netns.is_empty() {
            cmd.env("ALLGRAD_SHM", "0");
        }
        nodes.push(cmd.spawn().with_context(|| format!("starting the launcher of node {node}"))?);
    }
    let limit = Duration::from_secs_f64(args.time_limit_s);
    let start = Instant::now();
    let mut timed_out = false;
    let slab_before = slab_kb();
    let mut slab_max = slab_before;
    loop {
        slab_max = slab_max.max(slab_kb());
        let running = nodes.iter_mut().filter_map(|c| matches!(c.try_wait(), Ok(None)).then_some(())).count();
        if running == 0 {
            break;
        }
        if start.elapsed() > limit {
            timed_out = true;
            for c in &nodes {
                // SIGTERM reaches each launcher's ranks; SIGKILL follows.
                unsafe { libc::kill(c.id() as libc::pid_t, libc::SIGTERM) };
            }
            std::thread::sleep(Duration::from_secs(5));
            for c in nodes.iter_mut() {
                let _ = c.kill();
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    for c in nodes.iter_mut() {
        let _ = c.wait();
    }
    let row = summarise(&out, args, victim, timed_out, start.elapsed())?;
    println!("{row}");
    if let (Some(a), Some(b)) = (slab_before, slab_max) {
        // Host-wide too: the kernel's share of the job (sockets above all), plus whatever else ran.
        println!(
            "   the host's slab memory grew by up to {:.1} MiB during the job (kernel memory: sockets, ...)",
            b.saturating_sub(a) as f64 / 1024.0
        );
    }
    if let (Some(a), Some(b)) = (listen_before, listen_counters(&args.node_netns)) {
        // Namespace-wide (every node's namespace with --node-netns): other programs' connections count too.
        println!(
            "   listen queue overflows during the job: {} (ListenOverflows), {} SYNs dropped (ListenDrops)",
            b.0.saturating_sub(a.0),
            b.1.saturating_sub(a.1)
        );
    }
    if let Some(p) = &args.json {
        let mut f =
            std::fs::OpenOptions::new().create(true).append(true).open(p).with_context(|| format!("opening {}", p.display()))?;
        writeln!(f, "{}", row_json(&out, args, victim, timed_out)?)?;
    }
    if temp {
        let _ = std::fs::remove_dir_all(&out);
    }
    Ok(())
}

/// The kernel's slab memory (kB), from /proc/meminfo.
fn slab_kb() -> Option<u64> {
    field(&std::fs::read_to_string("/proc/meminfo").ok()?, "Slab:")
}

/// The kernel's TcpExt ListenOverflows and ListenDrops counters (connections refused because a
/// listener's accept queue was full), from /proc/net/netstat: this network namespace's, or the
/// sum over `namespaces` (each keeps its own counters; read through `ip netns exec`).
fn listen_counters(namespaces: &[String]) -> Option<(u64, u64)> {
    if namespaces.is_empty() {
        return parse_listen_counters(&std::fs::read_to_string("/proc/net/netstat").ok()?);
    }
    let mut sum = (0, 0);
    for ns in namespaces {
        let out = Command::new("ip").args(["netns", "exec", ns, "cat", "/proc/net/netstat"]).output().ok()?;
        let (o, d) = parse_listen_counters(&String::from_utf8_lossy(&out.stdout))?;
        sum = (sum.0 + o, sum.1 + d);
    }
    Some(sum)
}

fn parse_listen_counters(text: &str) -> Option<(u64, u64)> {
    let mut lines = text.lines().filter(|l| l.starts_with("TcpExt:"));
    let (names, values) = (lines.next()?, lines.next()?);
    let pairs: BTreeMap<&str, u64> =
        names.split_whitespace().zip(values.split_whitespace()).filter_map(|(n, v)| Some((n, v.parse().ok()?))).collect();
    Some((*pairs.get("ListenOverflows")?, *pairs.get("ListenDrops")?))
}

fn rand_u128() -> u128 {
    let mut b = [0u8; 16];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        use std::io::Read;
        let _ = f.read_exact(&mut b);
    }
    u128::from_le_bytes(b) ^ now_ns()
}

/// One node's launcher: `allgrad::launch` for its share of the ranks.
fn node_main(args: &Args, node: &str) -> Result<()> {
    let node: usize = node.parse().context("node index")?;
    let port: u16 = std::env::var(ENV_PORT).context("master port")?.parse()?;
    let exe = std::env::current_exe()?;
    let mut program = vec![exe.to_string_lossy().into_owned()];
    program.extend(std::env::args().skip(1));
    let cfg = allgrad::launch::LaunchConfig {
        nnodes: args.nnodes,
        node_rank: node,
        master_addr: args.master_addr.clone(),
        master_port: port,
        prefix: true,
        // Survivors of the kill phase ignore SIGTERM; they end on their own, or at the limit.
        grace: Duration::from_secs_f64(args.time_limit_s),
        ..allgrad::launch::LaunchConfig::new(args.nproc / args.nnodes, program)
    };
    let outcome = allgrad::launch::launch(&cfg)?;
    std::process::exit(outcome.exit_code());
}

/// Reads every rank's report (`key value` lines).
fn reports(out: &Path, w: usize) -> Vec<Option<BTreeMap<String, String>>> {
    (0..w)
        .map(|r| {
            let text = std::fs::read_to_string(out.join(format!("rank-{r}.txt"))).ok()?;
            Some(text.lines().filter_map(|l| l.split_once(' ')).map(|(k, v)| (k.to_string(), v.to_string())).collect())
        })
        .collect()
}

fn num(m: &BTreeMap<String, String>, k: &str) -> Option<f64> {
    m.get(k).and_then(|v| v.parse().ok())
}

struct Stats {
    min: f64,
    median: f64,
    max: f64,
    n: usize,
}

fn stats(mut v: Vec<f64>) -> Option<Stats> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    Some(Stats { min: v[0], median: v[v.len() / 2], max: v[v.len() - 1], n: v.len() })
}

fn column(reps: &[Option<BTreeMap<String, String>>], k: &str) -> Vec<f64> {
    reps.iter().flatten().filter_map(|m| num(m, k)).collect()
}

/// The measured collectives: name, report key.
const MEASURED: [(&str, &str); 4] = [
    ("all_reduce 4 B", "ar4"),
    ("all_reduce 1 MiB", "ar1m"),
    ("all_gather 4 B per rank", "ag4"),
    ("all_gather 1 MiB out", "ag1m"),
];

/// Those measured again on each node's own group when there are several nodes (report keys
/// prefixed `node_`).
const NODE_MEASURED: [(&str, &str); 2] = [("node group: all_reduce 4 B", "ar4"), ("node group: all_reduce 1 MiB", "ar1m")];

fn summarise(out: &Path, args: &Args, victim: usize, timed_out: bool, took: Duration) -> Result<String> {
    let w = args.nproc;
    let reps = reports(out, w);
    let have = reps.iter().filter(|r| r.is_some()).count();
    let mut s = String::new();
    writeln!(
        s,
        "== allgrad, W = {w} ranks, {} node(s){}{}",
        args.nnodes,
        match (args.nnodes > 1, args.node_netns.is_empty()) {
            (false, _) => "",
            (true, true) => " on one loopback, ALLGRAD_SHM=0",
            (true, false) => ", a network namespace each (shared memory inside a node, TCP between nodes)",
        },
        if args.start_only { ", start only (the ranks exit without joining)" } else { "" }
    )?;
    writeln!(
        s,
        "   reports: {have} of {w} ranks; harness wall time {:.1} s{}",
        took.as_secs_f64(),
        if timed_out { " (TIME LIMIT hit)" } else { "" }
    )?;
    let show = |s: &mut String, label: &str, k: &str, scale: f64, unit: &str| -> Result<()> {
        if let Some(st) = stats(column(&reps, k).into_iter().map(|x| x * scale).collect()) {
            writeln!(
                s,
                "   {label:<34} min {:>10.3}  median {:>10.3}  max {:>10.3} {unit} ({} ranks)",
                st.min, st.median, st.max, st.n
            )?;
        } else {
            writeln!(s, "   {label:<34} (no rank reported it)")?;
        }
        Ok(())
    };
    show(&mut s, "process forked (since harness)", "forked_s", 1.0, "s")?;
    show(&mut s, "process started (since harness)", "started_s", 1.0, "s")?;
    if let Some(st) = stats(fork_to_main(&reps)) {
        writeln!(
            s,
            "   {:<34} min {:>10.3}  median {:>10.3}  max {:>10.3} s ({} ranks)",
            "fork to main, per rank", st.min, st.median, st.max, st.n
        )?;
    }
    if let (Some(f), Some(st)) = (stats(column(&reps, "forked_s")), stats(column(&reps, "started_s"))) {
        writeln!(
            s,
            "   {:<34} forked over {:.3} s ({:.2} ms per rank), started over {:.3} s ({:.2} ms per rank)",
            "start, first to last rank",
            f.max - f.min,
            (f.max - f.min) * 1e3 / (f.n.max(2) - 1) as f64,
            st.max - st.min,
            (st.max - st.min) * 1e3 / (st.n.max(2) - 1) as f64
        )?;
    }
    if args.start_only {
        return Ok(s.trim_end().to_string());
    }
    show(&mut s, "group formed (since harness)", "formed_s", 1.0, "s")?;
    show(&mut s, "first barrier done (since harness)", "ready_s", 1.0, "s")?;
    for (label, k) in [("group formed after the last start", "formed_s"), ("first barrier after the last start", "ready_s")] {
        match after_last_start(&reps, k) {
            Some(st) => writeln!(
                s,
                "   {label:<34} min {:>10.3}  median {:>10.3}  max {:>10.3} s ({} ranks)",
                st.min, st.median, st.max, st.n
            )?,
            None => writeln!(s, "   {label:<34} (not every rank reported its start)")?,
        }
    }
    // Rank 0 apart: it serves the store too.
    let rank0 = |k: &str| reps[0].as_ref().and_then(|m| num(m, k));
    let show0 = |s: &mut String, label: &str, k: &str| -> Result<()> {
        match (stats(column(&reps, k)), rank0(k)) {
            (Some(st), r0) => writeln!(
                s,
                "   {label:<34} min {:>10.0}  median {:>10.0}  max {:>10.0}  rank 0 {:>6} ({} ranks)",
                st.min,
                st.median,
                st.max,
                r0.map_or("?".to_string(), |v| format!("{v:.0}")),
                st.n
            )?,
            (None, _) => writeln!(s, "   {label:<34} (no rank reported it)")?,
        }
        Ok(())
    };
    show0(&mut s, "open fds after forming", "fds")?;
    show0(&mut s, "open fds after the collectives", "fds_end")?;
    show0(&mut s, "connections to peers", "conns")?;
    show0(&mut s, "connections to peers at the end", "conns_end")?;
    for (label, k) in
        [("store connections, after forming", "store_conns"), ("the same, after the collectives", "store_conns_end")]
    {
        if let Some(v) = rank0(k) {
            writeln!(s, "   {label:<34} {v:.0} (served by rank 0)")?;
        }
    }
    show(&mut s, "threads", "threads", 1.0, "")?;
    show(&mut s, "RSS (shared pages counted whole)", "rss_kb", 1.0 / 1024.0, "MiB")?;
    show(&mut s, "PSS (shared pages split)", "pss_kb", 1.0 / 1024.0, "MiB")?;
    show(&mut s, "private memory (USS)", "uss_kb", 1.0 / 1024.0, "MiB")?;
    show(&mut s, "PSS after the collectives", "pss_end_kb", 1.0 / 1024.0, "MiB")?;
    show(&mut s, "frames to form the group", "form_frames", 1.0, "")?;
    if args.hosts() {
        let on = |k: &str| column(&reps, k).iter().filter(|x| **x == 1.0).count();
        writeln!(
            s,
            "   {:<34} world group on {} of {have} ranks, node groups on {} of {have}",
            "shared memory",
            on("shm"),
            on("node_shm")
        )?;
        show(&mut s, "node group formed in", "node_form_s", 1.0, "s")?;
    }
    let measured = MEASURED.iter().map(|(l, k)| (*l, k.to_string()));
    let node = NODE_MEASURED.iter().map(|(l, k)| (*l, format!("node_{k}"))).filter(|_| args.hosts());
    for (label, k) in measured.chain(node) {
        let k = k.as_str();
        // Every rank reports the same max-over-ranks figure; rank 0's is the row.
        let t = reps[0].as_ref().and_then(|m| num(m, &format!("{k}_us")));
        let f = stats(column(&reps, &format!("{k}_frames")));
        match (t, f) {
            (Some(t), Some(f)) => writeln!(
                s,
                "   {label:<34} {t:>12.1} us per call; frames per call per rank: median {:.1}, max {:.1}",
                f.median, f.max
            )?,
            _ => writeln!(s, "   {label:<34} (not measured)")?,
        }
        let call = |q: &str| reps[0].as_ref().and_then(|m| num(m, &format!("{k}_call_us_{q}")));
        if let (Some(m), Some(p)) = (call("median"), call("p90")) {
            writeln!(s, "   {:<34} {m:>12.1} us median, {p:.1} us p90 (each call's slowest rank)", "")?;
        }
    }
    if !args.no_kill && !args.start_only {
        let kill = reps.get(victim).and_then(|r| r.as_ref()).and_then(|m| num(m, "kill_ns"));
        let det: Vec<f64> = column(&reps, "detect_ns");
        let named = column(&reps, "named_victim").iter().filter(|x| **x == 1.0).count();
        let survivors = w - 1;
        match kill {
            Some(k) => {
                let lat = stats(det.iter().map(|d| (d - k) / 1e6).collect());
                match lat {
                    Some(st) => writeln!(
                        s,
                        "   rank {victim} SIGKILLed: {} of {survivors} survivors failed, {named} naming it; after min {:.1} median {:.1} max {:.1} ms",
                        st.n, st.min, st.median, st.max
                    )?,
                    None => writeln!(s, "   rank {victim} SIGKILLed: no survivor reported a failure")?,
                }
                if args.nnodes > 1 {
                    let per = naming_per_node(&reps, args.nnodes, victim);
                    let all = per.iter().filter(|(named, of)| named == of).count();
                    let list: Vec<String> = per.iter().map(|(named, of)| format!("{named}/{of}")).collect();
                    writeln!(
                        s,
                        "   survivors naming it, per node (victim on node {}): {}; every survivor on {all} of {} nodes",
                        victim / (w / args.nnodes),
                        list.join(" "),
                        args.nnodes
                    )?;
                }
            }
            None => writeln!(s, "   kill phase: rank {victim} did not reach it")?,
        }
    }
    Ok(s.trim_end().to_string())
}

/// Per node, (survivors whose error named the victim, survivors): ranks are numbered node by
/// node, `W / nnodes` each.
fn naming_per_node(reps: &[Option<BTreeMap<String, String>>], nnodes: usize, victim: usize) -> Vec<(usize, usize)> {
    let per_node = reps.len() / nnodes;
    (0..nnodes)
        .map(|node| {
            let ranks = (node * per_node..(node + 1) * per_node).filter(|r| *r != victim);
            let named = ranks.clone().filter(|r| reps[*r].as_ref().and_then(|m| num(m, "named_victim")) == Some(1.0)).count();
            (named, ranks.count())
        })
        .collect()
}

/// Per rank, from the launcher's fork to its `main` (seconds).
fn fork_to_main(reps: &[Option<BTreeMap<String, String>>]) -> Vec<f64> {
    reps.iter().flatten().filter_map(|m| Some(num(m, "started_s")? - num(m, "forked_s")?)).collect()
}

/// Per rank, the time of `key` after the last rank's `main` ran (seconds); `None` unless every
/// rank reported its start (the last start is not known otherwise).
fn after_last_start(reps: &[Option<BTreeMap<String, String>>], key: &str) -> Option<Stats> {
    let starts = column(reps, "started_s");
    if starts.len() != reps.len() {
        return None;
    }
    let last = starts.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    stats(column(reps, key).into_iter().map(|t| t - last).collect())
}

fn row_json(out: &Path, args: &Args, victim: usize, timed_out: bool) -> Result<String> {
    let w = args.nproc;
    let reps = reports(out, w);
    let mut s = format!(
        "{{\"impl\":\"allgrad\",\"world_size\":{w},\"nnodes\":{},\"netns\":{},\"reports\":{},\"timed_out\":{timed_out}",
        args.nnodes,
        !args.node_netns.is_empty(),
        reps.iter().filter(|r| r.is_some()).count()
    );
    write!(s, ",\"start_only\":{}", args.start_only)?;
    for k in ["forked_s", "started_s"] {
        if let Some(st) = stats(column(&reps, k)) {
            write!(s, ",\"{k}_min\":{},\"{k}_median\":{},\"{k}_max\":{}", st.min, st.median, st.max)?;
        }
    }
    if let Some(st) = stats(fork_to_main(&reps)) {
        write!(s, ",\"fork_to_main_s_median\":{},\"fork_to_main_s_max\":{}", st.median, st.max)?;
    }
    for k in ["formed_s", "ready_s"] {
        if let Some(st) = after_last_start(&reps, k) {
            write!(s, ",\"{k}_after_last_start_median\":{},\"{k}_after_last_start_max\":{}", st.median, st.max)?;
        }
    }
    for k in [
        "formed_s",
        "ready_s",
        "fds",
        "fds_end",
        "conns",
        "conns_end",
        "threads",
        "rss_kb",
        "pss_kb",
        "uss_kb",
        "pss_end_kb",
        "form_frames",
        "node_form_s",
    ] {
        if let Some(st) = stats(column(&reps, k)) {
            write!(s, ",\"{k}_median\":{},\"{k}_max\":{}", st.median, st.max)?;
        }
    }
    for k in ["shm", "node_shm"] {
        let v = column(&reps, k);
        if !v.is_empty() {
            write!(s, ",\"{k}_ranks\":{}", v.iter().filter(|x| **x == 1.0).count())?;
        }
    }
    // Rank 0 apart: it serves the store too.
    for k in ["fds", "fds_end", "conns", "conns_end", "threads", "store_conns", "store_conns_end"] {
        if let Some(v) = reps[0].as_ref().and_then(|m| num(m, k)) {
            write!(s, ",\"{k}_rank0\":{v}")?;
        }
    }
    let node = NODE_MEASURED.iter().map(|(_, k)| format!("node_{k}"));
    for k in MEASURED.iter().map(|(_, k)| k.to_string()).chain(node) {
        if let Some(t) = reps[0].as_ref().and_then(|m| num(m, &format!("{k}_us"))) {
            write!(s, ",\"{k}_us\":{t}")?;
        }
        for q in ["median", "p90"] {
            if let Some(t) = reps[0].as_ref().and_then(|m| num(m, &format!("{k}_call_us_{q}"))) {
                write!(s, ",\"{k}_call_us_{q}\":{t}")?;
            }
        }
        if let Some(st) = stats(column(&reps, &format!("{k}_frames"))) {
            write!(s, ",\"{k}_frames_max\":{}", st.max)?;
        }
    }
    if !args.no_kill && !args.start_only {
        let kill = reps.get(victim).and_then(|r| r.as_ref()).and_then(|m| num(m, "kill_ns"));
        if let (Some(k), Some(st)) = (kill, stats(column(&reps, "detect_ns"))) {
            write!(
                s,
                ",\"detect_ms_median\":{},\"detect_ms_max\":{},\"detected\":{}",
                (st.median - k) / 1e6,
                (st.max - k) / 1e6,
                st.n
            )?;
            let named = column(&reps, "named_victim").iter().filter(|x| **x == 1.0).count();
            write!(s, ",\"named_victim\":{named}")?;
            if args.nnodes > 1 {
                let per = naming_per_node(&reps, args.nnodes, victim);
                let all = per.iter().filter(|(named, of)| named == of).count();
                write!(s, ",\"nodes_all_named\":{all}")?;
            }
        }
    }
    s.push('}');
    Ok(s)
}

// ------------------------------------------------------------------------------ rank

struct Report {
    path: PathBuf,
    text: String,
}

impl Report {
    fn put(&mut self, k: &str, v: impl std::fmt::Display) {
        let _ = writeln!(self.text, "{k} {v}");
    }
    /// Writes what was gathered so far (atomically: a reader never sees half a report).
    fn flush(&self) -> Result<()> {
        let tmp = self.path.with_extension("tmp");
        std::fs::write(&tmp, &self.text)?;
        std::fs::rename(&tmp, &self.path)?;
        Ok(())
    }
}

fn rank_main(args: &Args) -> Result<()> {
    let started = now_ns();
    let t0: u128 = std::env::var(ENV_T0).ok().and_then(|v| v.parse().ok()).unwrap_or(started);
    let out = PathBuf::from(std::env::var(ENV_OUT).context("the harness's output folder")?);
    let victim: usize = std::env::var("ALLGRAD_SCALE_VICTIM").ok().and_then(|v| v.parse().ok()).unwrap_or(usize::MAX);
    let secs = |t: u128| (t.saturating_sub(t0)) as f64 / 1e9;
    let forked = forked_ns(started);
    if args.start_only {
        let rank = std::env::var("RANK").context("RANK")?;
        let mut rep = Report { path: out.join(format!("rank-{rank}.txt")), text: String::new() };
        if let Some(f) = forked {
            rep.put("forked_s", secs(f));
        }
        rep.put("started_s", secs(started));
        return rep.flush();
    }

    let pg = ProcessGroup::from_env().context("joining the job")?;
    let formed = now_ns();
    let form_frames = pg.wire_counts();
    pg.barrier().context("first barrier")?;
    let ready = now_ns();
    let rank = pg.rank();
    let mut rep = Report { path: out.join(format!("rank-{rank}.txt")), text: String::new() };
    if let Some(f) = forked {
        rep.put("forked_s", secs(f));
    }
    rep.put("started_s", secs(started));
    rep.put("formed_s", secs(formed));
    rep.put("ready_s", secs(ready));
    rep.put("form_frames", form_frames.frames_sent + form_frames.frames_received);
    rep.put("shm", pg.shared_memory() as u8);
    rep.put("fds", open_fds());
    rep.put("conns", pg.connection_count());
    if let Some(n) = pg.store_connections() {
        rep.put("store_conns", n);
    }
    if let Ok(status) = std::fs::read_to_string("/proc/self/status") {
        for (key, name) in [("VmRSS:", "rss_kb"), ("VmHWM:", "hwm_kb"), ("Threads:", "threads")] {
            if let Some(v) = field(&status, key) {
                rep.put(name, v);
            }
        }
    }
    if let Ok(roll) = std::fs::read_to_string("/proc/self/smaps_rollup") {
        let uss = field(&roll, "Private_Clean:").unwrap_or(0) + field(&roll, "Private_Dirty:").unwrap_or(0);
        rep.put("uss_kb", uss);
        if let Some(p) = field(&roll, "Pss:") {
            rep.put("pss_kb", p);
        }
    }
    rep.flush()?;

    measure(&pg, "", &MEASURED, args.iters, &mut rep)?;
    // Each node's own group, with a host per node: its ranks, consecutive (the launcher numbers
    // a node's ranks together). Every rank makes every node's group, in the same order (that
    // names them), and forms its own with its members only. Held to the end of the process:
    // closing it while a peer still reads from it would fail that peer.
    let _node_group = if args.hosts() {
        let per_node = pg.world_size() / args.nnodes;
        pg.barrier()?;
        let t = Instant::now();
        let mut mine = None;
        for node in 0..args.nnodes {
            let members: Vec<usize> = (node * per_node..(node + 1) * per_node).collect();
            if let Some(g) = pg.new_group(&members)? {
                mine = Some(g);
            }
        }
        let ng = mine.context("this rank is a member of its node's group")?;
        rep.put("node_form_s", t.elapsed().as_secs_f64());
        rep.put("node_shm", ng.shared_memory() as u8);
        measure(&ng, "node_", &NODE_MEASURED, args.iters, &mut rep)?;
        rep.flush()?;
        Some(ng)
    } else {
        None
    };
    pg.barrier()?;
    // Descriptors and connections again, once the collectives ran (and the ranks' store
    // connections, closed after formation, are gone from rank 0).
    rep.put("fds_end", open_fds());
    rep.put("conns_end", pg.connection_count());
    if let Some(n) = pg.store_connections() {
        rep.put("store_conns_end", n);
    }
    // Memory again, after the collectives touched their buffers (shared memory included).
    if let Ok(roll) = std::fs::read_to_string("/proc/self/smaps_rollup") {
        for (key, name) in [("Rss:", "rss_end_kb"), ("Pss:", "pss_end_kb")] {
            if let Some(v) = field(&roll, key) {
                rep.put(name, v);
            }
        }
        rep.flush()?;
    }
    if args.no_kill {
        return Ok(());
    }

    // Kill phase.
    // SAFETY: ignoring SIGTERM changes no memory; the launcher's SIGKILL still ends us.
    unsafe { libc::signal(libc::SIGTERM, libc::SIG_IGN) };
    if rank == victim {
        std::thread::sleep(Duration::from_millis(300));
        rep.put("kill_ns", now_ns());
        rep.flush()?;
        // SAFETY: raising a signal on this process.
        unsafe { libc::raise(libc::SIGKILL) };
    }
    let mut x = [1.0f32];
    let err = loop {
        if let Err(e) = pg.all_reduce_slice(&mut x, ReduceOp::Sum) {
            break e;
        }
    };
    let detected = now_ns();
    let msg = err.to_string();
    let named = names_rank(&msg, victim);
    rep.put("detect_ns", detected);
    rep.put("named_victim", named as u8);
    rep.put("error", msg.replace('\n', " "));
    rep.flush()?;
    std::process::exit(1);
}

/// Times `iters` calls of each of `keys` on `pg` (after 2 untimed ones) and puts into `rep`,
/// under `prefix` + key: the mean time per call of the slowest rank (`_us`) and the frames per
/// call (`_frames`); for the 4-byte all_reduce also each call's time on its slowest rank,
/// its median and 90th percentile (`_call_us_median`, `_call_us_p90`).
fn measure(pg: &ProcessGroup, prefix: &str, keys: &[(&str, &str)], iters: u64, rep: &mut Report) -> Result<()> {
    let (w, rank) = (pg.world_size(), pg.rank());
    let small = vec![rank as f32; 1];
    let big_n = (1 << 20) / 4;
    let mut ar_small = [rank as f32 + 1.0];
    let mut ar_big = vec![1.0f32; big_n];
    let ag_per = (big_n / w).max(1);
    let ag_own = vec![rank as f32; ag_per];
    let mut ag_big = vec![0f32; ag_per * w];
    let mut ag_small = vec![0f32; w];
    let iters = iters.max(1);
    for &(_, key) in keys {
        let mut call = || -> Result<()> {
            match key {
                "ar4" => {
                    ar_small[0] = 1.0;
                    pg.all_reduce_slice(&mut ar_small, ReduceOp::Sum)?;
                    if ar_small[0] != w as f32 {
                        bail!("all_reduce returned {} on rank {rank}, expected {w}", ar_small[0]);
                    }
                }
                "ar1m" => pg.all_reduce_slice(&mut ar_big, ReduceOp::Max)?,
                "ag4" => {
                    pg.all_gather_into(&small, &mut ag_small)?;
                    if ag_small.iter().enumerate().any(|(i, x)| *x != i as f32) {
                        bail!("all_gather returned a wrong result on rank {rank}");
                    }
                }
                _ => pg.all_gather_into(&ag_own, &mut ag_big)?,
            }
            Ok(())
        };
        for _ in 0..2 {
            call().with_context(|| format!("untimed {prefix}{key}"))?;
        }
        pg.barrier()?;
        let before = pg.wire_counts();
        let mut each = Vec::with_capacity(iters as usize);
        let t = Instant::now();
        for _ in 0..iters {
            let c = Instant::now();
            call().with_context(|| format!("timed {prefix}{key}"))?;
            each.push(c.elapsed().as_secs_f64());
        }
        let mut el = [t.elapsed().as_secs_f64() / iters as f64];
        let after = pg.wire_counts();
        let frames =
            (after.frames_sent + after.frames_received - before.frames_sent - before.frames_received) as f64 / iters as f64;
        pg.all_reduce_slice(&mut el, ReduceOp::Max)?;
        rep.put(&format!("{prefix}{key}_us"), el[0] * 1e6);
        rep.put(&format!("{prefix}{key}_frames"), frames);
        if key == "ar4" {
            // Call i's time on its slowest rank: the calls are in step on every rank.
            pg.all_reduce_slice(&mut each, ReduceOp::Max)?;
            let (median, p90) = median_p90(&mut each);
            rep.put(&format!("{prefix}{key}_call_us_median"), median * 1e6);
            rep.put(&format!("{prefix}{key}_call_us_p90"), p90 * 1e6);
        }
        rep.flush()?;
    }
    Ok(())
}

/// The median and the 90th percentile (nearest rank) of `v`, which it sorts; 0 when empty.
fn median_p90(v: &mut [f64]) -> (f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0);
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    (v[n / 2], v[(n * 9).div_ceil(10) - 1])
}

/// This process's open file descriptors.
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// When this process was forked, as wall-clock nanoseconds, given the wall clock `now`: its
/// start time in /proc/self/stat (clock ticks since boot) against the boot-time clock, to the
/// tick. `None` where either cannot be read.
fn forked_ns(now: u128) -> Option<u128> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let start_ticks = start_ticks(&stat)?;
    // SAFETY: sysconf has no preconditions; clock_gettime writes the timespec it is given.
    let (tick, boot) = unsafe {
        let mut ts: libc::timespec = std::mem::zeroed();
        (libc::sysconf(libc::_SC_CLK_TCK), (libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) == 0).then_some(ts))
    };
    let (tick, boot) = (u128::try_from(tick).ok().filter(|t| *t > 0)?, boot?);
    let boot_ns = u128::try_from(boot.tv_sec).ok()? * 1_000_000_000 + u128::try_from(boot.tv_nsec).ok()?;
    let age = boot_ns.checked_sub(start_ticks as u128 * 1_000_000_000 / tick)?;
    now.checked_sub(age)
}

/// Field 22 of a /proc/PID/stat line (the start time, in clock ticks after boot); the command
/// name (field 2, in parentheses) may hold spaces and parentheses, so fields count from the
/// last ')'.
fn start_ticks(stat: &str) -> Option<u64> {
    stat[stat.rfind(')')? + 1..].split_whitespace().nth(19)?.parse().ok()
}

/// Whether `msg` names `rank N` as a whole word.
fn names_rank(msg: &str, n: usize) -> bool {
    let pat = format!("rank {n}");
    msg.match_indices(&pat).any(|(i, _)| !msg[i + pat.len()..].starts_with(|c: char| c.is_ascii_digit()))
}

/// The number after `key` in a `/proc` status-style text.
fn field(text: &str, key: &str) -> Option<u64> {
    text.lines().find(|l| l.starts_with(key))?.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_start_time_is_field_22_of_proc_stat_after_the_command_name() {
        let line = "4242 (a (b) c) S 1 4242 4242 0 -1 4194560 120 0 0 0 1 2 0 0 20 0 1 0 98765 1000 100";
        assert_eq!(start_ticks(line), Some(98765));
        assert_eq!(start_ticks("4242 (x) S 1"), None);
        // This process's own: forked before now, and not before the machine booted.
        let now = now_ns();
        let f = forked_ns(now).expect("the fork time of this process");
        assert!(f <= now, "forked {f} after now {now}");
    }

    #[test]
    fn the_90th_percentile_is_the_nearest_rank() {
        let mut v: Vec<f64> = (1..=20).rev().map(f64::from).collect();
        assert_eq!(median_p90(&mut v), (11.0, 18.0));
        let mut v: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(median_p90(&mut v), (6.0, 9.0));
        assert_eq!(median_p90(&mut [3.0]), (3.0, 3.0));
        assert_eq!(median_p90(&mut []), (0.0, 0.0));
    }

    #[test]
    fn survivors_naming_the_victim_are_counted_per_node() {
        // 3 nodes of 2 ranks; rank 2 (node 1) is the victim; rank 5 did not name it, rank 4
        // reported nothing.
        let rep = |named: Option<u8>| {
            Some(named.map(|n| [("named_victim".to_string(), n.to_string())].into_iter().collect()).unwrap_or_default())
        };
        let reps = vec![rep(Some(1)), rep(Some(1)), rep(None), rep(Some(1)), rep(None), rep(Some(0))];
        assert_eq!(naming_per_node(&reps, 3, 2), vec![(2, 2), (1, 1), (0, 2)]);
    }

    #[test]
    fn rank_names_are_whole_words() {
        assert!(names_rank("rank 12 closed its connection", 12));
        assert!(!names_rank("rank 12 closed its connection", 1));
        assert!(names_rank("x rank 1: y", 1));
    }
}
