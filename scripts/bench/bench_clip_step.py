#!/usr/bin/env python3
"""OpenCLIP's side of the CLIP step benchmark: one CLIP training step on the CPU with
open-clip-torch 3.3.0's own `CLIP` model (a ViT image tower and the causal text transformer,
built from `CLIPVisionCfg` / `CLIPTextCfg` of the sizes given, exact GELU, freshly initialised,
f32) and its `ClipLoss` on one rank, the forward of both towers, the loss, backward, then
`torch.optim.AdamW` with OpenCLIP's parameter groups (no weight decay on 1-D parameters,
biases, norms and the logit scale, as its `main.py` makes them) and the logit scale clamped to
[0, ln 100] after the update, as OpenCLIP's training loop does. The same step as allgrad's
`crates/allgrad-bench/src/bin/bench_clip_step/`, which drives this script as a worker so that
the two alternate step by step in one invocation (`scripts/bench/bench_clip_step.sh`).

    python3 scripts/bench/bench_clip_step.py --batch 64 --steps 3            # a quick look, alone
    python3 scripts/bench/bench_clip_step.py --batch 64 --profile 2          # torch.profiler's table
    python3 scripts/bench/bench_clip_step.py --batch 64 --worker             # serve the driver

Inputs, made once: `batch` images of N(0, 1) pixels and `batch` captions of `--context` tokens
each (ids below the end-of-text id, the end-of-text id `vocab - 1` last, where OpenCLIP's argmax
pooling finds it); no data loading in the timed part.

Worker protocol: one command per line on stdin (`step`, `profile N`, `quit`); `step` answers one
line `STEP wall= user= sys= minflt= fwd= bwd= opt= bwd_minflt=` (seconds, faults; user, sys and
minor faults from getrusage(RUSAGE_SELF), all threads of this process); `profile N` answers
torch.profiler's operator table over N steps (after one untimed step), then `DONE`. The first
line is `READY torch=<version> open_clip=<version> threads=<n> interop=<n> params=<n>`.

Only OpenCLIP's model and loss modules are loaded, without running the package's __init__
(it imports the tokenizer's dependencies, not installed: the package is installed with
--no-deps by scripts/ci/get_torch.sh). The thread count (`--threads`, default 2) goes to
torch.set_num_threads, torch.set_num_interop_threads and, before torch is imported, to
OMP_NUM_THREADS and MKL_NUM_THREADS. Without torch or open-clip-torch this exits with status 2.
"""
import argparse
import importlib.metadata
import importlib.util
import math
import os
import resource
import sys
import time
import types

OPEN_CLIP = "3.3.0"


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64, help="image-caption pairs per step")
    ap.add_argument("--threads", type=int, default=2, help="intra- and inter-op threads")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--patch", type=int, default=32)
    ap.add_argument("--vision-width", type=int, default=384)
    ap.add_argument("--vision-layers", type=int, default=6)
    ap.add_argument("--text-width", type=int, default=256)
    ap.add_argument("--text-layers", type=int, default=6)
    ap.add_argument("--context", type=int, default=77)
    ap.add_argument("--vocab", type=int, default=49408)
    ap.add_argument("--embed-dim", type=int, default=256)
    ap.add_argument("--head-width", type=int, default=64, help="heads = width / head width in both towers")
    ap.add_argument("--steps", type=int, default=3, help="timed steps when run alone")
    ap.add_argument("--profile", type=int, default=0, help="alone: torch.profiler's table over this many steps")
    ap.add_argument("--worker", action="store_true", help="serve step/profile/quit commands on stdin")
    return ap.parse_args()


ARGS = parse_args()
for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(ARGS.threads)
try:
    import torch
except ImportError:
    print("bench_clip_step.py: PyTorch is not installed (scripts/ci/get_torch.sh)", file=sys.stderr)
    sys.exit(2)
sys.dont_write_bytecode = True  # no __pycache__ in scripts/


def load_open_clip():
    """OpenCLIP's `CLIP`, `CLIPVisionCfg`, `CLIPTextCfg` and `ClipLoss`, from the installed
    open-clip-torch of the pinned version; exits 2 without it."""
    try:
        got = importlib.metadata.version("open_clip_torch")
    except importlib.metadata.PackageNotFoundError:
        print("bench_clip_step.py: open-clip-torch is not installed (scripts/ci/get_torch.sh)", file=sys.stderr)
        sys.exit(2)
    if got != OPEN_CLIP:
        print(f"bench_clip_step.py: open-clip-torch {got} is installed; the benchmark is pinned to {OPEN_CLIP}",
              file=sys.stderr)
        sys.exit(2)
    spec = importlib.util.find_spec("open_clip")
    # The package as an empty module over its folder: its submodules import each other
    # relatively, and its __init__ (the tokenizer's dependencies) is not run.
    pkg = types.ModuleType("open_clip")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["open_clip"] = pkg
    from open_clip.loss import ClipLoss
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

    return CLIP, CLIPVisionCfg, CLIPTextCfg, ClipLoss, got


