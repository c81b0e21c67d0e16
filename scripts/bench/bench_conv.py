#!/usr/bin/env python3
"""PyTorch baseline for allgrad-nn's conv2d benchmark (crates/allgrad-bench/src/bin/bench_conv.rs).

Times the same layers the same way (one warm-up, then the median of --runs calls, f32, CPU):
forward, input gradient and weight gradient (aten.convolution_backward with one output mask
each, i.e. exactly one gradient per call), and forward + backward through autograd. Prints a
table and one `RESULT<TAB>layer<TAB>op<TAB>torch<TAB>median_s<TAB>min_s` line per figure, which
scripts/bench/bench_conv.sh joins with the Rust rows.

    python3 scripts/bench/bench_conv.py [--runs 5] [--all | --resnet18] [--threads N]

Requires PyTorch (`pip install torch`); without it this exits with status 2 and says so.
"""

import argparse
import os
import statistics
import sys
import time
import warnings

LAYERS = [
    # name, (n, c, h, w), out channels, kernel, stride, padding
    ("3x3 128x64x32x32->64", (128, 64, 32, 32), 64, 3, 1, 1),
]
MORE_LAYERS = [
    ("3x3/s2 128x64x32x32->128", (128, 64, 32, 32), 128, 3, 2, 1),
    ("1x1 128x256x16x16->64", (128, 256, 16, 16), 64, 1, 1, 0),
]
# Every distinct convolution of the SimCLR step's ResNet-18 (3x3 stem, 32x32 images) at
# batch 64 (128 views); same list in bench_conv.rs.
RESNET18_LAYERS = [
    ("r18 stem 3->64 32x32", (128, 3, 32, 32), 64, 3, 1, 1),
    ("r18 3x3 64->64 32x32", (128, 64, 32, 32), 64, 3, 1, 1),
    ("r18 3x3/s2 64->128 32x32", (128, 64, 32, 32), 128, 3, 2, 1),
    ("r18 1x1/s2 64->128 32x32", (128, 64, 32, 32), 128, 1, 2, 0),
    ("r18 3x3 128->128 16x16", (128, 128, 16, 16), 128, 3, 1, 1),
    ("r18 3x3/s2 128->256 16x16", (128, 128, 16, 16), 256, 3, 2, 1),
    ("r18 1x1/s2 128->256 16x16", (128, 128, 16, 16), 256, 1, 2, 0),
    ("r18 3x3 256->256 8x8", (128, 256, 8, 8), 256, 3, 1, 1),
    ("r18 3x3/s2 256->512 8x8", (128, 256, 8, 8), 512, 3, 2, 1),
    ("r18 1x1/s2 256->512 8x8", (128, 256, 8, 8), 512, 1, 2, 0),
    ("r18 3x3 512->512 4x4", (128, 512, 4, 4), 512, 3, 1, 1),
]


def timed(runs, f):
    f()
    t = []
    for _ in range(max(runs, 1)):
        start = time.perf_counter()
        f()
        t.append(time.perf_counter() - start)
    return statistics.median(t), min(t)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="timed runs per figure (median reported)")
    ap.add_argument("--all", action="store_true", help="add the stride-2 and pointwise layers")
    ap.add_argument("--resnet18", action="store_true", help="only the SimCLR step's ResNet-18 convolutions")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    args, _ = ap.parse_known_args()  # ignore the Rust-only flags the driver passes through
    try:
        warnings.filterwarnings("ignore")  # torch warns when numpy is absent; it is not needed
        import torch
    except ImportError:
        print("bench_conv.py: PyTorch is not installed (pip install torch)", file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    aten = torch.ops.aten
    print(f"conv2d f32 on CPU, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"median of {args.runs} runs (seconds)")
    print(f"{'layer':<26} {'op':<22} {'torch':>10}")
    layers = RESNET18_LAYERS if args.resnet18 else LAYERS + (MORE_LAYERS if args.all else [])
    for name, xs, out, k, s, p in layers:
        x = torch.rand(xs) * 2 - 1
        w = (torch.rand(out, xs[1], k, k) * 2 - 1) * 0.05
        with torch.no_grad():
            y = torch.nn.functional.conv2d(x, w, None, s, p)
        gy = torch.rand(y.shape) * 2 - 1

        def backward(mask):
            with torch.no_grad():
                aten.convolution_backward(gy, x, w, None, [s, s], [p, p], [1, 1], False, [0, 0], 1, mask)

        def step():
            xv = x.detach().requires_grad_()
            wv = w.detach().requires_grad_()
            (torch.nn.functional.conv2d(xv, wv, None, s, p) * gy).sum().backward()

        def forward():
            with torch.no_grad():
                torch.nn.functional.conv2d(x, w, None, s, p)

        rows = [
            ("forward", timed(args.runs, forward)),
            ("input-grad", timed(args.runs, lambda: backward([True, False, False]))),
            ("weight-grad", timed(args.runs, lambda: backward([False, True, False]))),
            ("fwd+bwd (autograd)", timed(args.runs, step)),
        ]
        for op, (med, low) in rows:
            print(f"{name:<26} {op:<22} {med:>10.3f}")
            print(f"RESULT\t{name}\t{op}\ttorch\t{med:.6f}\t{low:.6f}")


if __name__ == "__main__":
    main()
