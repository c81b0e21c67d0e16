#!/usr/bin/env python3
"""PyTorch side of the SimCLR step benchmark: ResNet-18 (CIFAR stem, width 64) on 2B random
3x32x32 views, projector 512-2048-128, NT-Xent (temperature 0.5), SGD update -- the same step
as allgrad's `crates/allgrad-bench/src/bin/bench_simclr_step/`, which drives this script as a worker so that the
two implementations alternate step by step in one invocation (`scripts/bench/bench_simclr_step.sh`).

    python3 scripts/bench/bench_simclr_step.py --batch 64 --steps 3      # a quick look, alone
    python3 scripts/bench/bench_simclr_step.py --batch 64 --worker       # serve the driver
    python3 scripts/bench/bench_simclr_step.py --batch 64 --memory --steps 2   # peak memory
    python3 scripts/bench/bench_simclr_step.py --device cuda --batch 256 --profile  # torch.profiler's key averages

With `--profile` it runs two warm-up steps, then `--steps` steps under torch.profiler (CPU and,
on CUDA, CUDA activities) and prints its key averages, sorted by device time on CUDA (host
time on the CPU), the top 30 rows: the per-op view to set beside allgrad's region profile
(`scripts/bench/gpu_profile.sh`).

With `--memory` it prints one line `MEM side=pytorch ... setup= fwd= peak=` (MiB): the resident
set (VmRSS) once the model, optimizer and input exist (after one step of a separate model at
--warmup-batch, so that the libraries' code the step runs is resident, and what that step
freed returned to the system with malloc_trim), the resident set at
the end of the first step's forward, and the peak resident set (VmHWM, reset after the setup through
/proc/self/clear_refs) over --steps steps; `scripts/bench/bench_step_memory.sh` prints it beside
allgrad's (`crates/allgrad-bench/src/bin/bench_step_memory.rs`).

Worker protocol: one command per line on stdin (`step`, `layers`, `quit`), one answer line on
stdout per command: `STEP wall= user= sys= minflt= fwd= bwd= opt= bwd_minflt= [gpu_peak=]` (seconds,
faults; user, sys and minor faults from getrusage(RUSAGE_SELF), i.e. all threads of this
process; on CUDA `gpu_peak`, torch.cuda.max_memory_allocated() over the step in MiB), or one
`LAYER kind= count= fwd= bwd=` line per layer type followed by `DONE`. The first line is
`READY torch=<version> threads=<n>`.

The thread count (`--threads`, default 2) goes to torch.set_num_threads and, before torch is
imported, to OMP_NUM_THREADS and MKL_NUM_THREADS. PyTorch installs with `pip install torch`
(kept out of CI); without it this exits with status 2.
"""
import argparse
import ctypes
import os
import resource
import sys
import time


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64, help="samples per step (2B views)")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads")
    ap.add_argument("--width", type=int, default=64, help="channels of the first ResNet stage")
    ap.add_argument("--depth", type=int, default=18, choices=(18, 50), help="ResNet depth")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the step runs (the layer breakdown: CPU only)")
    ap.add_argument(
        "--tf32",
        action="store_true",
        help="on CUDA, let cuDNN and cuBLAS use TF32 (PyTorch's default for convolutions); off by default, as allgrad computes in plain f32",
    )
    ap.add_argument("--steps", type=int, default=3, help="timed steps when run alone")
    ap.add_argument("--worker", action="store_true", help="serve step/layers/quit commands on stdin")
    ap.add_argument("--profile", action="store_true", help="print torch.profiler's key averages of --steps steps")
    ap.add_argument(
        "--warmup-batch",
        type=int,
        default=2,
        help="with --memory: before the setup, one step of a separate model at this batch (0: none)",
    )
    ap.add_argument(
        "--autocast",
        action="store_true",
        help="the forward under torch.autocast(bfloat16), the loss in f32 (allgrad's precision: bf16)",
    )
    ap.add_argument(
        "--memory",
        action="store_true",
        help="measure the resident set over --steps steps and print one MEM line (scripts/bench/bench_step_memory.sh)",
    )
    return ap.parse_args()


ARGS = parse_args()
for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(ARGS.threads)
try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError:
    print("bench_simclr_step.py: PyTorch is not installed (pip install torch)", file=sys.stderr)
    sys.exit(2)


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(out + (x if self.down is None else self.down(x)))


