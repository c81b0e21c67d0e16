#!/usr/bin/env bash
# Conv2d on this machine's CPU: Candle vs allgrad-nn vs PyTorch, side by side with ratios.
#
#   scripts/bench_conv.sh [--runs 5] [--all] [--skip-candle]
#
# Builds and runs crates/nn/examples/bench_conv.rs (Candle and allgrad-nn), then
# scripts/bench_conv.py (PyTorch) if `import torch` works, one after the other, and joins their
# RESULT lines into one table: median seconds of each and the ratios candle/allgrad (allgrad's
# speed-up over Candle) and allgrad/torch (our time relative to PyTorch's). The default layer is
# a 3x3 convolution, padding 1, on a 128x64x32x32 f32 input; --all adds two more. Raw output is
# kept in $BENCH_OUT (default: a new temporary folder). PYTHON picks the interpreter.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
OUT="${BENCH_OUT:-$(mktemp -d "${TMPDIR:-/tmp}/allgrad-bench-conv.XXXXXX")}"
mkdir -p "$OUT"

for a in "$@"; do
    case "$a" in
        -h|--help) sed -n '2,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    esac
done

echo "== Candle and allgrad-nn"
(cd "$ROOT" && cargo run --release -q -p allgrad-nn --example bench_conv -- "$@") | tee "$OUT/rust.txt"

echo
if "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    echo "== PyTorch"
    "$PYTHON" "$ROOT/scripts/bench_conv.py" "$@" | tee "$OUT/torch.txt"
else
    echo "== PyTorch is not importable with $PYTHON: skipping its column (pip install torch)"
    : > "$OUT/torch.txt"
fi

echo
"$PYTHON" - "$OUT/rust.txt" "$OUT/torch.txt" <<'PY'
import sys

rows, order = {}, []
for path in sys.argv[1:]:
    for line in open(path):
        if line.startswith("RESULT\t"):
            _, layer, op, impl, med, _low = line.rstrip("\n").split("\t")
            if (layer, op) not in rows:
                rows[(layer, op)] = {}
                order.append((layer, op))
            rows[(layer, op)][impl] = float(med)

def cell(v):
    return f"{v:.3f}" if v is not None else "-"

def ratio(a, b):
    return f"{a / b:.1f}x" if a is not None and b else "-"

print("== Side by side (median seconds; ratios of medians)")
print(f"{'layer':<26} {'op':<20} {'candle':>8} {'allgrad':>8} {'torch':>8} {'candle/allgrad':>15} {'allgrad/torch':>14}")
for key in order:
    r = rows[key]
    c, a, t = r.get("candle"), r.get("allgrad"), r.get("torch")
    print(f"{key[0]:<26} {key[1]:<20} {cell(c):>8} {cell(a):>8} {cell(t):>8} {ratio(c, a):>15} {ratio(a, t):>14}")
PY
echo "(raw output in $OUT)"
