//! One rank of the face-head benchmark (`scripts/bench/bench_face_head.sh` starts W of them through
//! `launch`, alternating with `scripts/bench/bench_face_head.py`, a PyTorch Partial FC v2): the
//! class-sharded head of `allgrad-models` alone, the code the trainer runs for it. Per step:
//! the loss of a fixed global batch of random embeddings `[B, D]` (this rank's rows of it,
//! a gradient flows back to them) against this rank's centres (L2 normalisation, the
//! differentiable all_gather, cosine logits, the margin, the parallel softmax, Partial FC
//! sampling at `--rate`), the backward of `loss / W` (the trainer's scaling) and the
//! optimizer step (SGD, momentum, weight decay). With sampling the head's default
//! `--update sparse` yields the sampled centres' gradient only (row ids and rows) and the
//! optimizer updates those rows, applying the other rows' momentum and weight decay lazily
//! (`Optimizer::step_grads` with `RowUpdate::Sparse`): the dense update's result, as PyTorch
//! computes it. `--update dense` forms the dense `[C/W, D]` gradient and updates every row.
//! The trainer's extras around it (gradient accumulation buffers, the global gradient norm)
//! are left out, as the PyTorch side leaves out everything but its head.
//!
//! ```text
//! cargo build --release -p allgrad -p allgrad-bench --bin launch --bin bench_face_head
//! target/release/launch --nproc-per-node 2 target/release/bench_face_head \
//!     --classes 100000 --rate 0.1 --steps 3
//! ```
//!
//! Before every step the ranks meet at a barrier; a step's time is the slowest rank's.
//! Rank 0 prints one line per step, `face_head_step impl=allgrad step=I timed=0|1 wall=S
//! fwd=S bwd=S opt=S loss=L`, and every rank one line at the end, `face_head_mem rank=R
//! init_mib=X setup_peak_mib=S peak_mib=Y`: the resident memory once the head, its inputs and
//! the optimizer are set up, the peak while setting up, and the peak resident memory during
//! the timed steps (`VmHWM` after resetting it through `/proc/self/clear_refs` once the
//! warm-up steps are done and every centre's pending updates are applied, which writes its
//! momentum: a zero buffer is resident only where written, and a long run writes all of it;
//! the whole process's peak where that reset is refused, marked `peak_from=process`),
//! and the peak address space (`VmPeak`: what `ulimit -v` limits, above the resident peak by
//! what is mapped but never touched).
//!
//! `--dump DIR` instead takes three steps and writes what a reimplementation needs to check
//! its losses against these (`rank<R>.safetensors`: this rank's embeddings, labels and
//! initial centres, the global ids of the classes sampled at each step (`sampled_<k>`), its
//! class range, the losses of the three steps), and prints `face_head_check impl=allgrad
//! world=W loss=L0 loss2=L1 loss3=L2`. With sampling, the third step reads centres the second
//! left out, whose momentum and weight decay moved them: the lazy update's result.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use allgrad::dist::{ProcessGroup, ReduceOp};
use allgrad::models::face::{CentreStorage, CentreUpdate, FaceHead, HeadConfig, MarginConfig, RowRange};
use allgrad::rng::{below, normals, stream};
use allgrad::train::optim::{OptimConfig, Optimizer, RowUpdate};
use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use clap::Parser;

/// Steps of `--dump`.
const CHECK_STEPS: usize = 3;

/// Key words of the input streams.
const EMB_KEY: u64 = 0xFACE_BE4C_0000_0001;
const LABEL_KEY: u64 = 0xFACE_BE4C_0000_0002;

/// The class-sharded face head alone: forward, backward and optimizer step; one rank.
#[derive(Parser)]
struct Args {
    /// Classes (identities) over all ranks.
    #[arg(long)]
    classes: usize,
    /// Embedding width.
    #[arg(long, default_value_t = 512)]
    dim: usize,
    /// Samples per step over all ranks (split as evenly as possible).
    #[arg(long, default_value_t = 512)]
    global_batch: usize,
    /// Partial FC: the rate at which negative classes are sampled (1: no sampling).
    #[arg(long, default_value_t = 1.0)]
    rate: f64,
    /// Timed steps, after the warm-up steps.
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Untimed steps first.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// `arcface` (m 0.5) or `cosface` (m 0.4), both with s 64.
    #[arg(long, default_value = "arcface")]
    margin: String,
    /// With sampling: `sparse` (the sampled centres' gradient only, lazy optimizer) or
    /// `dense` (a dense gradient, every centre updated each step).
    #[arg(long, default_value = "sparse")]
    update: String,
    /// The centres and their momentum stored in `f32` or `bf16` (f32 arithmetic; takes
    /// `--update sparse`).
    #[arg(long, default_value = "f32")]
    storage: String,
    /// SGD learning rate.
    #[arg(long, default_value_t = 0.1)]
    lr: f64,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    momentum: f64,
    /// SGD weight decay.
    #[arg(long, default_value_t = 5e-4)]
    weight_decay: f64,
    /// Seed of the inputs, the centres and the sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Take two steps, write the check files here and stop.
    #[arg(long)]
    dump: Option<PathBuf>,
}

