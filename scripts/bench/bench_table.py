#!/usr/bin/env python3
"""Joins the JSON lines of `bench_collectives` and scripts/bench/bench_gloo.py into one table
per collective: size, time per call, busbw of both and the ratio allgrad/gloo.

    bench_table.py ALLGRAD.jsonl GLOO.jsonl HAVE_GLOO(0|1)
"""
import json, os, sys

def load(path):
    rows = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    rows[(r["op"], r["bytes"])] = r
    return rows

ours = load(sys.argv[1])
gloo = load(sys.argv[2]) if sys.argv[3] == "1" else {}
ops = []
for op, _ in ours:
    if op not in ops:
        ops.append(op)
w = next(iter(ours.values()))["world_size"] if ours else "?"
for op in ops:
    print(f"# {op}, {w} ranks: busbw in GB/s (nccl-tests convention), time per call in us")
    print(f"{'size(B)':>12} {'allgrad us':>11} {'gloo us':>11} {'allgrad busbw':>14} {'gloo busbw':>11} {'allgrad/gloo':>13}")
    for (o, size) in sorted(k for k in ours if k[0] == op):
        a = ours[(o, size)]
        g = gloo.get((o, size))
        gt = f"{g['time_us']:11.1f}" if g else f"{'-':>11}"
        gb = f"{g['busbw_gbps']:11.3f}" if g else f"{'-':>11}"
        ratio = f"{a['busbw_gbps'] / g['busbw_gbps']:13.2f}" if g and g["busbw_gbps"] > 0 else f"{'-':>13}"
        print(f"{size:>12} {a['time_us']:11.1f} {gt} {a['busbw_gbps']:14.3f} {gb} {ratio}")
    print()
