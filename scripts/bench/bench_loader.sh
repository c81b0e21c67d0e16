#!/usr/bin/env bash
# The loader on ImageNet-sized JPEGs beside torchvision: SimCLR's two views at 224, samples/s
# for each worker count, alternating allgrad and torchvision, and the per-stage split.
#
#   scripts/bench/bench_loader.sh [--rounds 5] [--workers "1 2"] [--samples 512] [--stage-samples 200]
#
# Prepares what it needs, once: the image set (scripts/data/make_loader_images.py, 2,000 JPEGs of
# 500x375 made from scikit-learn's sample photographs, in a virtual environment of its own with
# scikit-learn and Pillow) in data/loader-bench/ (git-ignored; $ALLGRAD_LOADER_IMAGES picks
# another folder), and torchvision 0.29.2 with Pillow and numpy beside torch 2.15
# (scripts/ci/get_torch.sh's environment). Then it prints the load average (run it on an idle
# machine: a figure taken while anything else runs is not a figure), and per round, for each
# worker count, one allgrad run (crates/allgrad-bench/src/bin/bench_loader.rs) then one
# torchvision run (scripts/bench/bench_loader.py), then each side's stage split on one thread. The
# summary gives min/median/max samples/s over the rounds, samples/s per worker, the median of
# the per-round ratios allgrad/torchvision, and the median milliseconds per sample of each
# stage. Raw output goes to $BENCH_OUT (default: a new temporary folder).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/allgrad"
IMAGES="${ALLGRAD_LOADER_IMAGES:-$ROOT/data/loader-bench}"
OUT="${BENCH_OUT:-$(mktemp -d "${TMPDIR:-/tmp}/allgrad-bench-loader.XXXXXX")}"
mkdir -p "$OUT"

ROUNDS=5
WORKERS="1 2"
SAMPLES=512
STAGE_SAMPLES=200
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        --rounds) ROUNDS="$2"; shift 2 ;;
        --workers) WORKERS="$2"; shift 2 ;;
        --samples) SAMPLES="$2"; shift 2 ;;
        --stage-samples) STAGE_SAMPLES="$2"; shift 2 ;;
        *) echo "unknown argument $1 (--help)" >&2; exit 2 ;;
    esac
done

# The image set, made once.
if [[ ! -f $IMAGES/.complete ]]; then
    venv="$CACHE/loader-bench"
    if ! "$venv/bin/python" -c "import sklearn, PIL" >/dev/null 2>&1; then
        python3 -m venv "$venv"
        "$venv/bin/python" -m pip install --quiet "scikit-learn==1.9.1" "pillow==13.0.0" "numpy==2.4.6"
    fi
    rm -rf "$IMAGES"
    "$venv/bin/python" "$ROOT/scripts/data/make_loader_images.py" "$IMAGES" --count 2000
    touch "$IMAGES/.complete"
fi

# torchvision beside torch 2.15.
TORCH_VENV="$("$ROOT/scripts/ci/get_torch.sh" | tail -n 1)"
PY="$TORCH_VENV/bin/python"
if ! "$PY" -c "import torchvision, PIL, numpy" >/dev/null 2>&1; then
    "$PY" -m pip install --quiet --no-deps "torchvision==0.29.2" "pillow==13.0.0" "numpy==2.4.6"
fi

(cd "$ROOT" && cargo build --release -q -p allgrad-bench --bin bench_loader)
BIN="$ROOT/target/release/bench_loader"

echo "load average (1, 5, 15 min): $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) cores"
echo "torchvision $("$PY" -c 'import torchvision, PIL; print(torchvision.__version__, "Pillow", PIL.__version__)')"
for ((r = 1; r <= ROUNDS; r++)); do
    for w in $WORKERS; do
        "$BIN" --images "$IMAGES" loader --workers "$w" --samples "$SAMPLES" | tee -a "$OUT/round.$r.txt"
        "$PY" "$ROOT/scripts/bench/bench_loader.py" --images "$IMAGES" loader --workers "$w" --samples "$SAMPLES" | tee -a "$OUT/round.$r.txt"
    done
    "$BIN" --images "$IMAGES" stages --samples "$STAGE_SAMPLES" >> "$OUT/round.$r.txt"
    "$PY" "$ROOT/scripts/bench/bench_loader.py" --images "$IMAGES" stages --samples "$STAGE_SAMPLES" >> "$OUT/round.$r.txt"
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"

"$PY" - "$OUT" "$ROUNDS" <<'PY'
import os, statistics, sys

out, rounds = sys.argv[1], int(sys.argv[2])
loader, stage = [], []
for r in range(1, rounds + 1):
    lo, st = {}, {}
    for line in open(os.path.join(out, f"round.{r}.txt")):
        if not line.startswith("RESULT\t"):
            continue
        _, kind, impl, what, value = line.rstrip("\n").split("\t")
        (lo if kind == "loader" else st)[(impl, what)] = float(value)
    loader.append(lo)
    stage.append(st)

workers = sorted({w for lo in loader for (_, w) in lo}, key=int)
print(f"\n== samples/s (two views at 224), {rounds} round(s): min / median / max; per worker: median / workers")
print(f"{'workers':>7} {'allgrad':>24} {'torchvision':>24} {'allgrad/worker':>15} {'torchvision/worker':>19} {'ratio':>6}")
for w in workers:
    cells = []
    for impl in ("allgrad", "torchvision"):
        v = [lo[(impl, w)] for lo in loader if (impl, w) in lo]
        cells.append(v)
    fmt = lambda v: f"{min(v):.0f} / {statistics.median(v):.0f} / {max(v):.0f}" if v else "-"
    per = lambda v: f"{statistics.median(v) / int(w):.0f}" if v else "-"
    ratios = [lo[("allgrad", w)] / lo[("torchvision", w)] for lo in loader if ("allgrad", w) in lo and ("torchvision", w) in lo]
    ratio = f"{statistics.median(ratios):.2f}x" if ratios else "-"
    print(f"{w:>7} {fmt(cells[0]):>24} {fmt(cells[1]):>24} {per(cells[0]):>15} {per(cells[1]):>19} {ratio:>6}")

names = ["read", "decode", "crop+resize", "jitter", "blur", "to tensor", "total"]
print(f"\n== ms per sample (both views) on one thread, median over {rounds} round(s)")
print(f"{'stage':<12} {'allgrad':>8} {'torchvision':>12}")
for n in names:
    a = [st[("allgrad", n)] for st in stage if ("allgrad", n) in st]
    t = [st[("torchvision", n)] for st in stage if ("torchvision", n) in st]
    cell = lambda v: f"{statistics.median(v):.2f}" if v else "-"
    print(f"{n:<12} {cell(a):>8} {cell(t):>12}")
PY
echo "(raw output in $OUT)"
