//! The differentiable collectives on CUDA tensors through NCCL, compared with the same ops on
//! the CPU backend: every op's output and input gradient at W = 1 and 2 (ranks as threads,
//! rank r on CUDA device r), f64, asymmetric data per rank, relative tolerance 1e-10.
//!
//! Built only with the `nccl` feature; it needs a GPU per rank, so it runs on a GPU machine
//! (`scripts/gpu_ci.sh`), never in this repository's CPU CI. A world size needing more GPUs
//! than the machine has is skipped with a message (NCCL refuses two ranks of one
//! communicator on one GPU: `ncclCommInitRank` returns ncclInvalidUsage, seen with NCCL 2.28
//! on an H100); with ALLGRAD_REQUIRE_GPU=1, having no GPU at all is a failure.
#![cfg(feature = "nccl")]

use allgrad_dist::{all_gather, all_reduce, all_to_all_sizes, broadcast, reduce_scatter, run_threads, ProcessGroup, ReduceOp};
use candle_core::cuda::cudarc::driver::CudaContext;
use candle_core::{Device, Result, Tensor, Var};

type Op<'a> = &'a (dyn Fn(&Tensor, &ProcessGroup) -> Result<Tensor> + Sync);

/// Whether `w` ranks can each have a GPU here; says why not when they cannot.
fn gpus_for(w: usize) -> bool {
    let n = CudaContext::device_count().map(|n| n as usize).unwrap_or(0);
    if n == 0 && std::env::var("ALLGRAD_REQUIRE_GPU").as_deref() == Ok("1") {
        panic!("ALLGRAD_REQUIRE_GPU=1, but no CUDA device is visible");
    }
    if n < w {
        eprintln!("SKIPPED at W={w}: {n} CUDA device(s) visible, one per rank needed");
    }
    n >= w
}

/// Rank r's input: `rows` x 3, every value distinct across ranks and positions.
fn input(rank: usize, rows: usize) -> Result<Tensor> {
    let v: Vec<f64> =
        (0..rows * 3).map(|i| 0.37 * (i as f64 + 1.0) * if i % 2 == 0 { 1.0 } else { -1.0 } + 1.9 * rank as f64 - 0.11).collect();
    Tensor::from_vec(v, (rows, 3), &Device::Cpu)
}

/// Runs `op` on W ranks (on CUDA device r, or on the CPU), with the loss
/// `Σ (out ⊙ c)²` for a fixed position-dependent `c`; returns each rank's output and input
/// gradient as host vectors.
fn run(w: usize, cuda: bool, rows: &(dyn Fn(usize, usize) -> usize + Sync), op: Op<'_>) -> Vec<(Vec<f64>, Vec<f64>)> {
    run_threads(w, |pg| {
        let dev = if cuda { Device::new_cuda(pg.rank())? } else { Device::Cpu };
        let x = Var::from_tensor(&input(pg.rank(), rows(pg.rank(), w))?.to_device(&dev)?)?;
        let out = op(x.as_tensor(), &pg)?;
        let n = out.elem_count();
        let c = Tensor::from_vec((0..n).map(|i| 1.0 + 0.25 * i as f64).collect::<Vec<_>>(), out.shape(), &dev)?;
        let loss = out.mul(&c)?.sqr()?.sum_all()?;
        let grads = loss.backward()?;
        let gx = grads.get(&x).expect("the input tracks gradients").flatten_all()?.to_device(&Device::Cpu)?.to_vec1::<f64>()?;
        Ok((out.flatten_all()?.to_device(&Device::Cpu)?.to_vec1::<f64>()?, gx))
    })
    .unwrap()
}

fn assert_close(name: &str, w: usize, what: &str, gpu: &[f64], cpu: &[f64]) {
    assert_eq!(gpu.len(), cpu.len(), "{name} W={w} {what}: lengths");
    for (i, (g, c)) in gpu.iter().zip(cpu).enumerate() {
        assert!((g - c).abs() <= 1e-10 * c.abs().max(1.0), "{name} W={w} {what}[{i}]: CUDA {g} vs CPU {c}");
    }
}

fn check(name: &str, rows: &(dyn Fn(usize, usize) -> usize + Sync), op: Op<'_>) {
    for w in [1, 2] {
        if !gpus_for(w) {
            continue;
        }
        let cpu = run(w, false, rows, op);
        let gpu = run(w, true, rows, op);
        for (r, ((go, gg), (co, cg))) in gpu.iter().zip(&cpu).enumerate() {
            assert_close(name, w, &format!("rank {r} output"), go, co);
            assert_close(name, w, &format!("rank {r} input gradient"), gg, cg);
        }
        eprintln!("{name}: W={w} on CUDA equals the CPU backend");
    }
}

#[test]
fn all_gather_of_uneven_rows_matches_the_cpu_backend() {
    check("all_gather", &|r, _| 2 + r, &|x, pg| all_gather(x, pg));
}

#[test]
fn all_reduce_of_every_operator_matches_the_cpu_backend() {
    for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Prod, ReduceOp::Max, ReduceOp::Min] {
        check(&format!("all_reduce({op:?})"), &|_, _| 3, &move |x, pg| all_reduce(x, op, pg));
    }
}

#[test]
fn reduce_scatter_matches_the_cpu_backend() {
    for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
        check(&format!("reduce_scatter({op:?})"), &|_, w| 2 * w, &move |x, pg| reduce_scatter(x, op, pg));
    }
}

#[test]
fn broadcast_from_the_last_rank_matches_the_cpu_backend() {
    check("broadcast", &|_, _| 2, &|x, pg| broadcast(x, pg.world_size() - 1, pg));
}

#[test]
fn all_to_all_of_uneven_blocks_matches_the_cpu_backend() {
    // Rank r sends (r + j) % 2 + 1 rows to rank j.
    let sizes = |r: usize, w: usize| -> Vec<usize> { (0..w).map(|j| (r + j) % 2 + 1).collect() };
    check("all_to_all", &move |r, w| sizes(r, w).iter().sum(), &move |x, pg| {
        all_to_all_sizes(x, &sizes(pg.rank(), pg.world_size()), pg)
    });
}

#[test]
fn the_seed_example_gives_12_and_18_on_cuda() {
    if !gpus_for(2) {
        return;
    }
    let grads = run_threads(2, |pg| {
        let dev = Device::new_cuda(pg.rank())?;
        let x = Var::from_tensor(&Tensor::full(1.0f64 - pg.rank() as f64, (2, 2), &dev)?)?;
        let y = (x.as_tensor() + 2.0)?;
        let g = all_gather(&(&y * &y)?, &pg)?;
        let out = (g.narrow(0, 0, 2)? * g.narrow(0, 2, 2)?)?.mean_all()?;
        Ok(out.backward()?.get(&x).unwrap().flatten_all()?.to_device(&Device::Cpu)?.to_vec1::<f64>()?[0])
    })
    .unwrap();
    assert_eq!(grads, vec![12.0, 18.0]);
}
