#!/usr/bin/env python3
"""PyTorch gloo (CPU) baseline for `bench_collectives`.

Runs the same collectives over the same sizes as allgrad's benchmark, with the same rules
(nccl-tests sizes and bus bandwidth, max over ranks of the mean time per call, the same
iteration counts, one checked call before timing), and prints the same table; --json writes
the same JSON lines (with "impl": "gloo") so scripts/bench/bench_collectives.sh can join the two.

    python3 scripts/bench/bench_gloo.py --nproc 2 [--min-bytes 1K --max-bytes 256M \
        --ops all_reduce,all_gather,reduce_scatter --iters N --warmup N --dtype f32 --json PATH]

Without RANK in the environment it starts --nproc ranks itself (torch.multiprocessing, spawn,
on a free loopback port); with RANK set (torchrun, say: `torchrun --nproc-per-node 2
scripts/bench/bench_gloo.py`) it is one rank and reads WORLD_SIZE, MASTER_ADDR and MASTER_PORT.

Requirements: PyTorch, installed with `pip install torch`. That wheel is about 5 GB (it
pulls in the CUDA libraries, which are needed even to import torch on a CPU-only machine),
so it is not part of CI: this script is a manual baseline. Without torch it exits with
status 2 and a message saying so.
"""

import argparse
import json
import os
import re
import socket
import sys
import time
import warnings

ITER_BYTES = 1 << 30  # auto iteration count: about 1 GiB per size ...
MIN_ITERS, MAX_ITERS = 5, 100  # ... between these (same rule as bench_collectives)
OPS = ("all_reduce", "all_gather", "reduce_scatter")


def parse_bytes(s):
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(I?B)?\s*", s, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"{s!r} is not a size (e.g. 4096, 1K, 256M, 1G)")
    v = int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2).upper()]
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{s!r}: the size must be positive")
    return v


def parse_ops(s):
    out = []
    for name in (n.strip().lower().replace("-", "_") for n in s.split(",")):
        if not name:
            continue
        name = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter"}.get(name, name)
        if name not in OPS:
            raise argparse.ArgumentTypeError(f"unknown collective {name!r} (expected {', '.join(OPS)})")
        if name not in out:
            out.append(name)
    if not out:
        raise argparse.ArgumentTypeError("no collective given")
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="gloo baseline for bench_collectives")
    p.add_argument("--nproc", type=int, default=2, help="ranks to start (ignored when RANK is set)")
    p.add_argument("--min-bytes", type=parse_bytes, default=parse_bytes("1K"))
    p.add_argument("--max-bytes", type=parse_bytes, default=parse_bytes("256M"))
    p.add_argument("--ops", type=parse_ops, default=list(OPS))
    p.add_argument("--iters", type=int, default=None, help="timed iterations per size (default: ~1 GiB per size, 5..100)")
    p.add_argument("--warmup", type=int, default=None, help="warmup iterations per size (default: iters/5, 2..10)")
    p.add_argument("--dtype", choices=("f32", "f64"), default="f32")
    p.add_argument("--json", default=None, help="write the rows as JSON lines here (rank 0)")
    a = p.parse_args(argv)
    if a.min_bytes > a.max_bytes:
        p.error(f"--min-bytes ({a.min_bytes}) is larger than --max-bytes ({a.max_bytes})")
    if a.iters is not None and a.iters < 1:
        p.error("--iters must be at least 1")
    if a.warmup is not None and a.warmup < 0:
        p.error("--warmup must not be negative")
    if a.nproc < 1:
        p.error("--nproc must be at least 1")
    return a


def import_torch():
    warnings.filterwarnings("ignore", message=".*NumPy.*")  # torch warns when numpy is absent
    try:
        import torch  # noqa: F401
        import torch.distributed  # noqa: F401
    except ImportError as e:
        print(
            f"bench_gloo.py: PyTorch is not installed ({e}).\n"
            "Install it with `pip install torch` (about 5 GB with its CUDA wheels) to run the gloo baseline.",
            file=sys.stderr,
        )
        sys.exit(2)
    import torch

    return torch


def sizes(lo, hi):
    s = lo
    while s <= hi:
        yield s
        s *= 2


