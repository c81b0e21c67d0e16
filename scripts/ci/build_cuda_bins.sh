#!/usr/bin/env bash
# Builds allgrad's GPU binaries (release, `--features cuda,nccl`) on a machine with no GPU and
# no CUDA installation, for scripts/ci/gpu_ci.sh to run on a GPU machine that has no Rust:
#
#   scripts/ci/build_cuda_bins.sh DIR            # then, on the GPU machine:
#   ALLGRAD_GPU_BIN=DIR scripts/ci/gpu_ci.sh     #   (from a copy of this repository; DIR.tar.xz,
#                                             #   also written here, works the same)
#
# DIR receives `train`, `launch`, `bench_simclr_step`, `bench_simcse_step` and the tests `nccl_ops`, `gpu_equivalence`,
# `gpu_faults`, `fused_cuda`, `optim_cuda`, `loader_cuda` and `conv_cuda`, built with ALLGRAD_CUDA_FEATURES (default cuda,nccl,cudnn) and
# without symbols. The GPU tests read the configs and data of the repository they are run from,
# so carry DIR beside a copy of this repository (gpu_ci.sh runs from its root). They need, on
# the GPU machine, a driver for CUDA 13.0 or newer and the CUDA 13 libraries (cuBLAS, cuRAND,
# NVRTC, NCCL, cuDNN 9: the PyPI wheels PyTorch installs are found by gpu_ci.sh).
#
# Toolchain: nvcc on PATH when there is one (then ALLGRAD_CUDA_LIBS names the directories of
# libcudart, libcublas, libcurand, libnvrtc, libnccl and libcudnn if the linker cannot find them), else
# CUDA 13.0 from
# PyPI (scripts/ci/cuda_toolchain.sh) with the library wheels, in ALLGRAD_CUDA_VENV (default
# $TMPDIR/allgrad-cuda-venv). CARGO_TARGET_DIR defaults to target/gpu. Offline (a GPU machine
# with Rust but no network): `cargo vendor` output in vendor/ is used when present.
#
# Linking: candle links the driver library (libcuda) at build time, and no wheel ships it. A
# stub libcuda.so that defines every driver function cudarc declares is made here (CUDA
# toolkits ship such stubs in lib64/stubs for the same purpose); the binaries record only its
# name, libcuda.so.1, and load the machine's real driver when they start.
set -euo pipefail
cd "$(dirname "$0")/../.."
say() { echo "build_cuda_bins: $*" >&2; }
[ $# -eq 1 ] || { say "usage: scripts/ci/build_cuda_bins.sh DIR"; exit 2; }
dest="${1%/}"
mkdir -p "$dest"
start=$(date +%s)

lib_wheels="nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35 nvidia-cuda-nvrtc==13.0.88 nvidia-nccl-cu13==2.28.9 nvidia-cudnn-cu13==9.13.1.26"
libs="${ALLGRAD_CUDA_LIBS:-}"
if command -v nvcc >/dev/null 2>&1 && [ -z "${ALLGRAD_CUDA_VENV:-}" ]; then
    export CUDA_ROOT="${CUDA_ROOT:-$(dirname "$(dirname "$(command -v nvcc)")")}"
    export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}" CUDARC_CUDA_VERSION="${CUDARC_CUDA_VERSION:-13000}"
    libs="${libs:+$libs:}$CUDA_ROOT/lib64:$CUDA_ROOT/lib"
else
    # shellcheck source=scripts/ci/cuda_toolchain.sh
    . scripts/ci/cuda_toolchain.sh
    # shellcheck disable=SC2086 # the list is split on purpose
    cuda_toolchain "${ALLGRAD_CUDA_VENV:-${TMPDIR:-/tmp}/allgrad-cuda-venv}" $lib_wheels || { say "FAILED: $CUDA_SKIP"; exit 1; }
    libs="${libs:+$libs:}$CUDA_LIB:$CUDA_SITE/nvidia/nccl/lib:$CUDA_SITE/nvidia/cudnn/lib"
