#!/usr/bin/env python3
"""The PyTorch side of the face-head benchmark (scripts/bench/bench_face_head.sh): Partial FC v2
as insightface's arcface_torch trains it, reimplemented here from the algorithm, with gloo on
the CPU, W ranks as processes (torch.multiprocessing spawn).

Per rank: the weight of its contiguous class range ([C/W, D], the first C % W ranks one row
longer, N(0, 0.01) as insightface initialises it); per step:
- all_gather of the local embeddings (autograd: the backward reduces each rank's slice of the
  gradient to that rank, then multiplies by W, insightface's factor that undoes DDP's
  average) and of the labels (plain);
- Partial FC at rate r < 1: every positive class of this rank plus random negatives, int(r *
  C/W) rows in all (torch.rand + topk, as v2 does), labels remapped to the sampled columns;
  the weight is indexed by them, so the dense gradient is zero outside;
- cosine logits of the whole global batch against the (sampled) rows, clamped to [-1, 1];
- the margin on the target logit under no_grad, as insightface applies it (ArcFace m 0.5 with
  the fallback t - m sin m where theta + m passes pi, or CosFace m 0.4; s 64);
- the distributed cross-entropy: all_reduce MAX of the row maxima, exp in place, all_reduce
  SUM of the row sums and of the target probabilities, -mean log; its backward is
  (softmax - onehot) / B on the local columns;
- loss.backward(), then torch.optim.SGD (momentum 0.9, weight decay 5e-4) on the whole weight
  (with sampling, momentum and weight decay move unsampled rows too, as in v2).
The embeddings are a fixed random [B, D] input (this rank's rows of it), a leaf that receives
its gradient.

    python3 scripts/bench/bench_face_head.py --nproc 2 --classes 100000 --rate 0.1 --steps 3
    python3 scripts/bench/bench_face_head.py --nproc 2 --classes 1000 --check DIR   # allgrad's dump

Prints the same lines as crates/allgrad-bench/src/bin/bench_face_head.rs, with impl=torch: face_head_setup,
face_head_step (rank 0, the slowest rank's times), face_head_mem (every rank), or with --check
face_head_check: the losses of steps 0, 1 and 2 (an optimizer step between each) on the
embeddings, labels, initial centres and per-step sampled classes that `bench_face_head --dump
DIR` wrote (the later losses are comparable with CosFace only: insightface's margin is not
differentiated, allgrad's is; CosFace's has slope 1). Exits 2 when torch cannot be imported.
"""
import argparse
import math
import os
import socket
import sys
import time


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=1, help="ranks (processes)")
    p.add_argument("--classes", type=int, required=True)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--global-batch", type=int, default=512)
    p.add_argument("--rate", type=float, default=1.0, help="Partial FC sample rate (1: all classes)")
    p.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--margin", choices=["arcface", "cosface"], default="arcface")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", help="a folder written by bench_face_head --dump: print the first-step loss on it")
    a = p.parse_args()
    if a.global_batch % a.nproc:
        p.error(f"--global-batch {a.global_batch} must be a multiple of --nproc {a.nproc} (equal local batches)")
    if a.classes < a.nproc or not 0.0 < a.rate <= 1.0:
        p.error("every rank needs a class, and --rate must be in (0, 1]")
    return a


def split(total, rank, world):
    """Rank `rank`'s contiguous part (start, length) of `total` rows, the first total % world
    ranks one longer (as allgrad's RowRange and insightface's class split)."""
    base, extra = divmod(total, world)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def status_mib(field):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return float(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


def reset_peak_rss():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def build(torch, dist):
    """The autograd functions and the head, defined once torch is imported."""
    F = torch.nn.functional

    class AllGather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, x.contiguous())
            return torch.cat(parts)

        @staticmethod
        def backward(ctx, grad):
            w, rank = dist.get_world_size(), dist.get_rank()
            parts = [g.contiguous() for g in grad.chunk(w)]
            for work in [dist.reduce(parts[i], i, dist.ReduceOp.SUM, async_op=True) for i in range(w)]:
                work.wait()
            return parts[rank] * w

    class DistCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, labels):
            b = logits.size(0)
            mx = logits.max(dim=1, keepdim=True)[0]
            dist.all_reduce(mx, dist.ReduceOp.MAX)
            logits.sub_(mx).exp_()
            total = logits.sum(dim=1, keepdim=True)
            dist.all_reduce(total, dist.ReduceOp.SUM)
            logits.div_(total)
            idx = torch.where(labels != -1)[0]
            p = torch.zeros(b, 1, dtype=logits.dtype)
            p[idx] = logits[idx].gather(1, labels[idx, None])
            dist.all_reduce(p, dist.ReduceOp.SUM)
            ctx.save_for_backward(idx, logits, labels)
            return p.clamp_min(1e-30).log().mean() * -1

        @staticmethod
        def backward(ctx, grad):
            idx, probs, labels = ctx.saved_tensors
            onehot = torch.zeros(idx.numel(), probs.size(1), dtype=probs.dtype)
            onehot.scatter_(1, labels[idx, None], 1.0)
            probs[idx] -= onehot
            probs.div_(probs.size(0))
            return probs * grad.item(), None

    class PartialFC(torch.nn.Module):
        def __init__(self, a, weight, start, forced=None):
            super().__init__()
            self.a, self.start, self.num_local = a, start, weight.size(0)
            self.num_sample = int(a.rate * self.num_local)
            self.weight = torch.nn.Parameter(weight)
            self.forced = forced  # per step, the local rows to sample (the check), else random ones
            self.step = 0

        def sample(self, labels, mine):
            with torch.no_grad():
                positive = torch.unique(labels[mine], sorted=True)
                if self.forced is not None:
                    index = self.forced[self.step]
                elif self.num_sample >= positive.numel():
                    perm = torch.rand(self.num_local)
                    perm[positive] = 2.0
                    index = torch.topk(perm, k=self.num_sample)[1].sort()[0]
                else:
                    index = positive
                labels[mine] = torch.searchsorted(index, labels[mine])
            return self.weight[index]

        def margin(self, logits, labels):
            idx = torch.where(labels != -1)[0]
            target = logits[idx, labels[idx]]
            with torch.no_grad():
                if self.a.margin == "arcface":
                    m = 0.5
                    theta = target.acos()
                    new = torch.where(theta + m > math.pi, target - m * math.sin(m), torch.cos(theta + m))
                else:
                    new = target - 0.4
                logits[idx, labels[idx]] = new
            return logits * 64.0

        def forward(self, local_emb, local_labels):
            emb = AllGather.apply(local_emb)
            parts = [torch.empty_like(local_labels) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, local_labels)
            labels = torch.cat(parts)
            mine = (labels >= self.start) & (labels < self.start + self.num_local)
            labels[~mine] = -1
            labels[mine] -= self.start
            weight = self.sample(labels, mine) if self.a.rate < 1.0 else self.weight
            logits = F.linear(F.normalize(emb), F.normalize(weight)).clamp(-1, 1)
            return DistCrossEntropy.apply(self.margin(logits, labels), labels)

    return PartialFC


