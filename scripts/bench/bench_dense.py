#!/usr/bin/env python3
"""PyTorch's side of the dense-layer benchmark (crates/allgrad-bench/src/bin/bench_dense.rs):
the three products of a dense layer `y = x Wᵀ + b` on the CPU in f32, as PyTorch's autograd
runs them for `nn.Linear` (what OpenCLIP's towers are made of): the forward `addmm(b, x, Wᵀ)`,
the input gradient `mm(dY, W)`, the weight gradient `mm(dYᵀ, x)`, and the bias gradient
`dY.sum(0)`. The driver sends one command per measurement so that the two sides alternate in
one invocation (`scripts/bench/bench_dense.sh`).

    python3 scripts/bench/bench_dense.py --worker      # serve the driver

Worker protocol: one command per line on stdin, `time PRODUCT ROWS IN OUT REPS` (PRODUCT one of
`fwd`, `dx`, `dw`, `db`) answered by `TIMES s1 s2 ...` (seconds of each of REPS calls, after one
untimed call) and `DONE`; `quit` ends. Inputs are N(0, 1), made once per shape. The first line is
`READY torch=<version> threads=<n> interop=<n>`. The thread count (`--threads`, default 2) goes
to torch.set_num_threads, torch.set_num_interop_threads and, before torch is imported, to
OMP_NUM_THREADS and MKL_NUM_THREADS. Without torch this exits with status 2.
"""
import argparse
import os
import sys
import time

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--threads", type=int, default=2, help="intra- and inter-op threads")
ap.add_argument("--worker", action="store_true", help="serve time/quit commands on stdin")
# Passed by the driver's worker launcher; the shapes come with each command.
ap.add_argument("--batch", type=int, default=0, help=argparse.SUPPRESS)
ARGS = ap.parse_args()
for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(ARGS.threads)
try:
    import torch
except ImportError:
    print("bench_dense.py: PyTorch is not installed (scripts/ci/get_torch.sh)", file=sys.stderr)
    sys.exit(2)
sys.dont_write_bytecode = True  # no __pycache__ in scripts/

SHAPES = {}


def tensors(rows, inp, out):
    key = (rows, inp, out)
    if key not in SHAPES:
        g = torch.Generator().manual_seed(rows * 1_000_003 + inp * 1_009 + out)
        x = torch.randn(rows, inp, generator=g)
        w = torch.randn(out, inp, generator=g)
        b = torch.randn(out, generator=g)
        dy = torch.randn(rows, out, generator=g)
        SHAPES[key] = (x, w, b, dy)
    return SHAPES[key]


def product(name, rows, inp, out):
    x, w, b, dy = tensors(rows, inp, out)
    if name == "fwd":
        return lambda: torch.addmm(b, x, w.t())
    if name == "dx":
        return lambda: torch.mm(dy, w)
    if name == "dw":
        return lambda: torch.mm(dy.t(), x)
    if name == "db":
        return lambda: dy.sum(0)
    raise ValueError(f"unknown product {name!r}")


def times(f, reps):
    f()
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        f()
        out.append(time.perf_counter() - start)
    return out


def main():
    torch.set_num_threads(ARGS.threads)
    torch.set_num_interop_threads(ARGS.threads)
    if not ARGS.worker:
        print("bench_dense.py is driven by scripts/bench/bench_dense.sh (--worker)", file=sys.stderr)
        sys.exit(1)
    print(f"READY torch={torch.__version__} threads={torch.get_num_threads()} interop={torch.get_num_interop_threads()}",
          flush=True)
    with torch.no_grad():
        for line in sys.stdin:
            cmd = line.split()
            if cmd == ["quit"]:
                break
            if len(cmd) == 6 and cmd[0] == "time" and all(c.isdigit() for c in cmd[2:]):
                rows, inp, out, reps = map(int, cmd[2:])
                try:
                    t = times(product(cmd[1], rows, inp, out), reps)
                except ValueError as e:
                    print(f"ERROR {e}", flush=True)
                    print("DONE", flush=True)
                    continue
                print("TIMES " + " ".join(f"{s:.6f}" for s in t), flush=True)
                print("DONE", flush=True)
            else:
                print(f"ERROR unknown command {line.strip()!r}", flush=True)
                print("DONE", flush=True)


if __name__ == "__main__":
    main()
