#!/usr/bin/env bash
# One SimCLR ResNet-18 training step (CIFAR stem, projector 512-2048-128, NT-Xent, SGD) on the
# CPU: allgrad (crates/allgrad-bench/src/bin/bench_simclr_step/) and PyTorch (scripts/bench/bench_simclr_step.py, as a
# worker process) alternating step by step in ONE invocation, same thread count, with
# min / median / max, the ratio of medians, CPU time and page faults per step, the
# forward / backward / optimizer phases, the backward's page faults, allocations and copies, and a
# per-layer-type breakdown (the convolutions' input and weight gradients apart).
#
#   scripts/bench/bench_simclr_step.sh [--rounds 5] [--threads 2] [--breakdown-rounds 2] [BATCH ...]
#                                                       (default batches: 64 256)
#   scripts/bench/bench_simclr_step.sh --rounds 1 --breakdown-rounds 1 8     # a quick check
#
# PYTHON picks the interpreter with torch (default python3); without torch only allgrad runs.
# Run it on an idle machine: it prints the load average before and after, warns when the
# machine is busy, and reports the CPU time other processes took during each side's steps.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHON="${PYTHON:-python3}"
cargo build --release -q -p allgrad-bench --bin bench_simclr_step >&2
exec target/release/bench_simclr_step "$@"
