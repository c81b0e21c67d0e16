#!/usr/bin/env bash
# One unsupervised SimCSE training step of all-MiniLM-L6-v2 (B sentences encoded twice with
# dropout on, mean pooling, MLP head, InfoNCE at temperature 0.05, backward, AdamW; max_len 32)
# on the CPU: allgrad (crates/allgrad-bench/src/bin/bench_simcse_step/) and PyTorch + transformers
# (scripts/bench/bench_simcse_step.py, as a worker process) alternating step by step in ONE
# invocation, same thread count, same sentences (the first B of data/wordnet/sentences.txt),
# with min / median / max, the ratio of medians, CPU time and page faults per step and the
# forward / backward / optimizer phases, the backward's page faults, allocations and copies, and a breakdown
# by op kind (dense layers, attention, layer norm, GELU, softmax, dropout, loss), each op timed alone.
#
#   scripts/bench/bench_simcse_step.sh [--rounds 5] [--threads 2] [--breakdown-rounds 2] [BATCH ...]   (default: 64 256)
#   scripts/bench/bench_simcse_step.sh --rounds 1 64                             # a quick check
#
# Needs the weights (scripts/data/get_minilm.sh). PYTHON picks the interpreter with torch and
# transformers (default python3); without torch only allgrad runs. Run it on an idle machine:
# it prints the load average first, warns when it is above 0.5, and reports the CPU time
# other processes took during each side's steps.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHON="${PYTHON:-python3}"
cargo build --release -q -p allgrad-bench --bin bench_simcse_step >&2
exec "${CARGO_TARGET_DIR:-target}/release/bench_simcse_step" "$@"
