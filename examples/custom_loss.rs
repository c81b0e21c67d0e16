//! Bring your own model and distributed loss to the trainer.
//!
//! ```text
//! cargo build --release --bin launch --example custom_loss
//! target/release/launch --nproc-per-node 2 target/release/examples/custom_loss
//! ```
//!
//! The objective embeds noisy 2-D points with a linear layer and trains it with an
//! alignment + uniformity loss whose uniformity term compares this rank's embeddings with
//! those of EVERY rank, gathered with the differentiable `allgrad::dist::all_gather`. Before
//! training, rank 0 checks that the loss is world-size invariant (1 rank with the whole batch
//! vs 2, 3 and 4 thread-ranks with it split), then all ranks train it with the same Trainer
//! the `train` binary uses.

use allgrad::dist::{all_gather, ProcessGroup};
use allgrad::models::rng::{normals, stream};
use allgrad::models::{Batch, Objective};
use allgrad::testing::check_world_size_invariance;
use allgrad::train::trainer::{NonFinite, TrainSection};
use allgrad::train::{optim::OptimConfig, Trainer, TrainerConfig};
use candle_core::{DType, Device, Result, Tensor, D};
use candle_nn::{Linear, Module, VarBuilder};

/// Alignment of the two views, plus log E exp(-2 |z_i - z_j|^2) of each local embedding
/// against all embeddings of the global batch (the uniformity term needs every rank's).
fn align_uniform(z1: &Tensor, z2: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    let norm = |z: &Tensor| z.broadcast_div(&z.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?);
    let (z1, z2) = (norm(z1)?, norm(z2)?);
    let align = (&z1 - &z2)?.sqr()?.sum(D::Minus1)?.mean_all()?;
    ((align + uniformity(&z1, pg)?)? + uniformity(&z2, pg)?)? * 0.5
}

fn uniformity(z: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    let all = all_gather(z, pg)?; // [B, d]: differentiable, sum-rule backward
    let sq = (z.sqr()?.sum_keepdim(1)?.broadcast_add(&all.sqr()?.sum_keepdim(1)?.t()?)? - (z.matmul(&all.t()?)? * 2.0)?)?;
    let n = all.dim(0)? as f64;
    ((sq * -2.0)?.exp()?.sum(D::Minus1)? / n)?.log()?.mean_all()
}

struct PointsObjective {
    centres: Vec<[f64; 2]>,
    layer: Option<Linear>,
}

impl PointsObjective {
    fn views(&self, batch: &Batch, view: u64) -> Result<Tensor> {
        let mut rows = Vec::with_capacity(batch.indices.len() * 2);
        for &i in batch.indices {
            let noise = normals(&mut stream(&[batch.seed, batch.epoch as u64, i as u64, view]), 2);
            let c = self.centres[i % self.centres.len()];
            rows.extend([c[0] + 0.1 * noise[0], c[1] + 0.1 * noise[1]]);
        }
        Tensor::from_vec(rows, (batch.indices.len(), 2), &Device::Cpu)?.to_dtype(DType::F32)
    }
}

impl Objective for PointsObjective {
    fn build(&mut self, vb: VarBuilder) -> Result<()> {
        self.layer = Some(candle_nn::linear(2, 3, vb.pp("embed"))?);
        Ok(())
    }
    fn num_samples(&self) -> usize {
        512
    }
    fn loss(&mut self, batch: &Batch, pg: &ProcessGroup) -> Result<Tensor> {
        let layer = self.layer.as_ref().expect("built");
        let z1 = layer.forward(&self.views(batch, 1)?)?;
        let z2 = layer.forward(&self.views(batch, 2)?)?;
        align_uniform(&z1, &z2, pg)
    }
}

fn main() -> anyhow::Result<()> {
    let pg = ProcessGroup::from_env()?;
    if pg.rank() == 0 {
        let x = Tensor::randn(0f64, 1.0, (24, 3), &Device::Cpu)?;
        for report in check_world_size_invariance(&x, &[2, 3, 4], |z, pg| uniformity(z, pg))? {
            report.assert_close(1e-10)?;
            println!(
                "uniformity is world-size invariant at W = {} (largest gradient difference {:.1e})",
                report.world_size, report.max_grad_diff
            );
        }
    }
    let centres = (0..8).map(|k| [(k as f64 * 0.785).cos(), (k as f64 * 0.785).sin()]).collect();
    let cfg = TrainerConfig {
        seed: 1,
        dtype: DType::F32,
        device: Device::Cpu,
        train: TrainSection {
            global_batch: 64,
            epochs: 4,
            max_steps: None,
            accumulate: 1,
            clip_grad_norm: Some(10.0),
            on_nonfinite: NonFinite::Error,
            shuffle: true,
            eval: false,
        },
        optim: OptimConfig::Sgd { lr: 0.5, momentum: 0.9, nesterov: false, weight_decay: 0.0 },
        schedule: Default::default(),
        checkpoint: Default::default(),
        log: allgrad::train::metrics::LogConfig { every: 8, progress: allgrad::train::metrics::Progress::Lines, plot: false },
        settings: Default::default(),
    };
    let mut trainer = Trainer::new(cfg, Box::new(PointsObjective { centres, layer: None }), pg.clone(), None, false)?;
    let summary = trainer.train()?;
    if pg.rank() == 0 {
        println!("trained {} steps on {} ranks; final loss {:.4}", summary.steps, pg.world_size(), summary.last_loss);
    }
    Ok(())
}
