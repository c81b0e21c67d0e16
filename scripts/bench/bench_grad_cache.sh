#!/usr/bin/env bash
# Gradient caching benchmark: peak resident memory per rank and step time of SimCLR
# (ResNet-18, CIFAR stem, SyncBatchNorm, projector 512-2048-128, NT-Xent over the global
# batch, LARS) on the bundled Fashion-MNIST at 32x32, with and without train.cache_chunk,
# ranks as processes through `launch` (crates/allgrad-bench/src/bin/bench_grad_cache.rs is one rank).
#
#   scripts/bench/bench_grad_cache.sh [--nproc 2] [--chunk 64] [--steps 2] [--rounds 3] [--width 64] [BATCH ...]
#                                                               (default batches: 256 1024 4096)
#   scripts/bench/bench_grad_cache.sh --width 8 --steps 1 --rounds 1 --chunk 8 32 64   # a quick check
#
# For each global batch, plain and cached runs alternate (plain, cached, plain, cached, ...)
# for --rounds rounds, each a fresh set of processes (one untimed step, then --steps timed
# ones). It prints, per batch and mode: the mean step time of each round (min / median /
# max over rounds), the largest peak RSS over ranks and rounds (getrusage ru_maxrss), and
# the RSS after loading (before the first step). A run that fails (out of memory: the kernel
# kills it, exit 137) is reported as such and the other mode still runs. Run it on an idle
# machine: it prints the load average before and after.
set -euo pipefail
cd "$(dirname "$0")/../.."

nproc=2 chunk=64 steps=2 rounds=3 width=64 batches=()
while (($#)); do
    case "$1" in
        --nproc) nproc=$2; shift 2 ;;
        --chunk) chunk=$2; shift 2 ;;
        --steps) steps=$2; shift 2 ;;
        --rounds) rounds=$2; shift 2 ;;
        --width) width=$2; shift 2 ;;
        -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
        -*) echo "unknown option $1" >&2; exit 2 ;;
        *) batches+=("$1"); shift ;;
    esac
done
((${#batches[@]})) || batches=(256 1024 4096)

cargo build --release -q -p allgrad -p allgrad-bench --bin launch --bin bench_grad_cache >&2
target=${CARGO_TARGET_DIR:-target}
launch=$target/release/launch
rank_bin=$target/release/bench_grad_cache

echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg); $(nproc) CPUs; $nproc ranks; width $width; chunk $chunk per rank; $steps timed steps x $rounds rounds"
printf '%-8s %-8s %-26s %-16s %-14s\n' batch mode "step s (min/median/max)" "peak RSS MiB" "RSS start MiB"

# One run: prints "STEP_S PEAK_MIB START_MIB" (the largest over ranks), or "failed RC".
one_run() {
    local batch=$1 c=$2 out rc=0
    out=$("$launch" --nproc-per-node "$nproc" "$rank_bin" --global-batch "$batch" --cache-chunk "$c" \
        --steps "$steps" --width "$width" 2>&1) || rc=$?
    if ((rc != 0)); then
        echo "failed $rc"
        echo "$out" | tail -3 | sed 's/^/    /' >&2
        return
    fi
    echo "$out" | grep 'bench_grad_cache: rank' | awk '{
        for (i = 1; i <= NF; i++) { if ($i == "step_s") s = $(i+1); if ($i == "peak_rss_mib") p = $(i+1); if ($i == "rss_start_mib") r = $(i+1) }
        if (s > S) S = s; if (p > P) P = p; if (r > R) R = r } END { print S, P, R }'
}

summarise() { # label batch results...
    local label=$1 batch=$2; shift 2
    local times=() peak=0 start=0 failed=""
    for r in "$@"; do
        read -r a b c <<<"$r"
        if [[ $a == failed ]]; then failed="failed (exit $b)"; continue; fi
        times+=("$a"); peak=$(awk -v x="$peak" -v y="$b" 'BEGIN{print (y > x) ? y : x}')
        start=$(awk -v x="$start" -v y="$c" 'BEGIN{print (y > x) ? y : x}')
    done
    if ((${#times[@]} == 0)); then printf '%-8s %-8s %s\n' "$batch" "$label" "$failed"; return; fi
    local stats
    stats=$(printf '%s\n' "${times[@]}" | sort -g | awk '{v[NR] = $1} END {
        m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2; printf "%.3f / %.3f / %.3f", v[1], m, v[NR] }')
    printf '%-8s %-8s %-26s %-16s %-14s %s\n' "$batch" "$label" "$stats" "$peak" "$start" "$failed"
}

for batch in "${batches[@]}"; do
    plain=() cached=()
    for ((r = 0; r < rounds; r++)); do
        plain+=("$(one_run "$batch" 0)")
        cached+=("$(one_run "$batch" "$chunk")")
    done
    summarise plain "$batch" "${plain[@]}"
    summarise cached "$batch" "${cached[@]}"
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
