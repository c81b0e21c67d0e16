#!/usr/bin/env bash
# The loader on ImageNet-sized JPEGs beside torchvision on Pillow and on Pillow-SIMD: SimCLR's two
# views at 224 and the evaluation / CLIP view (decode, shortest side to 224, centre crop),
# samples/s for each worker count, alternating the implementations, and the per-stage split.
#
#   scripts/bench/bench_loader.sh [--rounds 5] [--workers "1 2"] [--samples 512] [--batch 64] [--stage-samples 200]
#                                 [--pipelines "simclr eval"] [--pillow-simd | --pillow-python PY]
#                                 [--scaled-decode]
#
# Prepares what it needs, once: the image set (scripts/data/make_loader_images.py, 2,000 JPEGs of
# 500x375 made from scikit-learn's sample photographs, in a virtual environment of its own with
# scikit-learn and Pillow) in data/loader-bench/ (git-ignored; $ALLGRAD_LOADER_IMAGES picks
# another folder), and torchvision 0.29.2 with Pillow and numpy beside torch 2.15
# (scripts/ci/get_torch.sh's environment). `--pillow-simd` adds torchvision on Pillow-SIMD
# (scripts/bench/get_pillow_simd.sh builds its environment once); `--pillow-python PY` names
# another Python with torchvision on another Pillow build for that column. `--scaled-decode`
# runs allgrad's loader with data.loader.scaled_decode. Then it prints the load average (run it
# on an idle machine: a figure taken while anything else runs is not a figure), and per round,
# for each pipeline and worker count, one allgrad run (crates/allgrad-bench/src/bin/bench_loader.rs),
# one torchvision run on Pillow (scripts/bench/bench_loader.py), one on Pillow-SIMD, then each
# side's stage split on one thread. The summary gives, per pipeline, min/median/max samples/s over
# the rounds, samples/s per worker, the median of the per-round ratios of allgrad to each peer,
# and the median milliseconds per sample of each stage. Raw output goes to $BENCH_OUT (default: a
# new temporary folder).
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
BATCH=64
PIPELINES="simclr eval"
SIMD_PY=""
SIMD=0
SCALED=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) sed -n '2,25p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        --rounds) ROUNDS="$2"; shift 2 ;;
        --workers) WORKERS="$2"; shift 2 ;;
        --samples) SAMPLES="$2"; shift 2 ;;
        --stage-samples) STAGE_SAMPLES="$2"; shift 2 ;;
        --batch) BATCH="$2"; shift 2 ;;
        --pipelines) PIPELINES="$2"; shift 2 ;;
        --pillow-simd) SIMD=1; shift ;;
        --pillow-python) SIMD_PY="$2"; shift 2 ;;
        --scaled-decode) SCALED=(--scaled-decode); shift ;;
        *) echo "unknown argument $1 (--help)" >&2; exit 2 ;;
    esac
done
for p in $PIPELINES; do
    [[ $p == simclr || $p == eval ]] || { echo "unknown pipeline $p (simclr, eval)" >&2; exit 2; }
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

# torchvision on Pillow-SIMD.
if [[ $SIMD == 1 && -z $SIMD_PY ]]; then
    SIMD_PY="$("$ROOT/scripts/bench/get_pillow_simd.sh" | tail -n 1)/bin/python"
fi

(cd "$ROOT" && cargo build --release -q --workspace --bin bench_loader)
BIN="$ROOT/target/release/bench_loader"

echo "load average (1, 5, 15 min): $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) cores"
echo "torchvision $("$PY" -c 'import torchvision, PIL; print(torchvision.__version__, "Pillow", PIL.__version__)')"
if [[ -n $SIMD_PY ]]; then
    echo "pillow-simd: torchvision $("$SIMD_PY" -c 'import torchvision, PIL; print(torchvision.__version__, "Pillow", PIL.__version__, PIL.__file__)')"
