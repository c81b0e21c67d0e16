#!/usr/bin/env bash
# Type-checks the CUDA build (`cargo check --workspace --all-targets --features cuda,nccl,cudnn`)
# on a machine without a GPU or a CUDA installation: nvcc and the CUDA headers come from PyPI's
# wheels (nvidia-cuda-nvcc and its parts; CUDA 13.0, scripts/ci/cuda_toolchain.sh) installed into a
# throwaway virtual environment outside the repository. Nothing here runs on a GPU: this
# proves that the `cuda`/`nccl`/`cudnn` code and the GPU tests (crates/allgrad-dist/tests/
# nccl_ops.rs, crates/allgrad-nn/tests/conv_cuda.rs, tests/gpu_equivalence.rs,
# tests/gpu_faults.rs) compile (candle's kernels are built by nvcc for CUDA_COMPUTE_CAP), not
# that they work. `cargo check` links nothing, so no NCCL or cuDNN library is needed.
#
# Exit status: 0 when the check passed, OR when it was skipped because the toolchain could
# not be had (no python3, no venv module, PyPI unreachable, no nvcc in the wheels): the
# reason is printed. A failing `cargo check` always fails. ALLGRAD_REQUIRE_CUDA_CHECK=1 makes
# a skip a failure too.
#
# The wheel versions are pinned in scripts/ci/cuda_toolchain.sh (ALLGRAD_CUDA_WHEELS overrides the
# list), so that a new CUDA release on PyPI cannot fail the check for a reason other than
# allgrad's code.
#
# Variables: ALLGRAD_CUDA_VENV (default: $TMPDIR/allgrad-cuda-venv, reused when present),
# CARGO_TARGET_DIR (default: target/cuda-check under the repository, kept apart from the
# CPU build's artefacts because the features change every candle crate),
# CUDA_COMPUTE_CAP (default 90), CUDARC_CUDA_VERSION (default 13000, the toolchain's).
set -euo pipefail
cd "$(dirname "$0")/../.."

skip() {
    echo "check_cuda_build: SKIPPED: $*" >&2
    if [ "${ALLGRAD_REQUIRE_CUDA_CHECK:-0}" = 1 ]; then
        echo "check_cuda_build: ALLGRAD_REQUIRE_CUDA_CHECK=1, so a skip is a failure" >&2
        exit 1
    fi
    exit 0
}

venv="${ALLGRAD_CUDA_VENV:-${TMPDIR:-/tmp}/allgrad-cuda-venv}"
start=$(date +%s)
# shellcheck source=scripts/ci/cuda_toolchain.sh
. scripts/ci/cuda_toolchain.sh
cuda_toolchain "$venv" || skip "$CUDA_SKIP"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$(pwd)/target/cuda-check}"
echo "check_cuda_build: $(nvcc --version | tail -n 1); CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP; target $CARGO_TARGET_DIR" >&2

features=cuda,nccl,cudnn
cargo check --workspace --all-targets --features "$features"
echo "check_cuda_build: cargo check --features $features passed in $(($(date +%s) - start)) s (toolchain install included)" >&2