def iters_for(nbytes, a):
    iters = a.iters if a.iters is not None else min(max(ITER_BYTES // max(nbytes, 1), MIN_ITERS), MAX_ITERS)
    warmup = a.warmup if a.warmup is not None else min(max(iters // 5, 2), 10)
    return iters, warmup


def bus_factor(op, w):
    return 2.0 * (w - 1) / w if op == "all_reduce" else (w - 1) / w


def rank_main(a, rank, world):
    torch = import_torch()
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        sweep(torch, dist, a, rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def values(torch, dtype, r, n, offset=0):
    # Element i of rank r: (r + 1) + ((offset + i) % 7): small integers, exact in any float type.
    return (torch.arange(offset, offset + n, dtype=torch.int64) % 7).to(dtype) + (r + 1)


def check(torch, got, want, what):
    if not torch.equal(got, want):
        bad = (got != want).nonzero()[0].item()
        raise RuntimeError(f"{what} returned a wrong result: element {bad} is {got[bad].item()}, expected {want[bad].item()}")


def time_op(torch, dist, op, count, dtype, iters, warmup, rank, w):
    per = count // w
    wsum = w * (w + 1) // 2
    if op == "all_reduce":
        buf = values(torch, dtype, rank, count)
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        check(torch, buf, (torch.arange(count) % 7).to(dtype) * w + wsum, op)
        buf.zero_()  # repeated in-place sums would overflow; zeros keep every call's work the same
        call = lambda: dist.all_reduce(buf, op=dist.ReduceOp.SUM)  # noqa: E731
    elif op == "all_gather":
        own = values(torch, dtype, rank, per)
        out = torch.empty(count, dtype=dtype)
        dist.all_gather_into_tensor(out, own)
        want = torch.cat([values(torch, dtype, r, per) for r in range(w)])
        check(torch, out, want, op)
        call = lambda: dist.all_gather_into_tensor(out, own)  # noqa: E731
    else:
        inp = values(torch, dtype, rank, count)
        out = torch.empty(per, dtype=dtype)
        dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.SUM)
        want = (torch.arange(rank * per, rank * per + per) % 7).to(dtype) * w + wsum
        check(torch, out, want, op)
        call = lambda: dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.SUM)  # noqa: E731
    for _ in range(warmup):
        call()
    dist.barrier()
    t = time.perf_counter()
    for _ in range(iters):
        call()
    el = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
    dist.all_reduce(el, op=dist.ReduceOp.MAX)
    return el.item()


def sweep(torch, dist, a, rank, w):
    dtype = {"f32": torch.float32, "f64": torch.float64}[a.dtype]
    esz = torch.tensor([], dtype=dtype).element_size()
    jf = open(a.json, "w") if (a.json and rank == 0) else None
    try:
        if rank == 0:
            print(f"# bench_gloo.py collectives: PyTorch {torch.__version__} gloo (CPU), {w} ranks (processes), dtype {a.dtype}")
            print("# size: all_reduce buffer; all_gather output (size/W per rank); reduce_scatter input (size/W per rank)")
            print("# time: max over ranks of the mean per call; busbw factor 2(W-1)/W (all_reduce), (W-1)/W (others)")
            print("#")
            print(f"{'op':>15} {'size(B)':>13} {'count':>12} {'type':>5} {'iters':>6} {'time(us)':>12} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}", flush=True)
        for op in a.ops:
            for size in sizes(a.min_bytes, a.max_bytes):
                if op == "all_reduce":
                    count = size // esz
                else:
                    count = size // esz // w * w
                if count == 0:
                    continue
                nbytes = count * esz
                iters, warmup = iters_for(nbytes, a)
                secs = time_op(torch, dist, op, count, dtype, iters, warmup, rank, w)
                if rank != 0:
                    continue
                per_call = secs / iters
                algbw = nbytes / max(per_call, 1e-12) / 1e9
                busbw = algbw * bus_factor(op, w)
                print(f"{op:>15} {nbytes:>13} {count:>12} {a.dtype:>5} {iters:>6} {per_call * 1e6:>12.1f} {algbw:>12.3f} {busbw:>12.3f}", flush=True)
                if jf:
                    row = dict(impl="gloo", op=op, bytes=nbytes, count=count, dtype=a.dtype, world_size=w, iters=iters,
                               warmup=warmup, time_us=round(per_call * 1e6, 3), algbw_gbps=round(algbw, 6), busbw_gbps=round(busbw, 6))
                    jf.write(json.dumps(row) + "\n")
                    jf.flush()
    finally:
        if jf:
            jf.close()


def spawned(rank, a, world, port):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rank_main(a, rank, world)


def main():
    a = parse_args()
    import_torch()  # exits 2 with a message when torch is missing
    if "RANK" in os.environ:
        try:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        except (KeyError, ValueError) as e:
            sys.exit(f"bench_gloo.py: RANK is set but RANK/WORLD_SIZE are not usable ({e})")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        rank_main(a, rank, world)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import torch.multiprocessing as mp

    # Spawned ranks import torch before any code of ours runs: silence its numpy notice there too.
    os.environ.setdefault("PYTHONWARNINGS", "ignore:Failed to initialize NumPy")
    try:
        mp.spawn(spawned, args=(a, a.nproc, port), nprocs=a.nproc, join=True)
    except mp.ProcessRaisedException as e:
        print(f"bench_gloo.py: a rank failed:\n{e}", file=sys.stderr)
        sys.exit(1)
    except mp.ProcessExitedException as e:
        print(f"bench_gloo.py: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
