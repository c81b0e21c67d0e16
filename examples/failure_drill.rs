//! What a rank sees when a peer dies: every rank runs all_reduce in a loop, and one rank
//! kills itself with SIGKILL (as the OOM killer would) after a few steps. The survivors'
//! next collective fails within milliseconds with an error naming the dead rank.
//!
//! ```text
//! cargo build --release --bin launch --example failure_drill
//! target/release/launch --nproc-per-node 3 target/release/examples/failure_drill -- 1
//! ```

use std::time::Instant;

use allgrad::dist::{ProcessGroup, ReduceOp};

fn main() -> anyhow::Result<()> {
    let victim: usize = std::env::args().nth(1).map(|a| a.parse()).transpose()?.unwrap_or(1);
    let pg = ProcessGroup::from_env()?;
    let mut buf = vec![1.0f32; 1 << 16];
    for step in 0.. {
        if pg.rank() == victim && step == 3 {
            // SAFETY: raising a signal against ourselves.
            unsafe { libc::raise(libc::SIGKILL) };
        }
        let t = Instant::now();
        if let Err(e) = pg.all_reduce_slice(&mut buf, ReduceOp::Sum) {
            eprintln!("rank {}: step {step} failed after {:.3} s: {e}", pg.rank(), t.elapsed().as_secs_f64());
            std::process::exit(1);
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    Ok(())
}
