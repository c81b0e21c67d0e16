#!/usr/bin/env python3
"""OpenCLIP's side of scripts/bench/bench_ring_memory.sh: the loss and its backward alone on
W processes over gloo, with open-clip-torch 3.3.0's own, unmodified losses:
`ClipLoss(local_loss=True, gather_with_grad=True)` (each rank scores its rows against the
gathered embeddings, the gather differentiable) and `SigLipLoss` in its ring form (the texts
passed to the neighbours by `torch.distributed` point-to-point exchanges with autograd; the
bidirectional exchange, OpenCLIP's default).

    python scripts/bench/bench_ring_memory.py --nproc 4 --loss siglip --local-batch 1024 --dim 512

Only `open_clip/loss.py` is loaded (by path, not the package, whose __init__ imports the
model code and its dependencies; the package is installed with --no-deps), after checking
the installed version. Each rank: fixed seeded f32 embeddings `[b, d]` (different per rank),
one untimed step, then --steps timed ones (a barrier before each), and one line in the format
of allgrad's bench_ring_memory:
`bench_ring_memory: rank R/W loss L form openclip local_batch B dim D tile 0 step_s S
heap_step_mib nan peak_rss_step_mib P`, P the peak resident set over the timed steps (VmHWM,
reset through /proc/self/clear_refs before them) minus the resident set before them.
"""

import argparse
import importlib.metadata
import importlib.util
import os
import pathlib
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OPEN_CLIP = "3.3.0"


def load_losses():
    got = importlib.metadata.version("open_clip_torch")
    if got != OPEN_CLIP:
        raise SystemExit(f"open-clip-torch {got} is installed; the benchmark is pinned to {OPEN_CLIP} (scripts/ci/get_torch.sh)")
    spec = importlib.util.find_spec("open_clip")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "loss.py"
    mod_spec = importlib.util.spec_from_file_location("open_clip_loss", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def status_mib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no {field} in /proc/self/status")


def rank_main(rank, args, port):
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.nproc)
    losses = load_losses()
    w = args.nproc
    g = torch.Generator().manual_seed(1000 + rank)
    img = (torch.rand(args.local_batch, args.dim, generator=g) * 2 - 1).requires_grad_()
    txt = (torch.rand(args.local_batch, args.dim, generator=g) * 2 - 1).requires_grad_()
    scale = torch.tensor(10.0).log().requires_grad_()
    bias = torch.tensor(-10.0).requires_grad_()
    if args.loss == "clip":
        loss_fn = losses.ClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=w)
    else:
        loss_fn = losses.SigLipLoss(rank=rank, world_size=w)

    def step():
        i = torch.nn.functional.normalize(img, dim=-1)
        t = torch.nn.functional.normalize(txt, dim=-1)
        if args.loss == "clip":
            loss = loss_fn(i, t, scale.exp())
        else:
            loss = loss_fn(i, t, scale.exp(), bias)
        loss.backward()
        img.grad = txt.grad = scale.grad = bias.grad = None

    step()
    dist.barrier()
    rss0 = status_mib("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    total = 0.0
    for _ in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        total += time.perf_counter() - t0
    worst = torch.tensor([total / args.steps], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    print(
        f"bench_ring_memory: rank {rank}/{w} loss {args.loss} form openclip local_batch {args.local_batch} dim {args.dim} "
        f"tile 0 step_s {worst.item():.6f} heap_step_mib nan peak_rss_step_mib {status_mib('VmHWM:') - rss0:.1f}",
        flush=True,
    )
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--loss", choices=["clip", "siglip"], default="siglip")
    p.add_argument("--local-batch", type=int, default=256)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    load_losses()  # the version check, before any process starts
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    mp.spawn(rank_main, args=(args, port), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
