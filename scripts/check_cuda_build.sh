#!/usr/bin/env bash
# Type-checks the CUDA build (`cargo check --workspace --all-targets --features cuda,nccl`) on
# a machine without a GPU or a CUDA installation: nvcc and the CUDA headers come from PyPI's
# wheels (nvidia-cuda-nvcc, nvidia-cuda-runtime, nvidia-cuda-cccl; CUDA 13) installed into a
# throwaway virtual environment outside the repository. Nothing here runs on a GPU: this
# proves that the `cuda`/`nccl` code compiles (candle's kernels are built by nvcc for
# CUDA_COMPUTE_CAP), not that it works.
#
# Exit status: 0 when the check passed, OR when it was skipped because the toolchain could
# not be had (no python3, no venv module, PyPI unreachable, no nvcc in the wheels): the
# reason is printed. A failing `cargo check` always fails. ALLGRAD_REQUIRE_CUDA_CHECK=1 makes
# a skip a failure too.
#
# The wheel versions are pinned (ALLGRAD_CUDA_WHEELS overrides the list), so that a new CUDA
# release on PyPI cannot fail the check for a reason other than allgrad's code.
#
# Variables: ALLGRAD_CUDA_VENV (default: $TMPDIR/allgrad-cuda-venv, reused when present),
# CARGO_TARGET_DIR (default: target/cuda-check under the repository, kept apart from the
# CPU build's artefacts because the features change every candle crate),
# CUDA_COMPUTE_CAP (default 90), CUDARC_CUDA_VERSION (default 13040: cudarc 0.19 knows CUDA
# versions up to 13.4 and rejects newer version strings).
set -euo pipefail
cd "$(dirname "$0")/.."

skip() {
    echo "check_cuda_build: SKIPPED: $*" >&2
    if [ "${ALLGRAD_REQUIRE_CUDA_CHECK:-0}" = 1 ]; then
        echo "check_cuda_build: ALLGRAD_REQUIRE_CUDA_CHECK=1, so a skip is a failure" >&2
        exit 1
    fi
    exit 0
}

venv="${ALLGRAD_CUDA_VENV:-${TMPDIR:-/tmp}/allgrad-cuda-venv}"
case "$(realpath -m "$venv")/" in
"$(pwd -P)"/*) skip "ALLGRAD_CUDA_VENV=$venv lies inside the repository; choose a directory outside it" ;;
esac

wheels="${ALLGRAD_CUDA_WHEELS:-nvidia-cuda-nvcc==13.5.37 nvidia-cuda-runtime==13.5.37 nvidia-cuda-cccl==13.3.5.0.6}"
command -v python3 >/dev/null 2>&1 || skip "no python3 on PATH to install nvcc from PyPI"
command -v g++ >/dev/null 2>&1 || skip "no g++ on PATH: nvcc needs it for the host side of candle's kernels"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv" >/dev/null 2>&1 || skip "python3 -m venv $venv failed (python3-venv missing?)"
fi
start=$(date +%s)
# shellcheck disable=SC2086 # the list is split on purpose
if ! "$venv/bin/python" -m pip install --quiet --disable-pip-version-check $wheels >"$venv/pip.log" 2>&1; then
    tail -n 5 "$venv/pip.log" >&2 || true
    skip "pip could not install the CUDA wheels from PyPI (log: $venv/pip.log)"
fi

site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cuda="$site/nvidia/cu13"
[ -x "$cuda/bin/nvcc" ] || skip "the wheels gave no nvcc at $cuda/bin/nvcc"
# The CCCL headers (cuda/std/..., thrust, cub) sit beside include/ in their own wheel.
cccl=""
[ -d "$cuda/cccl" ] && cccl="$cuda/cccl"
[ -d "$cuda/include/cccl" ] && cccl="$cuda/include/cccl"

export PATH="$cuda/bin:$PATH"
export CUDA_ROOT="$cuda" CUDA_PATH="$cuda" CUDA_HOME="$cuda"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
export CUDARC_CUDA_VERSION="${CUDARC_CUDA_VERSION:-13040}"
if [ -n "$cccl" ]; then
    export CPATH="$cccl${CPATH:+:$CPATH}"
    export NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:-} -I$cccl"
fi
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$(pwd)/target/cuda-check}"
echo "check_cuda_build: $(nvcc --version | tail -n 1); CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP; target $CARGO_TARGET_DIR" >&2

cargo check --workspace --all-targets --features cuda,nccl
echo "check_cuda_build: cargo check --features cuda,nccl passed in $(($(date +%s) - start)) s (toolchain install included)" >&2
