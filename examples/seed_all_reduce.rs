//! The all_reduce seed examples, on 2 ranks:
//!
//! ```text
//! cargo build --release --bin launch --example seed_all_reduce
//! target/release/launch --nproc-per-node 2 target/release/examples/seed_all_reduce
//! ```
//!
//! x = 1 on both ranks, xx = (rank + 2) * x, s = all_reduce(xx):
//! - loss s * s: x.grad = 40 and 60;
//! - loss (rank + 2) * s: 10 and 15, summing to 25, the single-process gradient;
//! - the same with Prod: 30 and 30, summing to 60 (an all_reduce whose backward reduces the
//!   gradient with PROD, as torch.distributed.nn does, prints 12 and 18).

use allgrad::candle::{Device, Tensor, Var};
use allgrad::dist::{all_reduce, ProcessGroup, ReduceOp};

fn x_grad(pg: &ProcessGroup, op: ReduceOp, scale_by_rank: bool) -> allgrad::candle::Result<f64> {
    let x = Var::from_tensor(&Tensor::new(&[1f64], &Device::Cpu)?)?;
    let k = (pg.rank() + 2) as f64;
    let s = all_reduce(&(x.as_tensor() * k)?, op, pg)?;
    let loss = if scale_by_rank { (s * k)? } else { (&s * &s)? };
    let grads = loss.sum_all()?.backward()?;
    grads.get(&x).expect("x reaches the loss").get(0)?.to_scalar::<f64>()
}

fn main() -> anyhow::Result<()> {
    let pg = ProcessGroup::from_env()?;
    anyhow::ensure!(pg.world_size() == 2, "run this example on 2 ranks (launch --nproc-per-node 2 ...), not {}", pg.world_size());
    let r = pg.rank();
    let cases = [
        ("sum, loss s*s", x_grad(&pg, ReduceOp::Sum, false)?, [40.0, 60.0][r]),
        ("sum, loss (rank+2)*s", x_grad(&pg, ReduceOp::Sum, true)?, [10.0, 15.0][r]),
        ("prod, loss (rank+2)*s", x_grad(&pg, ReduceOp::Prod, true)?, [30.0, 30.0][r]),
    ];
    for (name, got, want) in cases {
        println!("rank {r}: {name}: x.grad = {got}");
        anyhow::ensure!(got == want, "{name}: expected {want}");
    }
    Ok(())
}
