#!/usr/bin/env bash
# What resuming a webdataset stream costs: the time to the first batch at 90% of an epoch of
# 50,000 JPEG samples, read forward from the epoch's start (a checkpoint without a saved stream
# position) and from the saved position (shards opened at their offsets, shuffle buffers read
# again), with the samples each read.
#
#   scripts/bench/bench_stream_resume.sh [--rounds 3] [any bench_stream_resume option ...]
#
# The shards (50,000 JPEGs of 256x256, about 1 GB) are written once into
# $ALLGRAD_RESUME_SHARDS (default data/resume-bench/, git-ignored) and reused. Run it on an idle
# machine: it prints the load average before and after. Raw output goes to $BENCH_OUT (default:
# a new temporary folder); each round prints RESULT lines (forward and saved: seconds, samples
# read) and a CHECK line (the resumed batch equals the uninterrupted one).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SHARDS="${ALLGRAD_RESUME_SHARDS:-$ROOT/data/resume-bench}"
OUT="${BENCH_OUT:-$(mktemp -d "${TMPDIR:-/tmp}/allgrad-bench-resume.XXXXXX")}"
mkdir -p "$OUT"
ROUNDS=3
EXTRA=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        --rounds) ROUNDS="$2"; shift 2 ;;
        *) EXTRA+=("$1"); shift ;;
    esac
done
(cd "$ROOT" && cargo build --release -q -p allgrad-bench --bin bench_stream_resume)
BIN="$ROOT/target/release/bench_stream_resume"
echo "load average (1, 5, 15 min): $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) cores"
for r in $(seq 1 "$ROUNDS"); do
    echo "round $r"
    "$BIN" --shards "$SHARDS" "${EXTRA[@]+"${EXTRA[@]}"}" | tee "$OUT/round-$r.txt"
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "raw output: $OUT"