CLIP, CLIPVisionCfg, CLIPTextCfg, ClipLoss, OPEN_CLIP_VERSION = load_open_clip()


def usage():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), r.ru_utime, r.ru_stime, r.ru_minflt


def captions(batch, context, vocab):
    """The captions allgrad's side makes (`step::captions`): ids from the same linear
    congruential sequence, the end-of-text id last."""
    state, mask = 0x9E3779B97F4A7C15, (1 << 64) - 1
    rows = []
    for _ in range(batch):
        row = []
        for _ in range(context - 1):
            state = (state * 6364136223846793005 + 1442695040888963407) & mask
            row.append((state >> 33) % (vocab - 2) + 1)
        rows.append(row + [vocab - 1])
    return torch.tensor(rows, dtype=torch.long)


class Step:
    """The model, its AdamW and the fixed inputs of one batch size; `run` times one step."""

    def __init__(self, a):
        torch.manual_seed(0)
        vision = CLIPVisionCfg(layers=a.vision_layers, width=a.vision_width, head_width=a.head_width,
                               mlp_ratio=4.0, patch_size=a.patch, image_size=a.image_size)
        text = CLIPTextCfg(context_length=a.context, vocab_size=a.vocab, width=a.text_width,
                           heads=a.text_width // a.head_width, layers=a.text_layers, mlp_ratio=4.0)
        self.model = CLIP(a.embed_dim, vision, text, quick_gelu=False)
        self.model.train()
        self.loss = ClipLoss()
        # OpenCLIP's main.py: no weight decay on 1-D parameters, norms, biases and the scale.
        exclude = lambda n, p: p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n
        named = list(self.model.named_parameters())
        decay = [p for n, p in named if not exclude(n, p) and p.requires_grad]
        rest = [p for n, p in named if exclude(n, p) and p.requires_grad]
        self.opt = torch.optim.AdamW(
            [{"params": rest, "weight_decay": 0.0}, {"params": decay, "weight_decay": 0.2}],
            lr=5e-4, betas=(0.9, 0.98), eps=1e-6)
        self.images = torch.randn(a.batch, 3, a.image_size, a.image_size)
        self.text = captions(a.batch, a.context, a.vocab)
        self.params = sum(p.numel() for p in self.model.parameters())

    def run(self):
        start = usage()
        image_features, text_features, logit_scale = self.model(self.images, self.text)
        loss = self.loss(image_features, text_features, logit_scale)
        at_fwd = usage()
        t_fwd = at_fwd[0]
        self.opt.zero_grad()
        loss.backward()
        at_bwd = usage()
        t_bwd = at_bwd[0]
        self.opt.step()
        with torch.no_grad():
            self.model.logit_scale.clamp_(0, math.log(100))
        t_opt = time.perf_counter()
        del loss, image_features, text_features, logit_scale
        end = usage()
        wall, user, sys_, flt = (e - s for e, s in zip(end, start))
        return (f"STEP wall={wall:.6f} user={user:.6f} sys={sys_:.6f} minflt={flt} "
                f"fwd={t_fwd - start[0]:.6f} bwd={t_bwd - t_fwd:.6f} opt={t_opt - t_bwd:.6f} "
                f"bwd_minflt={at_bwd[3] - at_fwd[3]}")

    def profile(self, steps):
        """torch.profiler's operators by self CPU time over `steps` steps (after one untimed)."""
        from torch.profiler import ProfilerActivity, profile

        self.run()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                self.run()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        return [line for line in table.splitlines() if line.strip()]


def main():
    torch.set_num_threads(ARGS.threads)
    torch.set_num_interop_threads(ARGS.threads)
    step = Step(ARGS)
    if ARGS.profile > 0 and not ARGS.worker:
        print("\n".join(step.profile(ARGS.profile)))
        return
    if not ARGS.worker:
        for _ in range(ARGS.steps + 1):  # the first step warms up
            print(step.run(), flush=True)
        return
    print(f"READY torch={torch.__version__} open_clip={OPEN_CLIP_VERSION} threads={torch.get_num_threads()} "
          f"interop={torch.get_num_interop_threads()} params={step.params}", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd == ["step"]:
            print(step.run(), flush=True)
        elif len(cmd) == 2 and cmd[0] == "profile" and cmd[1].isdigit():
            print("\n".join(step.profile(int(cmd[1])) + ["DONE"]), flush=True)
        elif cmd == ["quit"]:
            break
        else:
            print(f"ERROR unknown command {line.strip()!r}", flush=True)


if __name__ == "__main__":
    main()