class Bottleneck(nn.Module):
    def __init__(self, cin, mid, stride):
        super().__init__()
        cout = 4 * mid
        self.convs = nn.ModuleList([nn.Conv2d(cin, mid, 1, bias=False), nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.Conv2d(mid, cout, 1, bias=False)])
        self.bns = nn.ModuleList([nn.BatchNorm2d(mid), nn.BatchNorm2d(mid), nn.BatchNorm2d(cout)])
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = x
        for i, (conv, bn) in enumerate(zip(self.convs, self.bns)):
            out = bn(conv(out))
            out = F.relu(out) if i < 2 else out
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    """ResNet-18 (depth 18: basic blocks) or ResNet-50 (depth 50: bottlenecks), CIFAR stem."""

    def __init__(self, width, depth=18):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        counts = (2, 2, 2, 2) if depth == 18 else (3, 4, 6, 3)
        layers, cin = [], width
        for stage in range(4):
            cout = width << stage
            for i in range(counts[stage]):
                stride = 2 if stage > 0 and i == 0 else 1
                layers.append(Block(cin, cout, stride) if depth == 18 else Bottleneck(cin, cout, stride))
                cin = cout if depth == 18 else 4 * cout
        self.layers = nn.Sequential(*layers)
        self.feature_dim = cin

    def forward(self, x):
        h = self.layers(F.relu(self.bn1(self.conv1(x))))
        return F.adaptive_avg_pool2d(h, 1).flatten(1)


def nt_xent(z1, z2, t):
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    n = z1.shape[0]
    logits = z @ z.t() / t
    logits.fill_diagonal_(float("-inf"))
    target = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(z.device)
    return F.cross_entropy(logits, target)


def usage():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), r.ru_utime, r.ru_stime, r.ru_minflt


class Step:
    """The model, optimizer and input of one batch size; `run` times one training step."""

    def __init__(self, batch, width, depth=18, device="cpu"):
        torch.manual_seed(0)
        self.b = batch
        self.enc = ResNet18(width, depth).to(device)
        self.proj = nn.Sequential(nn.Linear(self.enc.feature_dim, 2048), nn.ReLU(), nn.Linear(2048, 128)).to(device)
        self.opt = torch.optim.SGD(list(self.enc.parameters()) + list(self.proj.parameters()), lr=0.1)
        self.x = torch.randn(2 * batch, 3, 32, 32, device=device)
        # On a GPU, phase boundaries wait for the device (as allgrad's side does).
        self.sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def run(self, probe=lambda phase: None):
        cuda = self.x.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start = usage()
        with torch.autocast(self.x.device.type, dtype=torch.bfloat16, enabled=ARGS.autocast):
            z = self.proj(self.enc(self.x))
        z = z.float()
        loss = nt_xent(z[: self.b], z[self.b :], 0.5)
        self.sync()
        at_fwd = usage()
        t_fwd = at_fwd[0]
        probe("fwd")
        self.opt.zero_grad()
        loss.backward()
        self.sync()
        at_bwd = usage()
        t_bwd = at_bwd[0]
        self.opt.step()
        self.sync()
        t_opt = time.perf_counter()
        del z, loss
        end = usage()
        wall, user, sys_, flt = (e - s for e, s in zip(end, start))
        # On a GPU: the peak of the caching allocator's allocated bytes during the step, in MiB.
        peak = f" gpu_peak={torch.cuda.max_memory_allocated() / 2**20:.1f}" if cuda else ""
        return (f"STEP wall={wall:.6f} user={user:.6f} sys={sys_:.6f} minflt={flt} "
                f"fwd={t_fwd - start[0]:.6f} bwd={t_bwd - t_fwd:.6f} opt={t_opt - t_bwd:.6f} "
                f"bwd_minflt={at_bwd[3] - at_fwd[3]}{peak}")


