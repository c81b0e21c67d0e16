#!/usr/bin/env bash
# The GPU test suite, for a machine with an NVIDIA GPU (never run in this repository's CPU CI,
# and never run by its authors: no GPU was available to them; see the README's status table).
#
#   scripts/gpu_ci.sh                      # everything below
#   ALLGRAD_REQUIRE_GPU=1 scripts/gpu_ci.sh  # in a GPU CI job: no GPU is a failure, not a skip
#
# Steps, each printed with what it proves:
#  1. finds the GPU(s) (nvidia-smi) and the CUDA 13 toolchain: nvcc on PATH, else CUDA_HOME,
#     else the PyPI wheels in ALLGRAD_CUDA_VENV (see scripts/check_cuda_build.sh); NCCL from
#     ALLGRAD_NCCL_LIB (a directory with libnccl.so*), else the nvidia-nccl-cu13 wheel of that
#     venv or of python3; the compute capability from nvidia-smi (CUDA_COMPUTE_CAP overrides);
#  2. builds with `--features cuda,nccl`, offline from `vendor/` when the tree carries
#     `cargo vendor` output there (no network needed);
#  3. runs every differentiable collective on CUDA through NCCL at W = 1 and 2 (ranks as
#     threads, one GPU per rank) and compares outputs and input gradients with the CPU backend
#     (crates/allgrad-dist/tests/nccl_ops.rs); W = 2 needs two GPUs (NCCL refuses two ranks
#     of one communicator on one GPU) and is skipped, saying so, on a one-GPU machine;
#  4. trains configs/simclr.yaml on device=cuda for a few steps (one rank per GPU, at most 2);
#  5. the SimCLR step benchmark beside PyTorch on the same GPU (ResNet-18 and -50, batch 256
#     and 1024, alternating step by step in one invocation per depth),
#     when PyTorch with CUDA is importable by PYTHON (default python3).
#
# Without a GPU it prints why it stops and exits 0, unless ALLGRAD_REQUIRE_GPU=1 (exit 1).
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "gpu_ci: $*" >&2; }
no_gpu() {
    if [ "${ALLGRAD_REQUIRE_GPU:-0}" = 1 ]; then
        say "FAILED: $* (ALLGRAD_REQUIRE_GPU=1)"
        exit 1
    fi
    say "SKIPPED: $*"
    exit 0
}

# 1. The GPU and the toolchain.
command -v nvidia-smi >/dev/null 2>&1 || no_gpu "no nvidia-smi on PATH: no NVIDIA driver, so no GPU to test on"
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -c . || true)
[ "$gpus" -ge 1 ] || no_gpu "nvidia-smi lists no GPU"
say "$gpus GPU(s): $(nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader | paste -sd';')"
cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d ' .')
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-$cap}"

venv="${ALLGRAD_CUDA_VENV:-${TMPDIR:-/tmp}/allgrad-cuda-venv}"
if ! command -v nvcc >/dev/null 2>&1; then
    if [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then
        export PATH="$CUDA_HOME/bin:$PATH"
    elif [ -x "$venv/bin/python" ]; then
        cu="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia/cu13"
        [ -x "$cu/bin/nvcc" ] && export PATH="$cu/bin:$PATH" CUDA_ROOT="$cu" CUDA_PATH="$cu" CUDA_HOME="$cu"
    fi
fi
command -v nvcc >/dev/null 2>&1 || no_gpu "no nvcc (PATH, CUDA_HOME or $venv): install the CUDA 13 toolchain"
export CUDA_ROOT="${CUDA_ROOT:-$(dirname "$(dirname "$(command -v nvcc)")")}"
export CUDARC_CUDA_VERSION="${CUDARC_CUDA_VERSION:-13040}"

nccl_dir="${ALLGRAD_NCCL_LIB:-}"
if [ -z "$nccl_dir" ]; then
    for py in "$venv/bin/python" python3; do
        command -v "$py" >/dev/null 2>&1 || continue
        nccl_dir=$("$py" - <<'EOF' 2>/dev/null || true
import glob, os, sysconfig
for pat in ("nvidia/nccl/lib", "nvidia/cu13/lib"):
    d = os.path.join(sysconfig.get_paths()["purelib"], pat)
    if glob.glob(os.path.join(d, "libnccl.so*")):
        print(d)
        break
EOF
)
        [ -n "$nccl_dir" ] && break
    done
fi
if [ -n "$nccl_dir" ]; then
    # The wheel ships libnccl.so.2 only; the linker looks for libnccl.so.
    links=$(mktemp -d)
    trap 'rm -rf "$links"' EXIT
    ln -s "$(ls "$nccl_dir"/libnccl.so* | head -n 1)" "$links/libnccl.so"
    export LIBRARY_PATH="$links:$nccl_dir:$CUDA_ROOT/lib64:$CUDA_ROOT/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
    export LD_LIBRARY_PATH="$nccl_dir:$CUDA_ROOT/lib64:$CUDA_ROOT/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    say "NCCL from $nccl_dir"
else
    say "no NCCL wheel found (ALLGRAD_NCCL_LIB unset): relying on the system's libnccl"
fi

# 2. Build.
cargo_flags=(--release --features cuda,nccl)
if [ -d vendor ]; then
    cargo_flags+=(--offline --config 'source.crates-io.replace-with="vendored-sources"' --config 'source.vendored-sources.directory="vendor"')
    say "building offline from vendor/"
fi
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$(pwd)/target/gpu}"
say "step 2: build with --features cuda,nccl (CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP)"
cargo build "${cargo_flags[@]}" --bin train --bin launch

# 3. The differentiable collectives on CUDA vs the CPU backend.
say "step 3: differentiable collectives through NCCL vs the CPU backend, W = 1 and 2"
ALLGRAD_REQUIRE_GPU="${ALLGRAD_REQUIRE_GPU:-0}" cargo test "${cargo_flags[@]}" -p allgrad-dist --test nccl_ops -- --nocapture --test-threads 1

# 4. A few training steps on the GPU.
ranks=$((gpus < 2 ? gpus : 2))
out=$(mktemp -d)
say "step 4: train configs/simclr.yaml on device=cuda, $ranks rank(s), 3 steps (output in $out)"
"$CARGO_TARGET_DIR/release/launch" --nproc-per-node "$ranks" "$CARGO_TARGET_DIR/release/train" \
    --config configs/simclr.yaml --set device=cuda --set log.every=1 --stop-after 3 --output-dir "$out/simclr"
grep -q '"loss"' "$out/simclr/metrics.jsonl" && say "step 4: losses recorded: $(grep -c '"loss"' "$out/simclr/metrics.jsonl") line(s)"

# 5. The step benchmark beside PyTorch on the same GPU.
export PYTHON="${PYTHON:-python3}"
if "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    for depth in 18 50; do
        say "step 5: SimCLR step benchmark, allgrad vs PyTorch on the GPU (ResNet-$depth, batch 256 and 1024)"
        cargo run "${cargo_flags[@]}" --example bench_simclr_step -- --device cuda --depth "$depth" --rounds 5 --breakdown-rounds 0 256 1024
    done
else
    say "step 5: SKIPPED: $PYTHON cannot import PyTorch with CUDA, so there is no peer to compare with"
fi
say "done"
