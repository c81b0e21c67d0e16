#!/usr/bin/env bash
# allgrad's collectives next to PyTorch gloo's, on this machine's CPU over loopback TCP.
#
#   scripts/bench/bench_collectives.sh [--nproc 2] [--min-bytes 1K] [--max-bytes 256M] \
#       [--ops all_reduce,all_gather,reduce_scatter] [--iters N] [--warmup N] [--dtype f32]
#
# Builds and runs `bench_collectives`, then scripts/bench/bench_gloo.py with the same
# arguments if `import torch` works (else it says so and shows allgrad's numbers alone), then
# prints one table per collective: size, both busbw figures and the ratio allgrad/gloo.
# Both write JSON lines into $BENCH_OUT (default: a new temporary folder, kept and named at the
# end). ALLGRAD_BENCH_BIN names a prebuilt bench_collectives to skip the build; PYTHON picks the
# interpreter (default python3).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
OUT="${BENCH_OUT:-$(mktemp -d "${TMPDIR:-/tmp}/allgrad-bench.XXXXXX")}"
mkdir -p "$OUT"

for a in "$@"; do
    case "$a" in
        --json|--json=*) echo "bench_collectives.sh: --json is set by this script (files go to \$BENCH_OUT)" >&2; exit 64 ;;
        -h|--help) sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    esac
done

if [[ -n "${ALLGRAD_BENCH_BIN:-}" ]]; then
    BIN="$ALLGRAD_BENCH_BIN"
else
    (cd "$ROOT" && cargo build --release -p allgrad-bench --bin bench_collectives)
    BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release/bench_collectives"
fi
[[ -x "$BIN" ]] || { echo "bench_collectives.sh: no bench_collectives binary at $BIN" >&2; exit 1; }

echo "== allgrad (allgrad-dist CPU backend: shared memory on one host, TCP between hosts)"
"$BIN" "$@" --json "$OUT/allgrad.jsonl"

GLOO=0
if "$PYTHON" -c "import torch, torch.distributed" >/dev/null 2>&1; then
    echo
    echo "== PyTorch gloo"
    "$PYTHON" "$ROOT/scripts/bench/bench_gloo.py" "$@" --json "$OUT/gloo.jsonl"
    GLOO=1
else
    echo
    echo "== PyTorch is not importable with $PYTHON: skipping the gloo baseline (pip install torch, ~5 GB)"
fi

echo
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "(no $PYTHON to join the tables; allgrad's rows are in $OUT/allgrad.jsonl)"
    exit 0
fi
"$PYTHON" "$ROOT/scripts/bench/bench_table.py" "$OUT/allgrad.jsonl" "$OUT/gloo.jsonl" "$GLOO"
if [[ "$GLOO" == 1 ]]; then
    echo "(JSON lines: $OUT/allgrad.jsonl and $OUT/gloo.jsonl)"
else
    echo "(JSON lines: $OUT/allgrad.jsonl)"
fi
