//! Bring your own model and distributed loss to the `train` command: register a method next
//! to the built-in ones and hand the registry to `allgrad::train::cli::main_with`.
//!
//! ```text
//! cargo build --release --bin launch --example custom_loss
//! target/release/launch --nproc-per-node 2 target/release/examples/custom_loss --config examples/custom_loss.yaml
//! ```
//!
//! The method (`align_uniform`) embeds noisy 2-D points with a linear layer and trains it
//! with an alignment + uniformity loss whose uniformity term compares this rank's embeddings
//! with those of EVERY rank, gathered with the differentiable `allgrad::dist::all_gather`. It
//! owns one config section, `points:`. Before training, every rank checks that the loss is
//! world-size invariant (1 rank with the whole batch vs 2, 3 and 4 thread-ranks with it split;
//! rank 0 prints it), then the command trains it exactly as `train` trains a built-in method:
//! same arguments (`--set`, `--output-dir`, `--resume`), checkpoints and metrics.
//!
//! The objective is written as "embed a chunk of samples" plus "loss of all local
//! embeddings" ([`EmbeddingObjective`]), which is all the trainer needs for gradient
//! caching: add `--set train.cache_chunk=8` and each rank embeds its samples 8 at a time
//! without keeping activations, with the gradient of the plain step.
//!
//! The uniformity term compares every local embedding with every gathered one: a `b x B`
//! matrix. Written as a per-block logits function (`−2 |z_i − z_j|²` of a block of rows
//! against a block of columns), `allgrad::models::tiled::tiled_cross_entropy` computes it
//! exactly in blocks, with an online log-sum-exp and the blocks recomputed in its backward:
//! add `--set points.tile=16` and the loss never holds more than 16 x 16 distances (the
//! start-up check also compares the tiled term with the whole-matrix one).

use allgrad::candle::{DType, Device, IndexOp, Result, Tensor, D};
use allgrad::candle_nn::{Linear, Module, VarBuilder};
use allgrad::dist::{all_gather, ProcessGroup, WorldInfo};
use allgrad::models::rng::{normals, stream};
use allgrad::models::tiled::{tiled_cross_entropy, Pairs};
use allgrad::models::{loss_of_embedded_batch, Batch, EmbeddingObjective, Objective};
use allgrad::testing::check_world_size_invariance;
use allgrad::train::method::{Method, SectionError};
use allgrad::train::{cli, Registry, RunConfig};
use serde::{Deserialize, Serialize};

/// Alignment of the two views, plus log E exp(-2 |z_i - z_j|^2) of each local embedding
/// against all embeddings of the global batch (the uniformity term needs every rank's), in
/// blocks of `tile` rows and columns when given.
fn align_uniform(z1: &Tensor, z2: &Tensor, tile: Option<usize>, pg: &ProcessGroup) -> Result<Tensor> {
    let norm = |z: &Tensor| z.broadcast_div(&z.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?);
    let (z1, z2) = (norm(z1)?, norm(z2)?);
    let align = (&z1 - &z2)?.sqr()?.sum(D::Minus1)?.mean_all()?;
    let u = |z: &Tensor| match tile {
        Some(tile) => uniformity_tiled(z, tile, pg),
        None => uniformity(z, pg),
    };
    ((align + u(&z1)?)? + u(&z2)?)? * 0.5
}

fn uniformity(z: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    let all = all_gather(z, pg)?; // [B, d]: differentiable, sum-rule backward
    let sq = (z.sqr()?.sum_keepdim(1)?.broadcast_add(&all.sqr()?.sum_keepdim(1)?.t()?)? - (z.matmul(&all.t()?)? * 2.0)?)?;
    let n = all.dim(0)? as f64;
    ((sq * -2.0)?.exp()?.sum(D::Minus1)? / n)?.log()?.mean_all()
}

/// [`uniformity`] in `tile x tile` blocks: the logits of a block are `-2 |q_i - k_j|^2`;
/// `tiled_cross_entropy` with no positives gives `Σ_i logsumexp_j`, the log of each row's sum.
fn uniformity_tiled(z: &Tensor, tile: usize, pg: &ProcessGroup) -> Result<Tensor> {
    let all = all_gather(z, pg)?;
    let scores = |q: &Tensor, k: &Tensor, _: &Tensor| -> Result<Tensor> {
        let sq = q.sqr()?.sum_keepdim(1)?.broadcast_add(&k.sqr()?.sum_keepdim(1)?.t()?)?;
        (sq - (q.matmul(&k.t()?)? * 2.0)?)? * -2.0
    };
    let no_params = Tensor::zeros((), z.dtype(), z.device())?;
    let sum_lse = tiled_cross_entropy(z, &all, &no_params, Pairs::default(), scores, tile)?;
    (sum_lse / z.dim(0)? as f64)? - (all.dim(0)? as f64).ln()
}