fi
[[ ${#SCALED[@]} -gt 0 ]] && echo "allgrad with scaled decode (data.loader.scaled_decode: true)"
peer() { # peer NAME PYTHON ARGS...: bench_loader.py under that Python
    local name="$1" py="$2"
    shift 2
    "$py" "$ROOT/scripts/bench/bench_loader.py" --images "$IMAGES" --name "$name" "$@"
}
for ((r = 1; r <= ROUNDS; r++)); do
    for p in $PIPELINES; do
        for w in $WORKERS; do
            "$BIN" --images "$IMAGES" --pipeline "$p" loader --workers "$w" --samples "$SAMPLES" --batch "$BATCH" "${SCALED[@]}" | tee -a "$OUT/round.$r.txt"
            peer torchvision "$PY" --pipeline "$p" loader --workers "$w" --samples "$SAMPLES" --batch "$BATCH" | tee -a "$OUT/round.$r.txt"
            if [[ -n $SIMD_PY ]]; then
                peer pillow-simd "$SIMD_PY" --pipeline "$p" loader --workers "$w" --samples "$SAMPLES" --batch "$BATCH" | tee -a "$OUT/round.$r.txt"
            fi
        done
        "$BIN" --images "$IMAGES" --pipeline "$p" stages --samples "$STAGE_SAMPLES" >> "$OUT/round.$r.txt"
        peer torchvision "$PY" --pipeline "$p" stages --samples "$STAGE_SAMPLES" >> "$OUT/round.$r.txt"
        if [[ -n $SIMD_PY ]]; then
            peer pillow-simd "$SIMD_PY" --pipeline "$p" stages --samples "$STAGE_SAMPLES" >> "$OUT/round.$r.txt"
        fi
    done
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"

"$PY" - "$OUT" "$ROUNDS" <<'PY'
import os, statistics, sys

out, rounds = sys.argv[1], int(sys.argv[2])
runs = []  # per round: {(kind, impl, what): value}
for r in range(1, rounds + 1):
    got = {}
    for line in open(os.path.join(out, f"round.{r}.txt")):
        if not line.startswith("RESULT\t"):
            continue
        _, kind, impl, what, value = line.rstrip("\n").split("\t")
        got[(kind, impl, what)] = float(value)
    runs.append(got)

impls = [i for i in ("allgrad", "torchvision", "pillow-simd") if any(k[1] == i for run in runs for k in run)]
peers = [i for i in impls if i != "allgrad"]
titles = {"": "SimCLR's two views at 224", "-eval": "the evaluation / CLIP view (shortest side 224, centre crop)"}
for suffix, title in titles.items():
    kind, stage_kind = "loader" + suffix, "stage" + suffix
    workers = sorted({k[2] for run in runs for k in run if k[0] == kind}, key=int)
    if not workers:
        continue
    print(f"\n== samples/s, {title}, {rounds} round(s): min / median / max; per worker: median / workers")
    head = "".join(f" {i:>22}" for i in impls) + "".join(f" {i + '/worker':>19}" for i in impls)
    head += "".join(f" {'allgrad/' + p:>20}" for p in peers)
    print(f"{'workers':>7}{head}")
    for w in workers:
        vals = {i: [run[(kind, i, w)] for run in runs if (kind, i, w) in run] for i in impls}
        fmt = lambda v: f"{min(v):.0f} / {statistics.median(v):.0f} / {max(v):.0f}" if v else "-"
        per = lambda v: f"{statistics.median(v) / int(w):.0f}" if v else "-"
        line = "".join(f" {fmt(vals[i]):>22}" for i in impls) + "".join(f" {per(vals[i]):>19}" for i in impls)
        for p in peers:
            ratios = [run[(kind, "allgrad", w)] / run[(kind, p, w)] for run in runs if (kind, "allgrad", w) in run and (kind, p, w) in run]
            line += f" {(f'{statistics.median(ratios):.2f}x' if ratios else '-'):>20}"
        print(f"{w:>7}{line}")
    names = []
    for run in runs:
        for k in run:
            if k[0] == stage_kind and k[2] not in names:
                names.append(k[2])
    print(f"\n== ms per sample on one thread, {title}, median over {rounds} round(s)")
    print(f"{'stage':<12}" + "".join(f" {i:>12}" for i in impls))
    for n in names:
        cells = []
        for i in impls:
            v = [run[(stage_kind, i, n)] for run in runs if (stage_kind, i, n) in run]
            cells.append(f"{statistics.median(v):.2f}" if v else "-")
        print(f"{n:<12}" + "".join(f" {c:>12}" for c in cells))
PY
echo "(raw output in $OUT)"
