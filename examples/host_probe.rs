//! Which path each group takes, and whether its collectives are right, when a job spans
//! hosts: every rank joins the world group and its node's group (ranks `LOCAL_WORLD_SIZE` at
//! a time), says whether each one moves data through shared memory, and checks an all_reduce
//! and an all_gather of 8 MiB (above the shared-memory threshold) in both against values
//! computed here. Exact: the data are small integers, so every summation order gives the same
//! f64 sums.
//!
//! ```text
//! cargo build --release --bin launch --example host_probe
//! target/release/launch --nproc-per-node 4 target/release/examples/host_probe
//! ```

use allgrad::dist::{ProcessGroup, ReduceOp};

const N: usize = 1 << 20;

fn data(rank: usize) -> Vec<f64> {
    (0..N).map(|i| ((rank + 1) * (i % 1000) + rank) as f64).collect()
}

/// All_reduce (sum) and all_gather over `members` (global ranks in group order) on `pg`.
fn check(pg: &ProcessGroup, members: &[usize], what: &str) -> anyhow::Result<()> {
    let me = members[pg.rank()];
    let mut sum = data(me);
    pg.all_reduce_slice(&mut sum, ReduceOp::Sum)?;
    for (i, v) in sum.iter().enumerate() {
        let want: usize = members.iter().map(|&r| (r + 1) * (i % 1000) + r).sum();
        anyhow::ensure!(*v == want as f64, "{what}: all_reduce element {i} is {v}, expected {want}");
    }
    let gathered = pg.all_gather_slice(&data(me)[..4096])?;
    for (k, &r) in members.iter().enumerate() {
        anyhow::ensure!(gathered[k * 4096..(k + 1) * 4096] == data(r)[..4096], "{what}: all_gather part {k} is not rank {r}'s");
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let world = ProcessGroup::from_env()?;
    let per_node: usize = std::env::var("LOCAL_WORLD_SIZE").ok().and_then(|v| v.parse().ok()).unwrap_or(world.world_size());
    let (rank, nodes) = (world.rank(), world.world_size().div_ceil(per_node));
    let all: Vec<usize> = (0..world.world_size()).collect();
    check(&world, &all, "world")?;
    let mut mine = None;
    for node in 0..nodes {
        let members: Vec<usize> = all.iter().copied().filter(|r| r / per_node == node).collect();
        if let Some(g) = world.new_group(&members)? {
            mine = Some((g, members));
        }
    }
    let (node_group, members) = mine.expect("every rank is on a node");
    check(&node_group, &members, "node")?;
    println!(
        "rank {rank} node {}: world shm={} node shm={}; all_reduce and all_gather exact in both",
        rank / per_node,
        world.shared_memory(),
        node_group.shared_memory()
    );
    Ok(())
}