def resnet18_layers(width):
    """The layers of ResNet-18 with the CIFAR stem, by type, with their shapes (views omitted):
    conv_dx and conv_dw (cin, cout, k, stride, h_in: each convolution once with the input's
    gradient, once with the weight's), bn (c, h), relu (c, h), add (c, h), pool (c, h),
    linear (in, out), loss (dim). Mirrors `layers.rs` of the Rust benchmark."""
    out = {k: [] for k in ("conv_dx", "conv_dw", "bn", "relu", "add", "pool", "linear", "loss")}

    def conv_bn(cin, cout, k, stride, h):
        out["conv_dx"].append((cin, cout, k, stride, h))
        out["conv_dw"].append((cin, cout, k, stride, h))
        out["bn"].append((cout, h // stride))

    conv_bn(3, width, 3, 1, 32)
    out["relu"].append((width, 32))
    cin, h = width, 32
    for stage in range(4):
        planes = width << stage
        for i in range(2):
            stride = 2 if stage > 0 and i == 0 else 1
            conv_bn(cin, planes, 3, stride, h)
            out["relu"].append((planes, h // stride))
            conv_bn(planes, planes, 3, 1, h // stride)
            if stride != 1 or cin != planes:
                conv_bn(cin, planes, 1, stride, h)
            out["add"].append((planes, h // stride))
            out["relu"].append((planes, h // stride))
            cin, h = planes, h // stride
    out["pool"].append((cin, h))
    out["linear"] += [(cin, 2048), (2048, 128)]
    out["relu"].append((2048, 0))  # the projector's ReLU on [views, 2048]
    out["loss"].append((128,))
    return out


def layer_instance(kind, shape, n):
    """(inputs that need gradients, forward closure) for one layer at n views."""
    r = lambda *s: torch.randn(*s, requires_grad=True)
    if kind in ("conv_dx", "conv_dw"):
        # Only the input (conv_dx) or only the weight (conv_dw) requires a gradient.
        cin, cout, k, stride, h = shape
        x, w = torch.randn(n, cin, h, h), torch.randn(cout, cin, k, k)
        (x if kind == "conv_dx" else w).requires_grad_(True)
        return lambda: F.conv2d(x, w, None, stride, k // 2)
    if kind == "bn":
        c, h = shape
        bn = nn.BatchNorm2d(c)
        x = r(n, c, h, h)
        return lambda: bn(x)
    if kind == "relu":
        c, h = shape
        x = r(n, c, h, h) if h else r(n, c)
        return lambda: F.relu(x)
    if kind == "add":
        c, h = shape
        a, b = r(n, c, h, h), r(n, c, h, h)
        return lambda: a + b
    if kind == "pool":
        c, h = shape
        x = r(n, c, h, h)
        return lambda: F.adaptive_avg_pool2d(x, 1).flatten(1)
    if kind == "linear":
        lin = nn.Linear(*shape)
        x = r(n, shape[0])
        return lambda: lin(x)
    if kind == "loss":
        z = r(n, shape[0])
        return lambda: nt_xent(z[: n // 2], z[n // 2 :], 0.5)
    raise ValueError(kind)


def layer_times(batch, width):
    """Forward and backward seconds of every layer type, each layer timed alone: the forward,
    then `y.backward(g)` with a random upstream gradient `g` (the op's backward alone)."""
    lines = []
    for kind, shapes in resnet18_layers(width).items():
        fwd = bwd = 0.0
        for shape in shapes:
            forward = layer_instance(kind, shape, 2 * batch)
            t0 = time.perf_counter()
            y = forward()
            t1 = time.perf_counter()
            g = torch.randn_like(y)
            t2 = time.perf_counter()
            y.backward(g)
            t3 = time.perf_counter()
            fwd, bwd = fwd + t1 - t0, bwd + t3 - t2
            del y, g, forward
        lines.append(f"LAYER kind={kind} count={len(shapes)} fwd={fwd:.6f} bwd={bwd:.6f}")
    return lines


def status_mib(field):
    """A kB field of /proc/self/status, in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no {field} in /proc/self/status")


def memory(step):
    """The MEM line of `--memory` (see the module docs)."""
    setup = status_mib("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak resident set to the current one (Linux 4.0 and later)
    at_fwd = []
    for _ in range(ARGS.steps):
        step.run(lambda phase: at_fwd.append(status_mib("VmRSS:")) if phase == "fwd" and not at_fwd else None)
    print(f"MEM side=pytorch depth={ARGS.depth} batch={ARGS.batch} precision={'bf16' if ARGS.autocast else 'full'} "
          f"threads={torch.get_num_threads()} "
          f"steps={ARGS.steps} warmup_batch={ARGS.warmup_batch} setup={setup:.0f} fwd={at_fwd[0]:.0f} peak={status_mib('VmHWM:'):.0f} "
          f"torch={torch.__version__}", flush=True)


def main():
    torch.set_num_threads(ARGS.threads)
    if ARGS.device == "cuda":
        torch.backends.cudnn.allow_tf32 = ARGS.tf32
        torch.backends.cuda.matmul.allow_tf32 = ARGS.tf32
    if ARGS.memory:
        if ARGS.warmup_batch > 0:
            # Faults in the libraries' code and first allocations, which are not the step's.
            Step(ARGS.warmup_batch, ARGS.width, ARGS.depth, ARGS.device).run()
            # What it freed goes back to the system (glibc), as allgrad's side does.
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        memory(Step(ARGS.batch, ARGS.width, ARGS.depth, ARGS.device))
        return
    step = Step(ARGS.batch, ARGS.width, ARGS.depth, ARGS.device)
    if ARGS.profile:
        from torch.profiler import ProfilerActivity, profile

        for _ in range(2):
            step.run()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ARGS.device == "cuda" else [])
        with profile(activities=acts) as prof:
            for _ in range(ARGS.steps):
                print(step.run(), flush=True)
        key = "self_cuda_time_total" if ARGS.device == "cuda" else "self_cpu_time_total"
        print(f"torch.profiler key averages over {ARGS.steps} step(s), by {key}:")
        print(prof.key_averages().table(sort_by=key, row_limit=30), flush=True)
        return
    if not ARGS.worker:
        for _ in range(ARGS.steps + 1):  # the first step warms up
            print(step.run(), flush=True)
        print("\n".join(layer_times(ARGS.batch, ARGS.width)))
        return
    tf32 = f" tf32={'on' if ARGS.tf32 else 'off'}" if ARGS.device == "cuda" else ""
    print(f"READY torch={torch.__version__} threads={torch.get_num_threads()}{tf32}", flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "step":
            print(step.run(), flush=True)
        elif cmd == "layers":
            print("\n".join(layer_times(ARGS.batch, ARGS.width) + ["DONE"]), flush=True)
        elif cmd == "quit":
            break
        else:
            print(f"ERROR unknown command {cmd!r}", flush=True)


if __name__ == "__main__":
    main()
