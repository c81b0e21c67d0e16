//! The differentiable collectives on CUDA tensors, compared with the same ops on the CPU
//! backend: every op's output and input gradient at W = 1, 2 and 3 (ranks as threads, rank r
//! on CUDA device r % (devices visible)), f64, asymmetric data per rank, relative tolerance
//! 1e-10 (the host path gives the CPU backend's bits; NCCL may sum in another order).
//!
//! Each world size runs on both paths a group can take ([`allgrad_dist::gpu`]): `host`
//! (forced), and `auto`, which is NCCL where every rank has a GPU of its own and the build has
//! the `nccl` feature, and the host otherwise; the test asserts which path each group took.
//! So on a machine with one GPU every W >= 2 case runs on the host path (NCCL refuses two
//! ranks of one communicator on one GPU: ncclInvalidUsage), and with two GPUs W = 2 runs
//! through NCCL. Nothing skips on a machine with a GPU.
//!
//! The ring passes' exchange of tensors (`RingPass::exchange_tensors`, what the ring losses
//! run on CUDA) is held to the same exchange on the CPU: every chunk delivered, W = 1, 2, 3,
//! both ways and one way, chunks of 1 to 3 rows of uneven blocks, with work on the chunks
//! before queued beside each exchange; on the `nccl` path every exchange went through NCCL on
//! the device and the host waited once per pass, at its end.
//!
//! It needs the `cuda` feature and a GPU machine (`scripts/ci/gpu_ci.sh`). Without either (the
//! repository's CPU CI) every test prints why it skipped, by name, and fails with
//! ALLGRAD_REQUIRE_GPU=1.

use allgrad_dist::gpu::{cuda_ordinal, CudaCollectives, CudaPath};
use allgrad_dist::{
    all_gather, all_reduce, all_to_all_sizes, broadcast, reduce_scatter, ProcessGroup, ReduceOp, RingCounts, RingMessage,
    RingSchedule, ThreadWorld,
};
use candle_core::{DType, Device, Result, Tensor, Var};

type Op<'a> = &'a (dyn Fn(&Tensor, &ProcessGroup) -> Result<Tensor> + Sync);

/// The number of visible CUDA devices; `None`, after printing why the test skips, when there
/// is none. With ALLGRAD_REQUIRE_GPU=1 a skip is a failure.
fn gpus(test: &str) -> Option<usize> {
    if !cfg!(feature = "cuda") {
        skip(test, "this test binary was built without the `cuda` feature");
        return None;
    }
    let n = device_count();
    if n == 0 {
        skip(test, "no CUDA device is visible");
        return None;
    }
    Some(n)
}

#[cfg(feature = "cuda")]
fn device_count() -> usize {
    candle_core::cuda::cudarc::driver::CudaContext::device_count().map(|n| n.max(0) as usize).unwrap_or(0)
}

#[cfg(not(feature = "cuda"))]
fn device_count() -> usize {
    0
}

/// Says that `test` did not run and why, through the workspace's skip (a failure instead
/// under ALLGRAD_REQUIRE_GPU=1).
fn skip(test: &str, reason: &str) {
    allgrad_testkit::skip(allgrad_testkit::Need::Gpu, &format!("{test}: {reason}"));
}

/// The path a group of `w` ranks on `gpus` devices takes under `mode`.
fn expected_path(w: usize, gpus: usize, mode: CudaCollectives) -> CudaPath {
    match mode {
        CudaCollectives::Auto if cfg!(feature = "nccl") && w <= gpus => CudaPath::Nccl,
        _ => CudaPath::Host,
    }
}

/// Rank r's input: `rows` x 3, every value distinct across ranks and positions.
fn input(rank: usize, rows: usize) -> Result<Tensor> {
    let v: Vec<f64> =
        (0..rows * 3).map(|i| 0.37 * (i as f64 + 1.0) * if i % 2 == 0 { 1.0 } else { -1.0 } + 1.9 * rank as f64 - 0.11).collect();
    Tensor::from_vec(v, (rows, 3), &Device::Cpu)
}

