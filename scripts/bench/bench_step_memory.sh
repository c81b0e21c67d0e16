#!/usr/bin/env bash
# Peak memory of one SimCLR training step on the CPU (ResNet-18/-50, CIFAR stem, projector
# (features)-2048-128, NT-Xent, SGD; the step of scripts/bench/bench_simclr_step.sh), allgrad
# (crates/allgrad-bench/src/bin/bench_step_memory.rs) beside PyTorch (scripts/bench/bench_simclr_step.py --memory), each
# configuration and each side in a fresh process of its own, one after the other.
#
#   scripts/bench/bench_step_memory.sh [--steps 2] [--threads 2] [--precision full|bf16] [DEPTHxBATCH ...]
#                                   (default: 18x64 18x256 50x64 50x256)
#   scripts/bench/bench_step_memory.sh 18x8                 # a quick check
#
# --precision bf16 runs allgrad's step as `precision: bf16` does (bf16 autocast of the forward)
# and PyTorch's under torch.autocast(bfloat16), both with the loss in f32.
#
# The figures are resident-set sizes from /proc/self/status (MiB): `setup` once the model,
# optimizer and input exist (after one warm-up step of a separate batch-2 model, whose freed
# memory is returned with malloc_trim, so the code the step runs is resident: on both sides);
# `fwd` at the end of the first forward; `peak` the peak resident set (VmHWM) over the steps,
# reset after the setup. The table's `step` column is peak - setup: the memory one training
# step takes on top of the model and the program. allgrad's line also has its Rust
# allocator's live bytes (heap_*), which PyTorch cannot report on the CPU. Memory does not
# depend on the machine's load, but two sides running at once could exhaust it: the sides run
# one after the other. PYTHON picks the interpreter with torch (default python3); without torch
# only allgrad runs.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3}"
steps=2
threads=2
precision=full
configs=()
while [ $# -gt 0 ]; do
    case "$1" in
        --steps) steps="$2"; shift 2 ;;
        --threads) threads="$2"; shift 2 ;;
        --precision) precision="$2"; shift 2 ;;
        -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
        *x*) configs+=("$1"); shift ;;
        *) echo "bench_step_memory.sh: unknown argument $1 (configurations are DEPTHxBATCH, e.g. 18x64)" >&2; exit 2 ;;
    esac
done
[ ${#configs[@]} -gt 0 ] || configs=(18x64 18x256 50x64 50x256)
cargo build --release -q -p allgrad-bench --bin bench_step_memory >&2
torch=1
"$PYTHON" -c "import torch" 2>/dev/null || { torch=0; echo "no torch for $PYTHON: allgrad only" >&2; }
case "$precision" in
    full) autocast=() ;;
    bf16) autocast=(--autocast) ;;
    *) echo "bench_step_memory.sh: --precision is full or bf16, not $precision" >&2; exit 2 ;;
esac
echo "MemTotal: $(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo) MiB; $steps step(s) each, $threads threads, precision $precision"
lines=()
for cfg in "${configs[@]}"; do
    depth="${cfg%x*}"
    batch="${cfg#*x}"
    line=$(target/release/bench_step_memory --depth "$depth" --batch "$batch" --steps "$steps" --threads "$threads" --precision "$precision" | grep '^MEM')
    echo "$line"
    lines+=("$line")
    if [ "$torch" = 1 ]; then
        line=$("$PYTHON" scripts/bench/bench_simclr_step.py --memory --depth "$depth" --batch "$batch" --steps "$steps" --threads "$threads" ${autocast[@]+"${autocast[@]}"} | grep '^MEM')
        echo "$line"
        lines+=("$line")
    fi
done
echo
echo "peak resident set (MiB) of one SimCLR step on the CPU, precision $precision; step = peak - setup"
printf '%s\n' "${lines[@]}" | awk '
    { for (i = 2; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = kv[2] }
      key = "ResNet-" f["depth"] " b" f["batch"]
      if (!(key in seen)) { seen[key] = 1; order[++n] = key }
      step[key, f["side"]] = f["peak"] - f["setup"]; peak[key, f["side"]] = f["peak"]; fwd[key, f["side"]] = f["fwd"] - f["setup"]
      if (f["side"] == "allgrad") heap[key] = f["heap_peak"] - f["heap_setup"] }
    END {
      printf "| %-15s | %13s | %13s | %13s | %13s | %17s | %17s | %9s |\n", "model, batch", "allgrad step", "PyTorch step", "allgrad peak", "PyTorch peak", "allgrad fwd kept", "PyTorch fwd kept", "step ratio"
      printf "|%s|%s|%s|%s|%s|%s|%s|%s|\n", "-----------------", "--------------:", "--------------:", "--------------:", "--------------:", "------------------:", "------------------:", "----------:"
      for (i = 1; i <= n; i++) { k = order[i]
        ratio = ((k, "pytorch") in step && step[k, "pytorch"] > 0) ? sprintf("%.2fx", step[k, "allgrad"] / step[k, "pytorch"]) : "-"
        tv = ((k, "pytorch") in step) ? step[k, "pytorch"] : "-"; tp = ((k, "pytorch") in peak) ? peak[k, "pytorch"] : "-"; tf = ((k, "pytorch") in fwd) ? fwd[k, "pytorch"] : "-"
        printf "| %-15s | %13s | %13s | %13s | %13s | %17s | %17s | %9s |\n", k, step[k, "allgrad"], tv, peak[k, "allgrad"], tp, fwd[k, "allgrad"], tf, ratio }
      print "(step ratio: allgrad step / PyTorch step; allgrad heap step (live bytes, peak - setup):"
      for (i = 1; i <= n; i++) printf " %s %d MiB;", order[i], heap[order[i]]; print ")" }'