/// A field of `/proc/self/status` in MiB (`VmRSS`, `VmHWM`); NaN where it is absent.
fn status_mib(field: &str) -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib =
        status.lines().find_map(|l| l.strip_prefix(field)?.strip_prefix(':')?.trim().strip_suffix("kB")?.trim().parse().ok());
    kib.map_or(f64::NAN, |k: f64| k / 1024.0)
}

/// Resets the peak resident memory (`VmHWM`) to the current one; false where the kernel
/// refuses (then `VmHWM` stays the whole process's peak).
fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// This rank's rows of the global batch: embeddings `[b, D]` (standard normals) and labels
/// (uniform over the classes), the same whatever W.
fn inputs(a: &Args, rows: RowRange) -> (Vec<f32>, Vec<usize>) {
    let all = normals(&mut stream(&[a.seed, EMB_KEY]), a.global_batch * a.dim);
    let emb = all[rows.start * a.dim..rows.end() * a.dim].iter().map(|v| *v as f32).collect();
    let mut rng = stream(&[a.seed, LABEL_KEY]);
    let labels: Vec<usize> = (0..a.global_batch).map(|_| below(&mut rng, a.classes)).collect();
    (emb, labels[rows.start..rows.end()].to_vec())
}

fn margin(name: &str) -> Result<MarginConfig> {
    Ok(match name {
        "arcface" => MarginConfig::Arcface { m: 0.5, s: 64.0 },
        "cosface" => MarginConfig::Cosface { m: 0.4, s: 64.0 },
        _ => anyhow::bail!("--margin must be arcface or cosface, not {name:?}"),
    })
}

/// One rank's head, its inputs and its optimizer.
struct Rank {
    head: FaceHead,
    /// The centres, the head's only parameter, as the optimizer takes it.
    params: Vec<(String, Var)>,
    emb: Var,
    labels: Vec<usize>,
    opt: Optimizer,
    seed: u64,
    lr: f64,
}

impl Rank {
    fn new(a: &Args, pg: &ProcessGroup) -> Result<Rank> {
        let (rank, w) = (pg.rank(), pg.world_size());
        let update = match a.update.as_str() {
            "sparse" => CentreUpdate::Sparse,
            "dense" => CentreUpdate::Dense,
            other => anyhow::bail!("--update must be sparse or dense, not {other:?}"),
        };
        let storage = match a.storage.as_str() {
            "f32" => CentreStorage::Run,
            "bf16" => CentreStorage::Bf16,
            other => anyhow::bail!("--storage must be f32 or bf16, not {other:?}"),
        };
        let cfg = HeadConfig {
            margin: margin(&a.margin)?,
            sample_rate: a.rate,
            update,
            storage,
            ..HeadConfig::with_classes(a.classes)
        };
        let mut head = FaceHead::new(cfg, a.dim, a.seed, rank, w)?;
        let varmap = VarMap::new();
        head.build(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu).pp("head"))?;
        let params: Vec<(String, Var)> =
            varmap.data().lock().expect("the var map").iter().map(|(n, v)| (n.clone(), v.clone())).collect();
        anyhow::ensure!(params.len() == 1, "the head has {} parameters, expected its centres only", params.len());
        let rows = RowRange::split(a.global_batch, rank, w);
        let (emb, labels) = inputs(a, rows);
        let emb = Var::from_tensor(&Tensor::from_vec(emb, (rows.len, a.dim), &Device::Cpu)?)?;
        let opt =
            Optimizer::new(OptimConfig::Sgd { lr: a.lr, momentum: a.momentum, nesterov: false, weight_decay: a.weight_decay });
        Ok(Rank { head, params, emb, labels, opt, seed: a.seed, lr: a.lr })
    }

    /// One step: the loss, the backward of `loss / W` and the optimizer step (row-sparse with
    /// `--update sparse` and sampling). Returns the loss and the seconds of the step and of its
    /// forward, backward and optimizer phases.
    fn step(&mut self, step: usize, pg: &ProcessGroup) -> Result<(f32, [f64; 4])> {
        let t0 = Instant::now();
        // As the trainer does: the rows the loss will read are brought up to date first.
        if let Some(rows) = self.head.rows_to_read(&self.labels, self.seed, step, pg)? {
            let (name, centres) = &self.params[0];
            self.opt.catch_up(name, centres, &rows)?;
        }
        let loss = self.head.loss(self.emb.as_tensor(), &self.labels, self.seed, step, pg)?;
        let t1 = Instant::now();
        let grads = (&loss / pg.world_size() as f64)?.backward()?;
        let (g, rows) = match self.head.sparse_rows() {
            Some(sp) => {
                let values = match &sp.leaf {
                    Some(leaf) => grads.get(leaf).context("no gradient for the sampled centres")?.clone(),
                    None => Tensor::zeros((0, self.params[0].1.dim(1)?), DType::F32, &Device::Cpu)?,
                };
                (values, RowUpdate::Sparse { rows: sp.rows, keep_others: false })
            }
            None => (grads.get(&self.params[0].1).context("no gradient for the centres")?.clone(), RowUpdate::All),
        };
        grads.get(&self.emb).context("no gradient for the embeddings")?;
        let t2 = Instant::now();
        self.opt.step_grads(&self.params, &[g], &[true], &[rows], self.lr, pg)?;
        let t3 = Instant::now();
        Ok((loss.to_scalar::<f32>()?, [t3 - t0, t1 - t0, t2 - t1, t3 - t2].map(|d| d.as_secs_f64())))
    }

    /// The check files of `--dump` (see the module docs): the inputs, the initial centres,
    /// the classes sampled at step 0, and the losses of steps 0 and 1 (one optimizer step
    /// between).
    fn dump(&mut self, dir: &std::path::Path, pg: &ProcessGroup) -> Result<()> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let dev = &Device::Cpu;
        let initial = self.params[0].1.as_tensor().copy()?;
        let range = self.head.range();
        let b = self.labels.len();
        let mut tensors: HashMap<String, Tensor> = HashMap::new();
        let mut losses = Vec::with_capacity(CHECK_STEPS);
        for step in 0..CHECK_STEPS {
            let (loss, _) = self.step(step, pg)?;
            losses.push(loss);
            let sampled: Vec<i64> = self
                .head
                .sampled_rows(step)
                .iter()
                .enumerate()
                .filter(|(_, k)| **k)
                .map(|(r, _)| (range.start + r) as i64)
                .collect();
            let n = sampled.len();
            tensors.insert(format!("sampled_{step}"), Tensor::from_vec(sampled, n, dev)?);
        }
        tensors.insert("embeddings".into(), self.emb.as_tensor().clone());
        tensors.insert("labels".into(), Tensor::from_vec(self.labels.iter().map(|l| *l as i64).collect::<Vec<_>>(), b, dev)?);
        tensors.insert("centres".into(), initial);
        tensors.insert("range".into(), Tensor::new(&[range.start as i64, range.len as i64, range.total as i64], dev)?);
        tensors.insert("loss".into(), Tensor::new(losses.as_slice(), dev)?);
        let file = dir.join(format!("rank{}.safetensors", pg.rank()));
        candle_core::safetensors::save(&tensors, &file).with_context(|| format!("writing {}", file.display()))?;
        if pg.rank() == 0 {
            let shown: Vec<String> = losses
                .iter()
                .enumerate()
                .map(|(k, l)| format!("loss{}={l:.9}", if k == 0 { String::new() } else { (k + 1).to_string() }))
                .collect();
            println!("face_head_check impl=allgrad world={} {}", pg.world_size(), shown.join(" "));
        }
        pg.barrier()?;
        Ok(())
    }
}