/// The method's own section of the run config.
#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct PointsSections {
    /// `points: {samples, clusters}`.
    points: Points,
}

#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct Points {
    samples: usize,
    clusters: usize,
    /// Compute the uniformity term in blocks of this many rows and columns.
    #[serde(default)]
    tile: Option<usize>,
}

struct PointsObjective {
    samples: usize,
    tile: Option<usize>,
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

impl EmbeddingObjective for PointsObjective {
    /// Both views of samples `rows` of the batch, `[n, 2, 3]`.
    fn embed(&mut self, batch: &Batch, rows: std::ops::Range<usize>, _pg: &ProcessGroup) -> Result<Tensor> {
        let Some(layer) = self.layer.as_ref() else { allgrad::candle::bail!("align_uniform used before build") };
        let part = batch.part(rows);
        Tensor::stack(&[layer.forward(&self.views(&part, 1)?)?, layer.forward(&self.views(&part, 2)?)?], 1)
    }
    fn loss_of_embeddings(&mut self, z: &Tensor, _batch: &Batch, pg: &ProcessGroup) -> Result<Tensor> {
        align_uniform(&z.i((.., 0))?, &z.i((.., 1))?, self.tile, pg)
    }
}

impl Objective for PointsObjective {
    fn build(&mut self, vb: VarBuilder) -> Result<()> {
        self.layer = Some(allgrad::candle_nn::linear(2, 3, vb.pp("embed"))?);
        Ok(())
    }
    fn num_samples(&self) -> usize {
        self.samples
    }
    fn loss(&mut self, batch: &Batch, pg: &ProcessGroup) -> Result<Tensor> {
        loss_of_embedded_batch(self, batch, pg)
    }
    fn embedding(&mut self) -> Option<&mut dyn EmbeddingObjective> {
        Some(self)
    }
}

/// The registry entry: reads `points:`, checks it, builds the objective.
struct AlignUniform;

impl Method for AlignUniform {
    type Sections = PointsSections;

    fn validate(&self, s: &PointsSections, run: &RunConfig, _world_size: usize) -> std::result::Result<(), SectionError> {
        if s.points.tile == Some(0) {
            return Err(SectionError::new("points.tile", "must be at least 1 (remove it to compute the loss whole)"));
        }
        if s.points.clusters == 0 || s.points.samples < run.train.global_batch {
            return Err(SectionError::new(
                "points",
                format!(
                    "needs at least one cluster and train.global_batch = {} samples (got {} and {})",
                    run.train.global_batch, s.points.clusters, s.points.samples
                ),
            ));
        }
        Ok(())
    }

    fn objective(&self, s: PointsSections, _run: &RunConfig, _device: &Device) -> Result<Box<dyn Objective>> {
        let k = s.points.clusters;
        let step = std::f64::consts::TAU / k as f64;
        let centres = (0..k).map(|i| [(i as f64 * step).cos(), (i as f64 * step).sin()]).collect();
        Ok(Box::new(PointsObjective { samples: s.points.samples, tile: s.points.tile, centres, layer: None }))
    }
}

fn check_invariance(rank0: bool) -> Result<()> {
    let x = Tensor::randn(0f64, 1.0, (24, 3), &Device::Cpu)?;
    let whole = check_world_size_invariance(&x, &[2, 3, 4], uniformity)?;
    let tiled = check_world_size_invariance(&x, &[2, 3, 4], |x, pg| uniformity_tiled(x, 5, pg))?;
    for (report, tiled) in whole.iter().zip(&tiled) {
        report.assert_close(1e-10)?;
        tiled.assert_close(1e-10)?;
        if rank0 {
            println!(
                "uniformity is world-size invariant at W = {} (largest gradient difference {:.1e}; in 5 x 5 tiles {:.1e})",
                report.world_size, report.max_grad_diff, tiled.max_grad_diff
            );
        }
    }
    let (a, b) = (whole[0].reference_loss, tiled[0].reference_loss);
    if (a - b).abs() > 1e-10 * a.abs().max(1.0) {
        allgrad::candle::bail!("the tiled uniformity {b} differs from the whole-matrix one {a}");
    }
    Ok(())
}

fn main() {
    let rank0 = WorldInfo::from_env().map(|w| w.rank == 0).unwrap_or(true);
    if let Err(e) = check_invariance(rank0) {
        eprintln!("custom_loss: the loss is not world-size invariant: {e}");
        std::process::exit(1);
    }
    let mut methods = Registry::builtin();
    methods.register("align_uniform", AlignUniform);
    std::process::exit(cli::main_with(methods));
}
