#!/usr/bin/env python3
"""PyTorch gloo beside `bench_scale_ranks`: the same measurements for one rank of a job
started by torchrun (`torchrun --nproc-per-node W scripts/bench/bench_scale_gloo.py --out DIR`).

Each rank: init_process_group("gloo") and one barrier (times counted from
ALLGRAD_SCALE_T0_NS, set by the caller just before starting torchrun, so they include
starting W Python processes and importing torch), open file descriptors, threads and memory
(RSS, private memory), the mean time of --iters calls of a 4-byte and a 1 MiB all_reduce and
of an all_gather of 4 bytes per rank and of 1 MiB in all (max over ranks), written to
DIR/rank-N.txt as `key value` lines, as bench_scale_ranks's ranks write theirs. Then, unless
--no-kill, rank --victim (default W/2) SIGKILLs itself while the others wait in a 4-byte
all_reduce; each survivor notes when its call failed and whether the error names the rank.
Survivors ignore SIGTERM meanwhile, so that torchrun's stopping of the job does not cut the
measurement short.

`--summarise DIR --nproc W` prints the row from the reports (used by
scripts/bench/bench_scale_ranks.sh).
"""

import argparse
import os
import re
import signal
import sys
import time
from datetime import timedelta

MEASURED = [("all_reduce 4 B", "ar4"), ("all_reduce 1 MiB", "ar1m"), ("all_gather 4 B per rank", "ag4"), ("all_gather 1 MiB out", "ag1m")]


def field(text, key):
    for line in text.splitlines():
        if line.startswith(key):
            return int(line.split()[1])
    return None


