#!/usr/bin/env bash
# One CLIP training step on the CPU (a ViT image tower and CLIP's causal text transformer,
# freshly initialised, f32; fixed random images and captions of the full context length; both
# towers' forward, the symmetric InfoNCE, backward, AdamW with OpenCLIP's parameter groups and
# the logit scale's clamp): allgrad (crates/allgrad-bench/src/bin/bench_clip_step/) and OpenCLIP
# (open-clip-torch 3.3.0's CLIP and ClipLoss on PyTorch, scripts/bench/bench_clip_step.py as a
# worker process) alternating step by step in ONE invocation, the same towers, batch and thread
# count, with min / median / max, the ratio of medians, CPU time and page faults per step and
# the forward / backward / optimizer phases; `--profile-steps N` adds each side's profile
# (allgrad's time by op kind, torch.profiler's operators).
#
#   scripts/bench/bench_clip_step.sh [--rounds 5] [--threads 2] [BATCH ...]     (default: 64 128)
#   scripts/bench/bench_clip_step.sh --rounds 1 --image-size 64 --vision-layers 1 --text-layers 1 4   # a quick check
#
# The towers' sizes: --image-size 224 --patch 32 --vision-width 384 --vision-layers 6
# --text-width 256 --text-layers 6 --context 77 --vocab 49408 --embed-dim 256 --head-width 64
# (the defaults). PYTHON picks the interpreter with torch and open-clip-torch (default python3;
# scripts/ci/get_torch.sh makes one); without them only allgrad runs. Run it on an idle machine:
# it prints the load average first, warns when it is above 0.5, and reports the CPU time other
# processes took during each side's steps.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHON="${PYTHON:-python3}"
cargo build --release -q --workspace --bin bench_clip_step >&2
exec "${CARGO_TARGET_DIR:-target}/release/bench_clip_step" "$@"
