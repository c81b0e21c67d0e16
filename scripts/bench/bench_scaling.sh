#!/usr/bin/env bash
# Scaling across ranks on one machine: the same SimCLR training steps at the same global batch
# on W = 2 processes x 1 thread (`launch --nproc-per-node 2`, RAYON_NUM_THREADS=1) and on
# W = 1 process x 2 threads, alternating A B A B ... in one invocation; prints each side's
# min / median / max wall seconds and the scaling efficiency t(1 x 2) / t(2 x 1) of medians
# (the whole process: start-up and data loading included, the same on both sides)
# (1.0: two single-threaded ranks with their collectives are as fast as one rank using both
# cores).
#
#   scripts/bench/bench_scaling.sh [ROUNDS=3] [STEPS=6]      (config: configs/simclr.yaml, eval off)
#
# Run it on an idle machine: it prints the load average before and after.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS="${1:-3}"
STEPS="${2:-6}"
cargo build --release -q --bin train --bin launch >&2
OUT="$(mktemp -d "${TMPDIR:-/tmp}/allgrad-scaling.XXXXXX")"
SETS=(--set "train.max_steps=$STEPS" --set train.eval=false --set checkpoint.every=1000000 --set log.progress=quiet --set log.plot=false)
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) CPUs; $ROUNDS rounds of $STEPS steps, global batch 256"
run() { # $1: label, rest: command
    local label=$1; shift
    local t0=$EPOCHREALTIME
    "$@" > "$OUT/$label.log" 2>&1 || { echo "$label failed:" >&2; tail -20 "$OUT/$label.log" >&2; exit 1; }
    awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.3f", b - a }'
}
A=(); B=()
for r in $(seq "$ROUNDS"); do
    rm -rf "$OUT/a" "$OUT/b"
    A+=("$(RAYON_NUM_THREADS=1 run w2x1 target/release/launch --nproc-per-node 2 target/release/train --config configs/simclr.yaml "${SETS[@]}" --output-dir "$OUT/a")")
    B+=("$(RAYON_NUM_THREADS=2 run w1x2 target/release/train --config configs/simclr.yaml "${SETS[@]}" --output-dir "$OUT/b")")
    echo "round $r: 2 x 1 thread ${A[-1]} s, 1 x 2 threads ${B[-1]} s"
done
python3 - "${A[*]}" "${B[*]}" <<'PY'
import statistics, sys
a = [float(v) for v in sys.argv[1].split()]
b = [float(v) for v in sys.argv[2].split()]
for name, v in (("W=2 x 1 thread ", a), ("W=1 x 2 threads", b)):
    print(f"{name}: min {min(v):.2f} s  median {statistics.median(v):.2f} s  max {max(v):.2f} s")
print(f"scaling efficiency t(1x2)/t(2x1) of medians: {statistics.median(b) / statistics.median(a):.3f}")
PY
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
