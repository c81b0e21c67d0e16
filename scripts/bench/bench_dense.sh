#!/usr/bin/env bash
# The CLIP step's dense layers one product at a time on the CPU, allgrad against PyTorch in ONE
# invocation: for each layer shape of bench_clip_step's towers (the image tower's patch
# embedding, attention projections and MLP, the text tower's) the forward x·Wᵀ + b, the input
# gradient ∂Y·W, the weight gradient ∂Yᵀ·x and the bias gradient, f32: allgrad-nn's kernels
# (crates/allgrad-bench/src/bin/bench_dense.rs) beside addmm / mm / mm / sum on PyTorch
# (scripts/bench/bench_dense.py as a worker process), alternating per product, the same thread
# count; min / median per product, the ratio of medians, and the products summed over the
# step's layers.
#
#   scripts/bench/bench_dense.sh [--batch 128] [--rounds 5] [--reps 3] [--threads 2] [--only TEXT]
#   scripts/bench/bench_dense.sh --batch 2 --rounds 1 --reps 1          # a quick check
#
# PYTHON picks the interpreter with torch (default python3; scripts/ci/get_torch.sh makes one);
# without it only allgrad runs. Run it on an idle machine: it prints the load average first and
# warns when it is above 0.5.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHON="${PYTHON:-python3}"
cargo build --release -q --workspace --bin bench_dense >&2
exec "${CARGO_TARGET_DIR:-target}/release/bench_dense" "$@"
