#!/usr/bin/env bash
# One SimCLR ResNet-18 training step (CIFAR stem, projector 512-2048-128, NT-Xent, SGD) on the
# CPU, allgrad then PyTorch (if installed), at the given batch sizes, with the ratio.
#   scripts/bench_simclr_step.sh [BATCH ...]      (default: 64 256)
set -euo pipefail
cd "$(dirname "$0")/.."
batches=("${@:-64}")
[ $# -eq 0 ] && batches=(64 256)
cargo build --release --example bench_simclr_step >&2
ours=$(target/release/examples/bench_simclr_step "${batches[@]}")
echo "$ours"
if theirs=$(python3 scripts/bench_simclr_step.py "${batches[@]}" 2>/dev/null); then
    echo "$theirs"
    paste <(echo "$ours" | awk '{print $3, $6}') <(echo "$theirs" | awk '{print $6}') |
        awk '{printf "batch %s: allgrad / pytorch step time = %.2f\n", $1, $2 / $3}'
else
    echo "(PyTorch not installed: pip install torch)"
fi