fi
say "$(nvcc --version | tail -n 1); CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP; CUDARC_CUDA_VERSION=$CUDARC_CUDA_VERSION"

offline=()
if [ -d vendor ]; then
    # `cargo vendor` output carried with the tree: a build machine without network.
    offline=(--offline --config 'source.crates-io.replace-with="vendored-sources"' --config 'source.vendored-sources.directory="vendor"')
    say "building offline from vendor/"
fi

# The link directory: the stub driver and unversioned names for the versioned libraries.
link=$(mktemp -d)
trap 'rm -rf "$link"' EXIT
cudarc=$(cargo metadata "${offline[@]}" --format-version 1 --features cuda,nccl | python3 -c '
import json, os, sys
pkgs = [p for p in json.load(sys.stdin)["packages"] if p["name"] == "cudarc"]
print(os.path.dirname(pkgs[0]["manifest_path"]))')
grep -o 'fn cu[A-Za-z0-9_]*' "$cudarc/src/driver/sys/mod.rs" | sort -u | sed 's/^fn \(.*\)/void \1(void) {}/' >"$link/stub.c"
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$link/libcuda.so" "$link/stub.c"
IFS=: read -ra dirs <<<"$libs"
for name in cudart cublas cublasLt curand nvrtc nccl cudnn; do
    for d in "${dirs[@]}"; do
        f=$(ls "$d/lib$name.so."[0-9]* 2>/dev/null | head -n 1 || true)
        if [ -n "$f" ]; then ln -sf "$f" "$link/lib$name.so"; break; fi
    done
    [ -e "$link/lib$name.so" ] || say "warning: no lib$name.so.N in $libs: the link may fail"
done
export LIBRARY_PATH="$link${LIBRARY_PATH:+:$LIBRARY_PATH}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$(pwd)/target/gpu}"

# One feature resolution for everything (--workspace, dev-dependencies on in both commands), so
# that the second command reuses the first one's Candle instead of building another.
features="${ALLGRAD_CUDA_FEATURES:-cuda,nccl,cudnn}"
# allgrad-bench/cuda: the step benchmarks read the device's peak memory.
flags=(--release --workspace --features "allgrad/${features//,/,allgrad/},allgrad-bench/cuda" "${offline[@]}")
cargo build "${flags[@]}" --bin train --bin launch --bin bench_simclr_step --bin bench_simcse_step
tests=(nccl_ops gpu_equivalence gpu_faults fused_cuda optim_cuda loader_cuda)
[[ ,$features, == *,cudnn,* ]] && tests+=(conv_cuda)
cargo test "${flags[@]}" --no-run "${tests[@]/#/--test=}" --message-format=json >"$link/tests.json"
rel="$CARGO_TARGET_DIR/release"
for b in train launch bench_simclr_step bench_simcse_step; do
    strip --strip-all -o "$dest/$(basename "$b")" "$rel/$b"
done
for t in "${tests[@]}"; do
    exe=$(python3 - "$t" "$link/tests.json" <<'EOF'
import json, sys
for line in open(sys.argv[2]):
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == sys.argv[1] and m.get("executable"):
        print(m["executable"])
EOF
)
    strip --strip-all -o "$dest/$t" "$exe"
done
# One archive to carry (the binaries hold Candle's kernels as PTX text, which compresses well).
packed=""
if command -v xz >/dev/null 2>&1; then
    tar -C "$(dirname "$dest")" -cf - "$(basename "$dest")" | xz -T0 -6 >"$dest.tar.xz"
    packed="; $(du -h "$dest.tar.xz" | cut -f1) as $dest.tar.xz (ALLGRAD_GPU_BIN takes either)"
fi
say "built in $(($(date +%s) - start)) s: $(du -ch "$dest"/* | tail -n 1 | cut -f1) in $dest$packed"
