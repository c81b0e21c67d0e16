#!/usr/bin/env bash
# Tiled-loss benchmark (crates/allgrad-bench/src/bin/bench_tiled_loss.rs is one rank, run through `launch`):
# memory of one training step against the global batch, and the time of the tiled loss and
# step against the untiled ones.
#
#   scripts/bench/bench_tiled_loss.sh memory [--nproc 1] [--method vectors] [--tile 4096] [--chunk 4096]
#                                      [--cap-gib 12] [--modes "untiled tiled tiled+cache"] [BATCH ...]
#       One step per global batch and mode, each a fresh set of processes: the largest peak RSS
#       over ranks (getrusage ru_maxrss, MiB), the RSS after the model was built, the step's
#       time, and a run with only the loss (`loss` rows: this rank's embeddings of both views,
#       the loss and its backward, no model). Each rank's address space is capped at --cap-gib
#       (ulimit -v), so a mode that does not fit fails alone ("out of memory") instead of
#       pushing the machine into swap or the OOM killer. Default batches: 4096 16384 65536
#       262144 1048576 (--method resnet: 4096; the bundled image set has 10,000 images).
#
#   scripts/bench/bench_tiled_loss.sh time [--nproc 1] [--method vectors] [--tile 4096] [--rounds 3]
#                                    [--steps 2] [BATCH ...]
#       Untiled and tiled alternate (untiled, tiled, untiled, tiled, ...) for --rounds rounds,
#       each a fresh set of processes, first for the loss alone (--steps timed repetitions
#       after one untimed), then for the whole step (one untimed step, --steps timed). Prints
#       min / median / max over rounds of each and the ratio of the medians (tiled / untiled).
#       Default batches: 1024 2048 4096 (the untiled loss needs about 3 GiB at 4096 and grows
#       with the square of the batch). Run it on an idle machine: it prints the load average
#       before and after.
#
#   scripts/bench/bench_tiled_loss.sh memory --modes tiled 4096     # a quick check
set -euo pipefail
cd "$(dirname "$0")/../.."

what=${1:-}
[[ $what == memory || $what == time ]] || { sed -n '2,27p' "$0"; exit 2; }
shift
nproc=1 method=vectors tile=4096 chunk=4096 cap=12 rounds=3 steps=2 modes="untiled tiled tiled+cache" batches=()
while (($#)); do
    case "$1" in
        --nproc) nproc=$2; shift 2 ;;
        --method) method=$2; shift 2 ;;
        --tile) tile=$2; shift 2 ;;
        --chunk) chunk=$2; shift 2 ;;
        --cap-gib) cap=$2; shift 2 ;;
        --rounds) rounds=$2; shift 2 ;;
        --steps) steps=$2; shift 2 ;;
        --modes) modes=$2; shift 2 ;;
        -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
        -*) echo "unknown option $1" >&2; exit 2 ;;
        *) batches+=("$1"); shift ;;
    esac
done
if ((${#batches[@]} == 0)); then
    if [[ $what == memory && $method == resnet ]]; then batches=(4096)
    elif [[ $what == memory ]]; then batches=(4096 16384 65536 262144 1048576)
    else batches=(1024 2048 4096); fi
fi

cargo build --release -q -p allgrad -p allgrad-bench --bin launch --bin bench_tiled_loss >&2
target=${CARGO_TARGET_DIR:-target}
launch=$target/release/launch
rank_bin=$target/release/bench_tiled_loss

# One run: `launch` with the rank's arguments, address space capped; prints the rank lines'
# largest "FIRST STEP_OR_LOSS PEAK START" or "failed REASON".
one_run() {
    local out rc=0
    out=$( (ulimit -v $((cap * 1024 * 1024)); "$launch" --nproc-per-node "$nproc" "$rank_bin" "$@") 2>&1) || rc=$?
    if ((rc != 0)); then
        if grep -q "memory allocation of .* failed\|out of memory\|Cannot allocate memory" <<<"$out"; then
            echo "failed out of memory (cap ${cap} GiB per rank)"
        else
            echo "failed exit $rc"
        fi
        echo "$out" | grep -v '^\s*$' | tail -2 | sed 's/^/    /' >&2
        return
    fi
    echo "$out" | grep 'bench_tiled_loss: rank' | awk '{
        for (i = 1; i <= NF; i++) {
            if ($i == "first_s") f = $(i+1); if ($i == "step_s" || $i == "loss_s") s = $(i+1)
            if ($i == "peak_rss_mib") p = $(i+1); if ($i == "rss_start_mib") r = $(i+1) }
        if (f > F) F = f; if (s > S || S == "") S = s; if (p > P) P = p; if (r > R) R = r } END { print F, S, P, R }'
}

mode_args() { # mode -> arguments
    case "$1" in
        untiled) echo "--tile 0 --cache-chunk 0" ;;
        tiled) echo "--tile $tile --cache-chunk 0" ;;
        tiled+cache) echo "--tile $tile --cache-chunk $chunk" ;;
        *) echo "unknown mode $1" >&2; exit 2 ;;
    esac
}

