#!/usr/bin/env bash
# The GPU test suite, for a machine with an NVIDIA GPU (never run in this repository's CPU CI;
# the README's GPU section says what it gave on an H100).
#
#   scripts/gpu_ci.sh                      # everything below
#   ALLGRAD_REQUIRE_GPU=1 scripts/gpu_ci.sh  # in a GPU CI job: no GPU is a failure, not a skip
#   ALLGRAD_GPU_BIN=DIR scripts/gpu_ci.sh    # run binaries built on another machine
#                                            # (scripts/build_cuda_bins.sh DIR): no Rust, no nvcc
#
# Steps, each printed with what it proves:
#  1. finds the GPU(s) (nvidia-smi) and the CUDA 13 toolchain: nvcc on PATH, else CUDA_HOME,
#     else the PyPI wheels in ALLGRAD_CUDA_VENV (see scripts/check_cuda_build.sh); NCCL from
#     ALLGRAD_NCCL_LIB (a directory with libnccl.so*), else the nvidia-nccl-cu13 wheel of that
#     venv or of python3; the compute capability from nvidia-smi (CUDA_COMPUTE_CAP overrides);
#  2. builds with `--features cuda,nccl,cudnn` (scripts/build_cuda_bins.sh); with
#     ALLGRAD_GPU_BIN it builds nothing
#     and takes train, launch, nccl_ops, bench_simclr_step (and conv_cuda, when the build had
#     the `cudnn` feature) from that directory;
#  3. runs every differentiable collective on CUDA through NCCL at W = 1 and 2 (ranks as
#     threads, one GPU per rank) and compares outputs and input gradients with the CPU backend
#     (crates/allgrad-dist/tests/nccl_ops.rs); W = 2 needs two GPUs (NCCL refuses two ranks
#     of one communicator on one GPU: ncclInvalidUsage) and is skipped, saying so, on a
#     one-GPU machine;
#  3b. conv2d and both its gradients through cuDNN against the CPU kernels
#     (crates/allgrad-nn/tests/conv_cuda.rs), when the build has the `cudnn` feature;
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
prebuilt="${ALLGRAD_GPU_BIN:-}"
if [ -n "$prebuilt" ]; then
    for b in train launch nccl_ops bench_simclr_step; do
        [ -x "$prebuilt/$b" ] || { say "FAILED: ALLGRAD_GPU_BIN=$prebuilt has no executable $b"; exit 1; }
    done
elif ! command -v nvcc >/dev/null 2>&1; then
    if [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then
        export PATH="$CUDA_HOME/bin:$PATH"
    elif [ -x "$venv/bin/python" ]; then
        cu="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia/cu13"
        [ -x "$cu/bin/nvcc" ] && export PATH="$cu/bin:$PATH" CUDA_ROOT="$cu" CUDA_PATH="$cu" CUDA_HOME="$cu"
    fi
fi
if [ -z "$prebuilt" ]; then
    command -v nvcc >/dev/null 2>&1 || no_gpu "no nvcc (PATH, CUDA_HOME or $venv): install the CUDA 13 toolchain"
fi
if command -v nvcc >/dev/null 2>&1; then
    export CUDA_ROOT="${CUDA_ROOT:-$(dirname "$(dirname "$(command -v nvcc)")")}"
fi
CUDA_ROOT="${CUDA_ROOT:-${CUDA_HOME:-/usr/local/cuda}}"

nccl_dir="${ALLGRAD_NCCL_LIB:-}"
wheel_libs=""
for py in "$venv/bin/python" python3; do
    command -v "$py" >/dev/null 2>&1 || continue
    # The CUDA 13 wheels' libraries (cuBLAS, cuRAND, NVRTC under nvidia/cu13/lib; NCCL and cuDNN
    # under nvidia/{nccl,cudnn}/lib), e.g. those PyTorch was installed with.
    found=$("$py" - <<'EOF' 2>/dev/null || true
import glob, os, sysconfig
site = sysconfig.get_paths()["purelib"]
for pat in ("nvidia/nccl/lib", "nvidia/cu13/lib", "nvidia/cudnn/lib"):
    d = os.path.join(site, pat)
    if glob.glob(os.path.join(d, "lib*.so*")):
        print(d)
EOF
)
    for d in $found; do
        wheel_libs="$wheel_libs${wheel_libs:+:}$d"
        if [ -z "$nccl_dir" ] && ls "$d"/libnccl.so* >/dev/null 2>&1; then nccl_dir="$d"; fi
    done
    [ -n "$found" ] && break
done
export LD_LIBRARY_PATH="${nccl_dir:+$nccl_dir:}${wheel_libs:+$wheel_libs:}$CUDA_ROOT/lib64:$CUDA_ROOT/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [ -n "$nccl_dir" ]; then
    say "NCCL from $nccl_dir"
else
    say "no NCCL wheel found (ALLGRAD_NCCL_LIB unset): relying on the system's libnccl"
fi

# 2. Build (or take the binaries built elsewhere).
if [ -n "$prebuilt" ]; then
    say "step 2: no build: the binaries of $prebuilt"
    bin="$prebuilt"
else
    bin=$(mktemp -d)
    say "step 2: build with --features cuda,nccl (CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP) into $bin"
    ALLGRAD_CUDA_LIBS="${nccl_dir:+$nccl_dir:}$wheel_libs" scripts/build_cuda_bins.sh "$bin"
fi

# 3. The differentiable collectives on CUDA vs the CPU backend.
say "step 3: differentiable collectives through NCCL vs the CPU backend, W = 1 and 2"
ALLGRAD_REQUIRE_GPU="${ALLGRAD_REQUIRE_GPU:-0}" "$bin/nccl_ops" --nocapture --test-threads 1
if [ -x "$bin/conv_cuda" ]; then
    say "step 3b: conv2d and both its gradients through cuDNN vs the CPU kernels (f64 1e-10, f32 1e-5)"
    ALLGRAD_REQUIRE_GPU="${ALLGRAD_REQUIRE_GPU:-0}" "$bin/conv_cuda" --nocapture
else
    say "step 3b: SKIPPED: built without the cudnn feature (Candle's own CUDA convolution is used)"
fi

# 4. A few training steps on the GPU.
ranks=$((gpus < 2 ? gpus : 2))
out=$(mktemp -d)
say "step 4: train configs/simclr.yaml on device=cuda, $ranks rank(s), 3 steps (output in $out)"
"$bin/launch" --nproc-per-node "$ranks" "$bin/train" \
    --config configs/simclr.yaml --set device=cuda --set log.every=1 --stop-after 3 --output-dir "$out/simclr"
grep -q '"loss"' "$out/simclr/metrics.jsonl" && say "step 4: losses recorded: $(grep -c '"loss"' "$out/simclr/metrics.jsonl") line(s)"

# 5. The step benchmark beside PyTorch on the same GPU.
export PYTHON="${PYTHON:-python3}"
if "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    for depth in 18 50; do
        say "step 5: SimCLR step benchmark, allgrad vs PyTorch on the GPU (ResNet-$depth, batch 256 and 1024)"
        "$bin/bench_simclr_step" --device cuda --depth "$depth" --rounds 5 --breakdown-rounds 0 256 1024
    done
else
    say "step 5: SKIPPED: $PYTHON cannot import PyTorch with CUDA, so there is no peer to compare with"
fi
say "done"