def rank_main(a):
    started = time.time_ns()
    t0 = int(os.environ.get("ALLGRAD_SCALE_T0_NS", started))
    import torch
    import torch.distributed as dist

    secs = lambda t: max(0, t - t0) / 1e9
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.timeout_s))
    formed = time.time_ns()
    dist.barrier()
    ready = time.time_ns()
    rank, w = dist.get_rank(), dist.get_world_size()
    path = os.path.join(a.out, f"rank-{rank}.txt")
    lines = []

    def put(k, v):
        lines.append(f"{k} {v}")

    def flush():
        with open(path + ".tmp", "w") as f:
            f.write("\n".join(lines) + "\n")
        os.replace(path + ".tmp", path)

    put("started_s", secs(started))
    put("formed_s", secs(formed))
    put("ready_s", secs(ready))
    put("fds", len(os.listdir("/proc/self/fd")))
    st = open("/proc/self/status").read()
    for key, name in (("VmRSS:", "rss_kb"), ("VmHWM:", "hwm_kb"), ("Threads:", "threads")):
        v = field(st, key)
        if v is not None:
            put(name, v)
    roll = open("/proc/self/smaps_rollup").read()
    put("uss_kb", (field(roll, "Private_Clean:") or 0) + (field(roll, "Private_Dirty:") or 0))
    put("pss_kb", field(roll, "Pss:") or 0)
    flush()

    torch.set_num_threads(1)
    big_n = (1 << 20) // 4
    ar_small = torch.ones(1)
    ar_big = torch.ones(big_n)
    ag_per = max(1, big_n // w)
    ag_own = torch.full((ag_per,), float(rank))
    ag_big = torch.zeros(ag_per * w)
    small = torch.full((1,), float(rank))
    ag_small = torch.zeros(w)

    def call(key):
        if key == "ar4":
            ar_small.fill_(1.0)
            dist.all_reduce(ar_small)
            assert ar_small.item() == w, f"all_reduce returned {ar_small.item()}, expected {w}"
        elif key == "ar1m":
            dist.all_reduce(ar_big, op=dist.ReduceOp.MAX)
        elif key == "ag4":
            dist.all_gather_into_tensor(ag_small, small)
            assert torch.equal(ag_small, torch.arange(w, dtype=torch.float32)), "all_gather returned a wrong result"
        else:
            dist.all_gather_into_tensor(ag_big, ag_own)

    for _, key in MEASURED:
        for _ in range(2):
            call(key)
        dist.barrier()
        t = time.perf_counter()
        for _ in range(a.iters):
            call(key)
        el = torch.tensor([(time.perf_counter() - t) / max(1, a.iters)], dtype=torch.float64)
        dist.all_reduce(el, op=dist.ReduceOp.MAX)
        put(f"{key}_us", el.item() * 1e6)
        flush()
    dist.barrier()
    put("pss_end_kb", field(open("/proc/self/smaps_rollup").read(), "Pss:") or 0)
    flush()
    if a.no_kill:
        dist.destroy_process_group()
        return 0

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    victim = a.victim if a.victim is not None else w // 2
    if rank == victim:
        time.sleep(0.3)
        put("kill_ns", time.time_ns())
        flush()
        os.kill(os.getpid(), signal.SIGKILL)
    x = torch.ones(1)
    try:
        while True:
            dist.all_reduce(x)
    except Exception as e:  # gloo raises RuntimeError (or DistBackendError) on a lost peer
        msg = str(e).replace("\n", " ")
        put("detect_ns", time.time_ns())
        put("named_victim", int(re.search(rf"rank {victim}(?!\d)", msg) is not None))
        put("error", msg[:500])
        flush()
    os._exit(1)


def summarise(a):
    w = a.nproc
    reps = []
    for r in range(w):
        try:
            d = {}
            for line in open(os.path.join(a.summarise, f"rank-{r}.txt")):
                k, _, v = line.rstrip("\n").partition(" ")
                d[k] = v
            reps.append(d)
        except OSError:
            reps.append(None)

    def col(k):
        return sorted(float(m[k]) for m in reps if m and k in m)

    print(f"== gloo (torchrun), W = {w} ranks")
    print(f"   reports: {sum(1 for m in reps if m)} of {w} ranks")
    for label, k, scale, unit in (
        ("process started (since harness)", "started_s", 1, "s"),
        ("group formed (since harness)", "formed_s", 1, "s"),
        ("first barrier done (since harness)", "ready_s", 1, "s"),
        ("open fds", "fds", 1, ""),
        ("threads", "threads", 1, ""),
        ("RSS (shared pages counted whole)", "rss_kb", 1 / 1024, "MiB"),
        ("PSS (shared pages split)", "pss_kb", 1 / 1024, "MiB"),
        ("private memory (USS)", "uss_kb", 1 / 1024, "MiB"),
        ("PSS after the collectives", "pss_end_kb", 1 / 1024, "MiB"),
    ):
        v = [x * scale for x in col(k)]
        if v:
            print(f"   {label:<34} min {v[0]:>10.3f}  median {v[len(v) // 2]:>10.3f}  max {v[-1]:>10.3f} {unit} ({len(v)} ranks)")
        else:
            print(f"   {label:<34} (no rank reported it)")
    for label, k in MEASURED:
        t = reps[0].get(f"{k}_us") if reps and reps[0] else None
        print(f"   {label:<34} {float(t):>12.1f} us per call" if t else f"   {label:<34} (not measured)")
    if not a.no_kill:
        victim = a.victim if a.victim is not None else w // 2
        vk = reps[victim].get("kill_ns") if victim < w and reps[victim] else None
        det = col("detect_ns")
        named = sum(1 for m in reps if m and m.get("named_victim") == "1")
        if vk and det:
            lat = [(d - float(vk)) / 1e6 for d in det]
            print(
                f"   rank {victim} SIGKILLed: {len(det)} of {w - 1} survivors failed, {named} naming it; "
                f"after min {lat[0]:.1f} median {lat[len(lat) // 2]:.1f} max {lat[-1]:.1f} ms"
            )
        else:
            print(f"   kill phase: {'no survivor reported a failure' if vk else f'rank {victim} did not reach it'}")
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="folder for this job's reports")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--no-kill", action="store_true")
    p.add_argument("--victim", type=int, default=None)
    p.add_argument("--summarise", default=None, help="print the row from the reports in this folder")
    p.add_argument("--nproc", type=int, default=None, help="with --summarise: the world size")
    a = p.parse_args()
    if a.summarise:
        return summarise(a)
    if "RANK" not in os.environ or not a.out:
        p.error("run under torchrun with --out DIR, or with --summarise DIR --nproc W")
    return rank_main(a)


if __name__ == "__main__":
    sys.exit(main())