/// Each rank's output and input gradient, and (on CUDA) the path its group took.
type RankResult = (Vec<f64>, Vec<f64>, Option<CudaPath>);

/// Runs `op` on W ranks (on CUDA device r % gpus under `mode`, or on the CPU), with the loss
/// `Σ (out ⊙ c)²` for a fixed position-dependent `c`; returns each rank's output and input
/// gradient as host vectors.
fn run(
    w: usize,
    cuda: Option<(usize, CudaCollectives)>,
    rows: &(dyn Fn(usize, usize) -> usize + Sync),
    op: Op<'_>,
) -> Vec<RankResult> {
    let world = ThreadWorld::new(w);
    let world = match cuda {
        Some((_, mode)) => world.cuda_collectives(mode),
        None => world,
    };
    world
        .run(|pg| {
            let (dev, path) = match cuda {
                Some((gpus, _)) => {
                    let ordinal = cuda_ordinal(pg.rank(), w, gpus, None).map_err(candle_core::Error::Msg)?;
                    let dev = Device::new_cuda(ordinal)?;
                    let path = pg.cuda_path(&dev)?;
                    (dev, Some(path))
                }
                None => (Device::Cpu, None),
            };
            let x = Var::from_tensor(&input(pg.rank(), rows(pg.rank(), w))?.to_device(&dev)?)?;
            let out = op(x.as_tensor(), &pg)?;
            let n = out.elem_count();
            let c = Tensor::from_vec((0..n).map(|i| 1.0 + 0.25 * i as f64).collect::<Vec<_>>(), out.shape(), &dev)?;
            let loss = out.mul(&c)?.sqr()?.sum_all()?;
            let grads = loss.backward()?;
            let gx =
                grads.get(&x).expect("the input tracks gradients").flatten_all()?.to_device(&Device::Cpu)?.to_vec1::<f64>()?;
            Ok((out.flatten_all()?.to_device(&Device::Cpu)?.to_vec1::<f64>()?, gx, path))
        })
        .unwrap()
}

fn assert_close(name: &str, w: usize, what: &str, gpu: &[f64], cpu: &[f64]) {
    // Element-wise (each element a sum of exact inputs, rounded on its own scale; an exact
    // zero must stay exact), through `allgrad_testkit::close`.
    let what = format!("{name} W={w} {what}: CUDA vs CPU");
    allgrad_testkit::close::assert_elem_rel(gpu, cpu, 1e-10, f64::MIN_POSITIVE, &what);
}