fn main() -> Result<()> {
    // As the train binary does.
    allgrad::tune_allocator();
    let a = Args::parse();
    anyhow::ensure!(
        a.steps + a.warmup > 0 && a.dim > 0 && a.global_batch > 0,
        "--steps + --warmup, --dim and --global-batch must be positive"
    );
    let pg = ProcessGroup::from_env()?;
    let (rank, w) = (pg.rank(), pg.world_size());
    anyhow::ensure!(a.global_batch >= w, "--global-batch {} is smaller than the {w} ranks", a.global_batch);
    if rank == 0 {
        println!(
            "face_head_setup impl=allgrad world={w} threads_per_rank={} candle={} classes={} dim={} global_batch={} rate={} margin={} update={} storage={}",
            rayon::current_num_threads(),
            candle_core::utils::get_num_threads(),
            a.classes,
            a.dim,
            a.global_batch,
            a.rate,
            a.margin,
            a.update,
            a.storage
        );
    }
    let mut me = Rank::new(&a, &pg)?;
    if let Some(dir) = &a.dump {
        return me.dump(dir, &pg);
    }
    let (init_mib, setup_peak_mib) = (status_mib("VmRSS"), status_mib("VmHWM"));
    let mut reset = reset_peak_rss();
    for step in 0..a.warmup + a.steps {
        if step == a.warmup && step > 0 {
            // Every centre's pending updates applied: its momentum is written, hence resident,
            // as in a long run (a fresh zero buffer takes memory only where written).
            me.opt.flush(&me.params)?;
            reset = reset_peak_rss();
        }
        pg.barrier()?;
        let (loss, mut t) = me.step(step, &pg)?;
        pg.all_reduce_slice(&mut t, ReduceOp::Max)?;
        if rank == 0 {
            println!(
                "face_head_step impl=allgrad step={step} timed={} wall={:.6} fwd={:.6} bwd={:.6} opt={:.6} loss={loss:.7}",
                u8::from(step >= a.warmup),
                t[0],
                t[1],
                t[2],
                t[3]
            );
        }
    }
    pg.barrier()?;
    let from = if reset { "steps" } else { "process" };
    println!(
        "face_head_mem rank={rank} init_mib={init_mib:.1} setup_peak_mib={setup_peak_mib:.1} peak_mib={:.1} peak_from={from} \
         address_space_peak_mib={:.1}",
        status_mib("VmHWM"),
        status_mib("VmPeak")
    );
    Ok(())
}
