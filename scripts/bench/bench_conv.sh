#!/usr/bin/env bash
# Conv2d on this machine's CPU: Candle vs allgrad-nn vs PyTorch, side by side with ratios.
#
#   scripts/bench/bench_conv.sh [--rounds 3] [--runs 5] [--all] [--skip-candle]
#
# Each round builds/runs crates/allgrad-bench/src/bin/bench_conv.rs (Candle and allgrad-nn, their runs
# alternating) and then scripts/bench/bench_conv.py (PyTorch, if `import torch` works), one after the
# other. Every figure is the median of --runs timed runs; the table shows, over the rounds, the
# median of each figure and the median of the per-round ratios candle/allgrad (allgrad's
# speed-up over Candle) and allgrad/torch (our time relative to PyTorch's). On a shared machine
# quote the ratios. Default layer: 3x3 convolution, padding 1, on a 128x64x32x32 f32 input;
# --all adds two more. Raw output goes to $BENCH_OUT (default: a new temporary folder).
# PYTHON picks the interpreter.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
OUT="${BENCH_OUT:-$(mktemp -d "${TMPDIR:-/tmp}/allgrad-bench-conv.XXXXXX")}"
mkdir -p "$OUT"

ROUNDS=3
ARGS=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        --rounds) ROUNDS="$2"; shift 2 ;;
        --rounds=*) ROUNDS="${1#--rounds=}"; shift ;;
        *) ARGS+=("$1"); shift ;;
    esac
done

TORCH=0
if "$PYTHON" -c "import torch" >/dev/null 2>&1; then TORCH=1; fi

(cd "$ROOT" && cargo build --release -q -p allgrad-bench --bin bench_conv)
for ((r = 1; r <= ROUNDS; r++)); do
    echo "== round $r/$ROUNDS: Candle and allgrad-nn"
    (cd "$ROOT" && cargo run --release -q -p allgrad-bench --bin bench_conv -- "${ARGS[@]}") | tee "$OUT/rust.$r.txt"
    if [[ $TORCH == 1 ]]; then
        echo "== round $r/$ROUNDS: PyTorch"
        "$PYTHON" "$ROOT/scripts/bench/bench_conv.py" "${ARGS[@]}" | tee "$OUT/torch.$r.txt"
    fi
    echo
done
[[ $TORCH == 1 ]] || echo "== PyTorch is not importable with $PYTHON: no torch column (pip install torch)"

"$PYTHON" - "$OUT" "$ROUNDS" <<'PY'
import os, statistics, sys

out, rounds = sys.argv[1], int(sys.argv[2])
order, per_round = [], []
for r in range(1, rounds + 1):
    fig = {}
    for name in (f"rust.{r}.txt", f"torch.{r}.txt"):
        path = os.path.join(out, name)
        if not os.path.exists(path):
            continue
        for line in open(path):
            if line.startswith("RESULT\t"):
                _, layer, op, impl, med, _low = line.rstrip("\n").split("\t")
                if (layer, op) not in order:
                    order.append((layer, op))
                fig[(layer, op, impl)] = float(med)
    per_round.append(fig)

def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None

def figure(key, impl):
    return med([f.get((*key, impl)) for f in per_round])

def ratio(key, a, b):
    return med([f[(*key, a)] / f[(*key, b)] for f in per_round if (*key, a) in f and (*key, b) in f])

cell = lambda v: f"{v:.3f}" if v is not None else "-"
times = lambda v: f"{v:.1f}x" if v is not None else "-"
print(f"== Side by side: median over {rounds} round(s) of median seconds, and of per-round ratios")
print(f"{'layer':<26} {'op':<20} {'candle':>8} {'allgrad':>8} {'torch':>8} {'candle/allgrad':>15} {'allgrad/torch':>14}")
for key in order:
    c, a, t = (figure(key, i) for i in ("candle", "allgrad", "torch"))
    print(f"{key[0]:<26} {key[1]:<20} {cell(c):>8} {cell(a):>8} {cell(t):>8} "
          f"{times(ratio(key, 'candle', 'allgrad')):>15} {times(ratio(key, 'allgrad', 'torch')):>14}")
PY
echo "(raw output in $OUT)"