settings="$nproc rank(s); method $method; tile $tile"
[[ $what == memory ]] && settings+="; cache_chunk $chunk per rank; address space capped at $cap GiB per rank"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg); $(nproc) CPUs; $settings"

if [[ $what == memory ]]; then
    printf '%-9s %-13s %-18s %-16s %-12s %s\n' batch mode "peak RSS MiB" "RSS start MiB" "step s" ""
    for batch in "${batches[@]}"; do
        for mode in $modes; do
            # shellcheck disable=SC2046
            for kind in step loss; do
                [[ $kind == loss && $mode == tiled+cache ]] && continue # the same loss as `tiled`
                extra=(--method "$method" --global-batch "$batch")
                [[ $kind == loss ]] && extra+=(--loss-only)
                r=$(one_run "${extra[@]}" $(mode_args "$mode"))
                label=$mode; [[ $kind == loss ]] && label="$mode loss"
                if [[ $r == failed* ]]; then printf '%-9s %-13s %s\n' "$batch" "$label" "${r#failed }"; continue; fi
                read -r first _ peak start <<<"$r"
                printf '%-9s %-13s %-18s %-16s %-12s\n' "$batch" "$label" "$peak" "$start" "$first"
            done
        done
    done
else
    stats() { printf '%s\n' "$@" | sort -g | awk '{v[NR] = $1} END {
        m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2; printf "%.4f %.4f %.4f", v[1], m, v[NR] }'; }
    printf '%-9s %-6s %-28s %-28s %s\n' batch what "untiled s (min/median/max)" "tiled s (min/median/max)" "tiled/untiled (medians)"
    for batch in "${batches[@]}"; do
        for kind in loss step; do
            u=() t=() failed=""
            for ((r = 0; r < rounds; r++)); do
                for mode in untiled tiled; do
                    extra=(--method "$method" --global-batch "$batch" --steps "$steps")
                    [[ $kind == loss ]] && extra+=(--loss-only)
                    # shellcheck disable=SC2046
                    res=$(one_run "${extra[@]}" $(mode_args "$mode"))
                    if [[ $res == failed* ]]; then failed="$mode: ${res#failed }"; continue; fi
                    read -r _ s _ _ <<<"$res"
                    if [[ $mode == untiled ]]; then u+=("$s"); else t+=("$s"); fi
                done
            done
            if [[ -n $failed ]] || ((${#u[@]} == 0 || ${#t[@]} == 0)); then
                printf '%-9s %-6s %s\n' "$batch" "$kind" "failed ($failed)"
                continue
            fi
            read -r u1 u2 u3 <<<"$(stats "${u[@]}")"
            read -r t1 t2 t3 <<<"$(stats "${t[@]}")"
            ratio=$(awk -v a="$t2" -v b="$u2" 'BEGIN { printf "%.3f", a / b }')
            printf '%-9s %-6s %-28s %-28s %s\n' "$batch" "$kind" "$u1 / $u2 / $u3" "$t1 / $t2 / $t3" "$ratio"
        done
    done
fi
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