fn check(name: &str, rows: &(dyn Fn(usize, usize) -> usize + Sync), op: Op<'_>) {
    let Some(gpus) = gpus(name) else { return };
    for w in [1, 2, 3] {
        let cpu = run(w, None, rows, op);
        for mode in [CudaCollectives::Host, CudaCollectives::Auto] {
            let want = expected_path(w, gpus, mode);
            let gpu = run(w, Some((gpus, mode)), rows, op);
            for (r, ((go, gg, path), (co, cg, _))) in gpu.iter().zip(&cpu).enumerate() {
                assert_eq!(*path, Some(want), "{name} W={w} {mode} on {gpus} GPU(s): rank {r}'s path");
                assert_close(name, w, &format!("{mode}, {want} path: rank {r} output"), go, co);
                assert_close(name, w, &format!("{mode}, {want} path: rank {r} input gradient"), gg, cg);
            }
            eprintln!("{name}: W={w} on {gpus} GPU(s), cuda_collectives={mode}: the {want} path equals the CPU backend");
        }
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
    let Some(gpus) = gpus("the_seed_example_gives_12_and_18_on_cuda") else { return };
    for mode in [CudaCollectives::Host, CudaCollectives::Auto] {
        let grads = ThreadWorld::new(2)
            .cuda_collectives(mode)
            .run(|pg| {
                let dev = Device::new_cuda(cuda_ordinal(pg.rank(), 2, gpus, None).map_err(candle_core::Error::Msg)?)?;
                let x = Var::from_tensor(&Tensor::full(1.0f64 - pg.rank() as f64, (2, 2), &dev)?)?;
                let y = (x.as_tensor() + 2.0)?;
                let g = all_gather(&(&y * &y)?, &pg)?;
                let out = (g.narrow(0, 0, 2)? * g.narrow(0, 2, 2)?)?.mean_all()?;
                Ok(out.backward()?.get(&x).unwrap().flatten_all()?.to_device(&Device::Cpu)?.to_vec1::<f64>()?[0])
            })
            .unwrap();
        assert_eq!(grads, vec![12.0, 18.0], "cuda_collectives={mode}");
    }
}

#[test]
fn plain_collectives_and_the_device_barrier_keep_cuda_tensors_on_their_device() {
    let Some(gpus) = gpus("plain_collectives_and_the_device_barrier_keep_cuda_tensors_on_their_device") else { return };
    for mode in [CudaCollectives::Host, CudaCollectives::Auto] {
        let out = ThreadWorld::new(3)
            .cuda_collectives(mode)
            .run(|pg| {
                let dev = Device::new_cuda(cuda_ordinal(pg.rank(), 3, gpus, None).map_err(candle_core::Error::Msg)?)?;
                let x = input(pg.rank(), 2)?.to_device(&dev)?;
                let summed = pg.all_reduce(&x, ReduceOp::Sum)?;
                let gathered = pg.all_gather(&x)?;
                pg.device_barrier(&dev)?;
                let on_device = summed.device().is_cuda() && gathered.device().is_cuda();
                Ok((on_device, summed.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f64>()?, gathered.dims().to_vec()))
            })
            .unwrap();
        let want: Vec<f64> = (0..6)
            .map(|i| (0..3).map(|r| input(r, 2).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap()[i]).sum())
            .collect();
        for (on_device, summed, dims) in out {
            assert!(on_device, "{mode}: results must stay on the GPU");
            assert_close("plain all_reduce", 3, &format!("{mode}"), &summed, &want);
            assert_eq!(dims, vec![6, 3]);
        }
    }
}

/// Rank r's ring block: `ring_rows(r)` rows of 3 values naming the rank and the position.
fn ring_rows(r: usize) -> usize {
    (r * 3 + 1) % 4 + 1
}

fn ring_block(r: usize) -> Vec<f64> {
    (0..ring_rows(r) * 3).map(|i| (r * 1000 + i) as f64 + 0.25).collect()
}

/// What one rank got from a pass of chunks sent straight from their owners (the ring losses'
/// pattern) through `exchange_tensors` on `dev`: each received (origin, chunk) with its values,
/// the sums of the chunks computed on `dev` during the exchange after the one that brought
/// them, the pass's counts, and whether the pass went through NCCL.
type RingRun = (Vec<((usize, usize), Vec<f64>)>, Vec<f64>, RingCounts, bool);

fn ring_run(pg: &ProcessGroup, dev: &Device, bidirectional: bool, chunk_rows: usize) -> Result<RingRun> {
    let (me, w) = (pg.rank(), pg.world_size());
    let sched = RingSchedule { world: w, bidirectional };
    let on_nccl = pg.ring_on_nccl(dev)?;
    let before = pg.ring_counts();
    let pass = pg.ring_pass("gpu test ring", ring_rows(me), 3, chunk_rows, &[])?;
    let mine = Tensor::from_vec(ring_block(me), (ring_rows(me), 3), &Device::Cpu)?.to_device(dev)?;
    let (mut got, mut sums) = (Vec::new(), Vec::new());
    let mut prev: Vec<Tensor> = Vec::new();
    let mut during_sums: Vec<Tensor> = Vec::new();
    for s in 1..=sched.steps() {
        let dirs: &[bool] = if s <= sched.steps_down() { &[false, true] } else { &[false] };
        for k in 0..pass.chunks() {
            let range = pass.chunk_range(me, k);
            let own = if range.is_empty() { None } else { Some(mine.narrow(0, range.start, range.len())?.flatten_all()?) };
            let sends: Vec<RingMessage<&Tensor>> = match &own {
                None => Vec::new(),
                Some(t) => {
                    dirs.iter().map(|&d| RingMessage { peer: sched.visitor(me, s, d), origin: me, chunk: k, data: t }).collect()
                }
            };
            let recvs: Vec<RingMessage<()>> = dirs
                .iter()
                .map(|&d| sched.origin(me, s, d))
                .filter(|&o| pass.chunk_len(o, k) > 0)
                .map(|o| RingMessage { peer: o, origin: o, chunk: k, data: () })
                .collect();
            // The work on the chunks before is queued on the compute stream beside the exchange;
            // nothing is read back until the pass has settled.
            let (during, fresh) = pass.exchange_tensors(&sends, &recvs, DType::F64, dev, || {
                prev.iter().map(|t| t.sum_all()).collect::<Result<Vec<_>>>()
            })?;
            during_sums.extend(during?);
            for (m, t) in recvs.iter().zip(&fresh) {
                got.push(((m.origin, m.chunk), t.clone()));
            }
            prev = fresh;
        }
    }
    for t in &prev {
        during_sums.push(t.sum_all()?);
    }
    pass.settle(dev)?;
    let counts = pg.ring_counts().since(before);
    for t in during_sums {
        sums.push(t.to_device(&Device::Cpu)?.to_scalar::<f64>()?);
    }
    let got =
        got.into_iter().map(|(key, t)| Ok((key, t.to_device(&Device::Cpu)?.to_vec1::<f64>()?))).collect::<Result<Vec<_>>>()?;
    Ok((got, sums, counts, on_nccl))
}

#[test]
fn ring_exchanges_of_cuda_chunks_match_the_cpu_ring_and_through_nccl_never_wait_on_the_host() {
    let name = "ring_exchanges_of_cuda_chunks_match_the_cpu_ring_and_through_nccl_never_wait_on_the_host";
    let Some(gpus) = gpus(name) else { return };
    for w in [1, 2, 3] {
        for bidirectional in [true, false] {
            for chunk_rows in 1..=3 {
                let cpu = ThreadWorld::new(w).run(|pg| ring_run(&pg, &Device::Cpu, bidirectional, chunk_rows)).unwrap();
                for mode in [CudaCollectives::Host, CudaCollectives::Auto] {
                    let want_path = expected_path(w, gpus, mode);
                    let gpu = ThreadWorld::new(w)
                        .cuda_collectives(mode)
                        .run(|pg| {
                            let ordinal = cuda_ordinal(pg.rank(), w, gpus, None).map_err(candle_core::Error::Msg)?;
                            ring_run(&pg, &Device::new_cuda(ordinal)?, bidirectional, chunk_rows)
                        })
                        .unwrap();
                    let what = format!("W={w} both ways {bidirectional} chunk {chunk_rows} {mode} ({want_path} path)");
                    for (r, ((g_got, g_sums, g_counts, g_nccl), (c_got, c_sums, c_counts, _))) in gpu.iter().zip(&cpu).enumerate()
                    {
                        // Copies: the same bits.
                        assert_eq!(g_got, c_got, "{what} rank {r}: chunks received");
                        assert_eq!(g_sums, c_sums, "{what} rank {r}: sums computed beside the exchanges");
                        assert_eq!(*g_nccl, want_path == CudaPath::Nccl, "{what} rank {r}: through NCCL");
                        assert_eq!(g_counts.exchanges, c_counts.exchanges, "{what} rank {r}: exchanges");
                        assert_eq!(g_counts.messages_sent, c_counts.messages_sent, "{what} rank {r}: messages");
                        if *g_nccl {
                            assert_eq!(g_counts.device_exchanges, g_counts.exchanges, "{what} rank {r}: {g_counts:?}");
                            assert_eq!(g_counts.host_waits, 1, "{what} rank {r}: one host wait, at the pass's end");
                        } else {
                            assert_eq!((g_counts.device_exchanges, g_counts.host_waits), (0, 0), "{what} rank {r}");
                        }
                    }
                    eprintln!("ring exchange: {what} on {gpus} GPU(s) equals the CPU backend");
                }
            }
        }
    }
}