def load_check(torch, folder, classes):
    """The global embeddings, labels, initial centres and sampled class ids of a dump."""
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(folder) if f.startswith("rank") and f.endswith(".safetensors"))
    parts = [load_file(os.path.join(folder, f"rank{r}.safetensors")) for r in range(len(files))]
    if not parts or parts[-1]["range"][0] + parts[-1]["range"][1] != classes:
        sys.exit(f"{folder}: no dump of {classes} classes")
    cat = lambda k: torch.cat([p[k] for p in parts])  # noqa: E731
    steps = sum(1 for k in parts[0] if k.startswith("sampled_"))
    sampled = [cat(f"sampled_{k}") for k in range(steps)]
    return cat("embeddings"), cat("labels"), cat("centres"), sampled


def rank_main(rank, a, port):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=a.nproc)
    w = a.nproc
    start, num_local = split(a.classes, rank, w)
    b = a.global_batch // w
    forced = None
    if a.check:
        emb, labels, centres, sampled = load_check(torch, a.check, a.classes)
        weight = centres[start:start + num_local].clone()
        forced = [s[(s >= start) & (s < start + num_local)] - start for s in sampled] if a.rate < 1.0 else None
        check_steps = len(sampled)
    else:
        g = torch.Generator().manual_seed(a.seed)
        emb = torch.randn(a.global_batch, a.dim, generator=g)
        labels = torch.randint(0, a.classes, (a.global_batch,), generator=g)
        weight = torch.normal(0.0, 0.01, (num_local, a.dim), generator=torch.Generator().manual_seed(a.seed * 1000 + rank + 1))
    local_emb = emb[rank * b:(rank + 1) * b].clone().requires_grad_(True)
    local_labels = labels[rank * b:(rank + 1) * b].clone()
    head = build(torch, dist)(a, weight, start, forced)
    if rank == 0:
        print(f"face_head_setup impl=torch world={w} threads_per_rank={torch.get_num_threads()} torch={torch.__version__} "
              f"classes={a.classes} dim={a.dim} global_batch={a.global_batch} rate={a.rate} margin={a.margin}", flush=True)
    opt = torch.optim.SGD([head.weight], lr=a.lr, momentum=a.momentum, weight_decay=a.weight_decay)
    if a.check:
        losses = []
        for step in range(check_steps):
            head.step = step
            loss = head(local_emb, local_labels)
            losses.append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if rank == 0:
            shown = " ".join(f"loss{'' if k == 0 else k + 1}={v:.9f}" for k, v in enumerate(losses))
            print(f"face_head_check impl=torch world={w} {shown}", flush=True)
        # Every rank leaves the group together: a rank that tears gloo down while another is
        # still in a collective aborts the job (seen with 2 ranks and CosFace).
        dist.barrier()
        dist.destroy_process_group()
        return
    init_mib = status_mib("VmRSS")
    reset = reset_peak_rss()
    for step in range(a.warmup + a.steps):
        dist.barrier()
        t0 = time.perf_counter()
        loss = head(local_emb, local_labels)
        t1 = time.perf_counter()
        loss.backward()
        if local_emb.grad is None:
            raise RuntimeError("no gradient reached the embeddings")
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        local_emb.grad = None
        t3 = time.perf_counter()
        t = torch.tensor([t3 - t0, t1 - t0, t2 - t1, t3 - t2], dtype=torch.float64)
        dist.all_reduce(t, dist.ReduceOp.MAX)
        if rank == 0:
            print(f"face_head_step impl=torch step={step} timed={int(step >= a.warmup)} wall={t[0]:.6f} fwd={t[1]:.6f} "
                  f"bwd={t[2]:.6f} opt={t[3]:.6f} loss={loss.item():.7f}", flush=True)
    dist.barrier()
    print(f"face_head_mem rank={rank} init_mib={init_mib:.1f} peak_mib={status_mib('VmHWM'):.1f} "
          f"peak_from={'steps' if reset else 'process'}", flush=True)
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    a = parse()
    try:
        import torch.multiprocessing as mp
    except ImportError as e:
        print(f"no PyTorch: {e}", file=sys.stderr)
        sys.exit(2)
    mp.spawn(rank_main, args=(a, free_port()), nprocs=a.nproc, join=True)


if __name__ == "__main__":
    main()
