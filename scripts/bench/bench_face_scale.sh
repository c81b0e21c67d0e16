#!/usr/bin/env bash
# How many identities the class-sharded face head trains within a memory budget: the peak
# resident memory of W ranks (default 2) taking a step of the head alone
# (crates/allgrad-bench/src/bin/bench_face_head.rs: D 512, global batch 512, ArcFace, SGD with momentum and
# weight decay, Partial FC at --rate, --update sparse) at a few class counts, a straight
# line through them (MiB per rank = fixed + bytes per class x classes per rank), and from it
# the largest class count within --budget-gib over the W ranks, and the projection to
# insightface's published Partial FC setting (29M identities on 8 GPUs of 80 GB each).
#
#   scripts/bench/bench_face_scale.sh [--world 2] [--classes 250000,500000,1000000] [--rate 0.1]
#       [--update sparse|dense] [--storage f32|bf16] [--dim 512] [--global-batch 512]
#       [--budget-gib 24] [--verify] [--threads N]
#   scripts/bench/bench_face_scale.sh --classes 2000,4000 --dim 64 --global-batch 64   # a quick check
#
# Memory does not depend on the machine's load: this may run beside other work, but each
# run needs its peak in free memory. The peak is resident memory: the larger of `VmHWM` while
# setting up and over the steps, the largest over the ranks (the centres, the optimizer state:
# momentum and the per-row update counts, and everything the step allocates). Every rank runs
# under `ulimit -v` of the budget / W plus a fifth and 1 GiB for address space mapped but never
# touched (the resident peak is what the budget is compared with), so a run far beyond the
# budget fails with an allocation error instead of waking the OOM killer. --verify then runs
# a step at 98% of the largest class count the line gives and checks its resident peak
# against the budget. Logs go to $BENCH_OUT (default: a new folder under /tmp).
set -euo pipefail
cd "$(dirname "$0")/../.."

world=2 classes=250000,500000,1000000 rate=0.1 update=sparse storage=f32 dim=512 batch=512 budget=24 verify=0 threads=$(nproc)
while (($#)); do
    case "$1" in
        --world) world=$2; shift 2 ;;
        --classes) classes=$2; shift 2 ;;
        --rate) rate=$2; shift 2 ;;
        --update) update=$2; shift 2 ;;
        --storage) storage=$2; shift 2 ;;
        --dim) dim=$2; shift 2 ;;
        --global-batch) batch=$2; shift 2 ;;
        --budget-gib) budget=$2; shift 2 ;;
        --verify) verify=1; shift ;;
        --threads) threads=$2; shift 2 ;;
        -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
        *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
IFS=, read -ra classes <<<"$classes"
if ((${#classes[@]} < 2)); then
    echo "--classes needs at least two class counts to fit a line" >&2
    exit 2
fi
out=${BENCH_OUT:-$(mktemp -d "${TMPDIR:-/tmp}/bench_face_scale.XXXXXX")}
mkdir -p "$out"

cargo build --release -q -p allgrad -p allgrad-bench --bin launch --bin bench_face_head >&2
target=${CARGO_TARGET_DIR:-target}
launch=$target/release/launch
rank_bin=$target/release/bench_face_head
per_rank_threads=$((threads / world > 0 ? threads / world : 1))

# One step (after one untimed) at C classes under the budget; prints the largest peak MiB
# over the ranks, or fails.
one_step() { # C LOG
    local kib
    kib=$(awk -v g="$budget" -v w="$world" 'BEGIN { printf "%d", (g / w * 1.2 + 1) * 1048576 }')
    (
        ulimit -v "$kib"
        export RAYON_NUM_THREADS=$per_rank_threads CANDLE_NUM_THREADS=$per_rank_threads
        exec "$launch" --nproc-per-node "$world" "$rank_bin" --classes "$1" --rate "$rate" --update "$update" --storage "$storage" \
            --dim "$dim" --global-batch "$batch" --steps 1 --warmup 1
    ) >"$2" 2>&1 || return 1
    # The larger of the setup's and the steps' peak, the largest over the ranks.
    awk '/face_head_mem/ { for (i = 1; i <= NF; i++) { split($i, kv, "=");
            if (kv[1] == "setup_peak_mib" && kv[2] > p) { p = kv[2]; f = "setup" }
            if (kv[1] == "peak_mib" && kv[2] > p) { p = kv[2]; f = "steps" } } }
        END { if (!p) exit 1; printf "%.1f %s\n", p, f }' "$2"
}

echo "W $world, D $dim, global batch $batch, rate $rate, --update $update, --storage $storage; budget $budget GiB over the ranks; logs in $out"
printf '%-10s %-12s %-14s %s\n' classes "per rank" "peak MiB/rank" "peak in"
points=()
for c in "${classes[@]}"; do
    if res=$(one_step "$c" "$out/scale_$c.log"); then
        read -r peak from <<<"$res"
        printf '%-10s %-12s %-14s %s\n' "$c" $((c / world)) "$peak" "$from"
        points+=("$((c / world)) $peak")
    else
        printf '%-10s %-12s %-14s %s\n' "$c" $((c / world)) "-" "failed: $(tail -n 1 "$out/scale_$c.log" | cut -c1-80)"
    fi
done
if ((${#points[@]} < 2)); then
    echo "fewer than two class counts ran: no fit"
    exit 1
fi
# Least squares: peak MiB = a + b * classes per rank.
read -r a b < <(printf '%s\n' "${points[@]}" | awk '{ n++; x += $1; y += $2; xx += $1 * $1; xy += $1 * $2 }
    END { b = (n * xy - x * y) / (n * xx - x * x); a = (y - b * x) / n; printf "%.3f %.9f\n", a, b }')
awk -v a="$a" -v b="$b" -v w="$world" -v g="$budget" 'BEGIN {
    per_class = b * 1048576
    printf "\nfit: peak per rank = %.0f MiB + %.0f bytes x classes per rank\n", a, per_class
    cmax = int(w * (g * 1024 / w - a) / b)
    printf "largest class count within %s GiB over %d ranks: %d (%.2fM)\n", g, w, cmax, cmax / 1e6
    gpu = 80e9 / 1048576
    need = a + b * 29e6 / 8
    printf "29M identities over 8 ranks: %.1f GiB per rank (80 GB = %.1f GiB); largest on 8 x 80 GB: %.0fM\n",
        need / 1024, gpu / 1024, 8 * (gpu - a) / b / 1e6
}'
if ((verify)); then
    cmax=$(awk -v a="$a" -v b="$b" -v w="$world" -v g="$budget" 'BEGIN { printf "%d", int(0.98 * w * (g * 1024 / w - a) / b / 1000) * 1000 }')
    echo
    if res=$(one_step "$cmax" "$out/verify_$cmax.log"); then
        read -r peak from <<<"$res"
        if awk -v p="$peak" -v g="$budget" -v w="$world" 'BEGIN { exit !(p <= g * 1024 / w) }'; then
            echo "verified: $cmax classes took a step on $world ranks, resident peak $peak MiB per rank (in the $from), within $budget GiB"
        else
            echo "NOT verified: $cmax classes took a step but peaked at $peak MiB per rank, above $budget GiB / $world"
            exit 1
        fi
    else
        echo "NOT verified: $cmax classes failed: $(tail -n 1 "$out/verify_$cmax.log" | cut -c1-100)"
        exit 1
    fi
fi
