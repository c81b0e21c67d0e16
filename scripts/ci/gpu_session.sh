#!/usr/bin/env bash
# A short GPU session in one call, the most telling checks first, under one deadline: for a GPU
# machine lent for minutes, with binaries built elsewhere (scripts/ci/build_cuda_bins.sh DIR).
#
#   ALLGRAD_GPU_BIN=target/gpu-bin.tar.xz scripts/ci/gpu_session.sh OUT_DIR [DEADLINE_S]
#
# Each step starts only if the time it is given still fits before DEADLINE_S (default 540 s,
# counted from the start of this script); one that does not is listed as "not reached". Steps, in
# order:
#   1. the SimCLR step beside PyTorch, ResNet-18 batch 256, f32 (TF32 off on both sides);
#   2. CLIP and the ring on the GPU: W = 2 == W = 1, GPU == CPU (gpu_ci.sh part equivalence_clip);
#   3. the step table's other rows: ResNet-18 batch 256 in bf16 and TF32, ResNet-50 batch 128 in
#      f32 and bf16, ResNet-18 batch 1024 in f32 and bf16;
#   4. the kernels against their CPU twins (gpu_ci.sh parts fused_ops, fused_optim, cudnn_conv,
#      loader_prefetch);
#   5. SimCLR, BarlowTwins and the face head: W ranks == 1 rank (part equivalence_images);
#   6. the collectives, SimCSE and vectors, the fault drill, ResNet-50 at batch 64 and 256;
#   7. the profile (scripts/bench/gpu_profile.sh: phases, host traffic, trainer regions, PyTorch's
#      torch.profiler view).
# ALLGRAD_GPU_STEPS=a,b runs only the steps so named (the names of session.md's headings), in
# the order above.
# OUT_DIR gets session.md (every step: command, seconds, exit status, the lines that matter) and
# logs.tar.gz (every log). Libraries: as gpu_ci.sh (PyTorch's CUDA 13 wheels of PYTHON).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
out="${1:?usage: scripts/ci/gpu_session.sh OUT_DIR [DEADLINE_S]}"
deadline="${2:-540}"
mkdir -p "$out/logs"
out=$(cd "$out" && pwd)
summary="$out/session.md"
python="${PYTHON:-python3}"
say() { echo "gpu_session: $*" >&2; }

bin="${ALLGRAD_GPU_BIN:?set ALLGRAD_GPU_BIN to what scripts/ci/build_cuda_bins.sh wrote}"
if [ -f "$bin" ]; then
    unpacked=$(mktemp -d)
    trap 'rm -rf "$unpacked"' EXIT
    tar -xJf "$bin" -C "$unpacked" || { say "cannot unpack $bin"; exit 1; }
    bin=$(dirname "$(find "$unpacked" -name train -type f | head -n 1)")
fi
bin=$(cd "$bin" && pwd)
export ALLGRAD_GPU_BIN="$bin" PYTHON="$python"
libs=$("$python" - <<'EOF' 2>/dev/null || true
import glob, os, sysconfig
site = sysconfig.get_paths()["purelib"]
for pat in ("nvidia/nccl/lib", "nvidia/cu13/lib", "nvidia/cudnn/lib"):
    d = os.path.join(site, pat)
    if glob.glob(os.path.join(d, "lib*.so*")):
        print(d)
EOF
)
export LD_LIBRARY_PATH="$(echo $libs | tr ' ' ':')${libs:+:}${CUDA_HOME:-/usr/local/cuda}/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

{
    echo "# GPU session, $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (with local changes)')"
    echo "- GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader 2>&1 | paste -sd';')"
    echo "- PyTorch: $("$python" -c 'import torch; print(torch.__version__, "cuda", torch.cuda.is_available())' 2>&1 | tail -n 1)"
    echo "- CPU: $(nproc) cores; load average $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "- deadline: $deadline s"
} >"$summary"

t0=$SECONDS
# step NAME SECONDS COMMAND...: COMMAND under a limit of SECONDS (less if the deadline is nearer;
# not started when under half of SECONDS is left), its output in logs/NAME.log.
step() {
    local name=$1 want=$2
    shift 2
    if [ -n "${ALLGRAD_GPU_STEPS:-}" ] && [[ ,$ALLGRAD_GPU_STEPS, != *,$name,* ]]; then
        return
    fi
    local left=$((deadline - (SECONDS - t0) - 5))
    if [ "$left" -lt $((want / 2)) ]; then
        echo -e "\n## $name: not reached ($left s left, $want s wanted)" >>"$summary"
        say "$name: not reached"
        return
    fi
    local limit=$((want < left ? want : left)) s=$SECONDS rc
    say "$name (limit $limit s): $*"
    timeout --kill-after=5 "$limit" "$@" >"$out/logs/$name.log" 2>&1
    rc=$?
    {
        echo
        echo "## $name: exit $rc in $((SECONDS - s)) s (limit $limit s)"
        echo
        echo '```text'
        echo "\$ $*"
        grep -E '^==|^wall s|^peak|ratio|median|WARNING|load|test result|panicked|FAILED|failed|SKIPPED|error|\| (passed|failed|skipped) \|' "$out/logs/$name.log" | grep -v '^running' | head -n 60
        echo '```'
    } >>"$summary"
    say "$name: exit $rc"
}

bench() { # bench NAME DEPTH PRECISION BATCHES...
    local name=$1 depth=$2 precision=$3
    shift 3
    # Busy above a 1-minute load of a quarter of the CPUs (the benchmark's default, 0.5, is for a
    # 2-core machine); the CPU time other processes take during the steps is flagged apart.
    step "$name" 120 "$bin/bench_simclr_step" --device cuda --precision "$precision" --depth "$depth" \
        --rounds 5 --breakdown-rounds 0 --busy-load "$(nproc | awk '{print $1 / 4}')" "$@"
}
ci() { # ci NAME SECONDS PARTS: scripts/ci/gpu_ci.sh on these parts, its report under OUT_DIR
    local name=$1 want=$2 parts=$3
    step "$name" "$want" env ALLGRAD_GPU_PARTS="$parts" ALLGRAD_GPU_PART_LIMIT_S=$((want - 10)) \
        ALLGRAD_GPU_OUT="$out/logs/$name" scripts/ci/gpu_ci.sh
    [ -f "$out/logs/$name/report.md" ] && sed -n '/^| part/,/^$/p' "$out/logs/$name/report.md" >>"$summary"
}

bench r18_b256_full 18 full 256
ci equivalence_clip 150 equivalence_clip
bench r18_b256_bf16 18 bf16 256
bench r18_b256_tf32 18 tf32 256
bench r50_b128_full 50 full 128
bench r50_b128_bf16 50 bf16 128
bench r18_b1024 18 full 1024
bench r18_b1024_bf16 18 bf16 1024
ci kernels 150 fused_ops,fused_optim,cudnn_conv,loader_prefetch
ci equivalence_images 180 equivalence_images
ci collectives 120 collectives
ci equivalence_text 120 equivalence_text
ci fault_drill 90 fault_drill
bench r50_b64_b256 50 full 64 256
bench r50_b64_b256_bf16 50 bf16 64 256
step profile 300 env ALLGRAD_GPU_BIN="$bin" scripts/bench/gpu_profile.sh "$out/logs/profile"
[ -f "$out/logs/profile/summary.md" ] && sed 's/^#/##/' "$out/logs/profile/summary.md" >>"$summary"

echo -e "\n- total: $((SECONDS - t0)) s" >>"$summary"
tar -C "$out" -czf "$out/logs.tar.gz" logs && rm -rf "$out/logs"
cat "$summary"
