//! The seed example of the gradient convention, on 2 ranks:
//!
//! ```text
//! cargo build --release --bin launch --example seed_gather
//! target/release/launch --nproc-per-node 2 target/release/examples/seed_gather
//! ```
//!
//! x = 1 on rank 0 and 0 on rank 1; y = x + 2; z = y * y; gathered = all_gather(z);
//! r = z_0 * z_1; out = r.mean(). Under the sum rule y.grad is 12 on rank 0 and 18 on
//! rank 1; dividing the loss by W gives 6 and 9, the single-process gradient.

use allgrad::candle::{Device, Tensor, Var};
use allgrad::dist::{all_gather, ProcessGroup};

fn y_grad(pg: &ProcessGroup, divide_by_w: bool) -> allgrad::candle::Result<f32> {
    let x = Var::from_tensor(&Tensor::full(if pg.rank() == 0 { 1f32 } else { 0. }, (2, 2), &Device::Cpu)?)?;
    let y = (x.as_tensor() + 2.0)?;
    let z = (&y * &y)?;
    let gathered = all_gather(&z, pg)?;
    let r = (gathered.narrow(0, 0, 2)? * gathered.narrow(0, 2, 2)?)?;
    let mut out = r.mean_all()?;
    if divide_by_w {
        out = (out / pg.world_size() as f64)?;
    }
    let grads = out.backward()?;
    // y = x + 2, so y's gradient equals x's.
    grads.get(&x).expect("x reaches the loss").flatten_all()?.get(0)?.to_scalar::<f32>()
}

fn main() -> anyhow::Result<()> {
    let pg = ProcessGroup::from_env()?;
    anyhow::ensure!(pg.world_size() == 2, "run this example on 2 ranks (launch --nproc-per-node 2 ...), not {}", pg.world_size());
    let sum_rule = y_grad(&pg, false)?;
    let per_w = y_grad(&pg, true)?;
    println!("rank {}: y.grad = {sum_rule} (sum rule), {per_w} (loss / W)", pg.rank());
    let want = if pg.rank() == 0 { (12.0, 6.0) } else { (18.0, 9.0) };
    anyhow::ensure!((sum_rule, per_w) == want, "expected {want:?}");
    Ok(())
}
