#!/usr/bin/env bash
# A profile of the training step on one GPU in one call, from binaries built elsewhere
# (scripts/ci/build_cuda_bins.sh DIR; no Rust, no nvcc, no network needed here), beside PyTorch:
# for ResNet-18 at batch 256 and ResNet-50 at batch 128, each in f32 (TF32 off) and in bf16
# autocast,
#   1. allgrad's SimCLR step (bench_simclr_step --no-torch): forward / backward / optimizer
#      times, the host traffic per step (device reads per phase, uploads, cuDNN heuristic
#      queries) and peak device memory;
#   2. allgrad's trainer on the same model and batch (train --profile on configs/simclr.yaml,
#      its images 1x28x28): the regions of a step (forward, backward, gradient sync, optimizer,
#      the one read) timed with CUDA events, with their host traffic;
#   3. PyTorch's same step as in 1 under torch.profiler (scripts/bench/bench_simclr_step.py
#      --profile): its key averages by device time, the per-op view to read 1 and 2 against.
# Then, where `nsys` is on PATH, a per-kernel table of allgrad's step (ResNet-18, f32).
#
#   ALLGRAD_GPU_BIN=target/gpu-bin.tar.xz scripts/bench/gpu_profile.sh [OUT_DIR]
#
# OUT_DIR (default target/gpu_profile) gets one log per command and summary.md (the commands
# and the tables, in order). Each command runs under ALLGRAD_PROFILE_LIMIT_S (default 60 s); the
# whole takes about 4 minutes of device time (docs/gpu.md lists each command with its time).
# PYTHON (default python3) must import torch with CUDA for part 3 (skipped, saying so, without).
# Libraries: as scripts/ci/gpu_ci.sh, the CUDA 13, NCCL and cuDNN libraries of CUDA_HOME or of the
# PyPI wheels of PYTHON (PyTorch's carry them).
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:-target/gpu_profile}"
mkdir -p "$out"
summary="$out/summary.md"
limit="${ALLGRAD_PROFILE_LIMIT_S:-60}"
python="${PYTHON:-python3}"
say() { echo "gpu_profile: $*" >&2; }

bin="${ALLGRAD_GPU_BIN:-}"
[ -n "$bin" ] || { say "set ALLGRAD_GPU_BIN to the directory or archive scripts/ci/build_cuda_bins.sh wrote"; exit 2; }
if [ -f "$bin" ]; then
    unpacked=$(mktemp -d)
    trap 'rm -rf "$unpacked"' EXIT
    tar -xJf "$bin" -C "$unpacked" || { say "cannot unpack $bin"; exit 1; }
    bin=$(dirname "$(find "$unpacked" -name train -type f | head -n 1)")
fi
for b in train bench_simclr_step; do
    [ -x "$bin/$b" ] || { say "$bin has no executable $b (scripts/ci/build_cuda_bins.sh makes it)"; exit 1; }
done
command -v nvidia-smi >/dev/null 2>&1 || { say "no nvidia-smi: no GPU to profile"; exit 1; }

# The CUDA 13 wheels' libraries (as scripts/ci/gpu_ci.sh finds them).
libs=$("$python" - <<'EOF' 2>/dev/null || true
import glob, os, sysconfig
site = sysconfig.get_paths()["purelib"]
for pat in ("nvidia/nccl/lib", "nvidia/cu13/lib", "nvidia/cudnn/lib"):
    d = os.path.join(site, pat)
    if glob.glob(os.path.join(d, "lib*.so*")):
        print(d)
EOF
)
cuda="${CUDA_HOME:-/usr/local/cuda}"
export LD_LIBRARY_PATH="$(echo $libs | tr ' ' ':')${libs:+:}$cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
torch_cuda=$("$python" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)

{
    echo "# GPU profile, $(date -u +%Y-%m-%dT%H:%MZ)"
    echo
    echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown); binaries: ${ALLGRAD_GPU_BIN}"
    echo "- GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | paste -sd';')"
    echo "- PyTorch with CUDA: $([ "$torch_cuda" = 1 ] && "$python" -c 'import torch; print(torch.__version__)' || echo no)"
} >"$summary"

# run NAME COMMAND...: the command under the limit, its output in $out/NAME.log and summary.md.
run() {
    local name=$1
    shift
    local t0=$SECONDS
    say "$name: $*"
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    {
        echo
        echo "## $name ($((SECONDS - t0)) s, exit $rc)"
        echo
        echo '```text'
        echo "\$ $*"
        tail -n 60 "$out/$name.log"
        echo '```'
    } >>"$summary"
}

cfg_dir=$(mktemp -d)
for shape in "18 256" "50 128"; do
    set -- $shape
    depth=$1 batch=$2
    for precision in full bf16; do
        tag="r${depth}_b${batch}_${precision}"
        run "${tag}_step" "$bin/bench_simclr_step" --device cuda --no-torch --rounds 3 --breakdown-rounds 0 \
            --depth "$depth" --precision "$precision" "$batch"
        run "${tag}_regions" "$bin/train" --config configs/simclr.yaml --profile --stop-after 4 \
            --output-dir "$cfg_dir/$tag" --set device=cuda --set precision="$precision" \
            --set model.encoder.depth="$depth" --set model.encoder.width=64 --set train.global_batch="$batch" \
            --set train.eval=false --set checkpoint.every=0 --set log.progress=quiet
        if [ "$torch_cuda" = 1 ]; then
            autocast=()
            [ "$precision" = bf16 ] && autocast=(--autocast)
            run "${tag}_torch" "$python" scripts/bench/bench_simclr_step.py --device cuda --profile --steps 3 \
                --depth "$depth" --batch "$batch" "${autocast[@]}"
        else
            echo -e "\n## ${tag}_torch: skipped (PYTHON=$python does not import torch with CUDA)" >>"$summary"
        fi
    done
done
rm -rf "$cfg_dir"
if command -v nsys >/dev/null 2>&1; then
    run r18_b256_full_kernels nsys profile --stats=true --force-overwrite=true -o "$out/r18_b256_full" \
        "$bin/bench_simclr_step" --device cuda --no-torch --rounds 2 --breakdown-rounds 0 --depth 18 256
else
    echo -e "\n## kernels: skipped (no nsys on PATH)" >>"$summary"
fi
say "done: $summary"
