#!/usr/bin/env bash
# The class-sharded face head alone at scale, allgrad against a PyTorch Partial FC v2, in ONE
# invocation: D 512, global batch 512 of fixed random embeddings (split over the ranks, a
# gradient flows back to them), ArcFace (m 0.5, s 64), SGD (lr 0.1, momentum 0.9, weight
# decay 5e-4); per step forward, backward and the optimizer step of the head. Both update
# every centre as a dense SGD step does (with sampling, momentum and weight decay move the
# unsampled centres too): allgrad with its row-sparse gradient and lazy update (--update
# sparse, the default; exact, see docs/face.md) or its dense gradient (--update dense).
#   allgrad: crates/allgrad-bench/src/bin/bench_face_head.rs, W ranks through `launch`;
#   PyTorch: scripts/bench/bench_face_head.py, W ranks through torch.multiprocessing, gloo.
#
#   scripts/bench/bench_face_head.sh [--classes 100000,1000000,4000000] [--worlds 1,2] [--rates 1.0,0.1]
#       [--update sparse|dense] [--rounds 3] [--steps 3] [--threads N] [--mem-gib G]
#       [--check-classes 1000] [--no-check] [--no-torch] [--busy-load 0.5]
#   scripts/bench/bench_face_head.sh --classes 10000 --worlds 1,2 --rounds 1 --steps 1   # a quick check
#
# First a correctness check at --check-classes (W 1 and 2; ArcFace and CosFace at r 1 and
# 0.1): allgrad writes its inputs, initial centres and each step's sampled classes (`--dump`,
# three steps), PyTorch computes its losses on them; the first-step losses must agree to 1e-5
# relative, and with CosFace also those of steps 2 and 3 (after one and two SGD steps: at r 0.1
# step 3 reads centres that step 2 left out and that its momentum and weight decay moved, which
# allgrad's lazy update applies; insightface does not differentiate the ArcFace margin, so
# ArcFace's later losses differ by design). A failed check makes the script exit 1 at the end.
# Then for every (C, W, r) cell, --rounds rounds of (allgrad run, PyTorch run), each a fresh
# set of W processes taking one untimed step and --steps timed ones; a step's time is the
# slowest rank's. Table: the median (min / max) over all timed steps of all rounds, the ratio
# of medians allgrad / PyTorch, and per rank (largest over ranks and rounds) the resident
# memory once the head is set up and the peak during the steps, MiB.
# Threads: --threads in all (default: the CPUs), per rank max(1, threads / W), the same for
# both (RAYON_NUM_THREADS, CANDLE_NUM_THREADS; torch.set_num_threads, OMP_NUM_THREADS,
# MKL_NUM_THREADS); the threads column shows what each side reports (rayon/candle/torch).
# Memory: every rank runs under `ulimit -v` of --mem-gib / W (default 90% of MemAvailable
# at the start) plus what it maps without using (1 GiB for allgrad; for PyTorch its address
# space after `import torch`, measured, plus 1 GiB), so a cell that does not fit fails with
# an allocation error (reported; its later rounds are skipped, the other cells go on)
# instead of waking the OOM killer.
# PYTHON picks the interpreter with torch (default python3); without torch, or with
# --no-torch, only allgrad runs. Logs of every run go to $BENCH_OUT (default: a new folder
# under /tmp). Run it on an idle machine: it prints the load average first and warns above
# --busy-load.
set -euo pipefail
cd "$(dirname "$0")/../.."

classes=100000,1000000,4000000 worlds=1,2 rates=1.0,0.1 update=sparse rounds=3 steps=3 threads=$(nproc) mem_gib=""
check_classes=1000 check=1 torch=1 busy=0.5
while (($#)); do
    case "$1" in
        --classes) classes=$2; shift 2 ;;
        --worlds) worlds=$2; shift 2 ;;
        --rates) rates=$2; shift 2 ;;
        --update) update=$2; shift 2 ;;
        --rounds) rounds=$2; shift 2 ;;
        --steps) steps=$2; shift 2 ;;
        --threads) threads=$2; shift 2 ;;
        --mem-gib) mem_gib=$2; shift 2 ;;
        --check-classes) check_classes=$2; shift 2 ;;
        --no-check) check=0; shift ;;
        --no-torch) torch=0; shift ;;
        --busy-load) busy=$2; shift 2 ;;
        -h|--help) sed -n '2,39p' "$0"; exit 0 ;;
        *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
IFS=, read -ra classes <<<"$classes"
IFS=, read -ra worlds <<<"$worlds"
IFS=, read -ra rates <<<"$rates"
if [[ $update != sparse && $update != dense ]]; then
    echo "--update must be sparse or dense, not $update" >&2
    exit 2
fi
PYTHON=${PYTHON:-python3}
out=${BENCH_OUT:-$(mktemp -d "${TMPDIR:-/tmp}/bench_face_head.XXXXXX")}
mkdir -p "$out"

cargo build --release -q -p allgrad -p allgrad-bench --bin launch --bin bench_face_head >&2
target=${CARGO_TARGET_DIR:-target}
launch=$target/release/launch
rank_bin=$target/release/bench_face_head

read -r load1 load5 load15 _ </proc/loadavg
echo "load average before: $load1 $load5 $load15 (1, 5, 15 min) on $(nproc) CPUs"
if awk -v l="$load1" -v b="$busy" 'BEGIN { exit !(l > b) }'; then
    echo "WARNING: the machine is busy (1-minute load $load1 > $busy): these timings are not figures (after a build, wait a minute)"
fi
if [[ -z $mem_gib ]]; then
    mem_gib=$(awk '/^MemAvailable:/ { printf "%.1f", $2 * 0.9 / 1048576 }' /proc/meminfo)
fi
# Address space a rank maps without using it (what `ulimit -v` must allow on top of the
# budget), GiB: allgrad's thread stacks and arenas; PyTorch's libraries, measured.
slack_allgrad=1 slack_torch=0
if ((torch)); then
    if slack_torch=$("$PYTHON" -c 'import torch, torch.distributed
for line in open("/proc/self/status"):
    if line.startswith("VmSize:"): print(round(int(line.split()[1]) / 1048576 + 1, 1))' 2>/dev/null); then
        echo "PyTorch's address space after import, plus 1 GiB: $slack_torch GiB per rank allowed on top of the budget"
    else
        echo "(no PyTorch column: $PYTHON cannot import torch; set PYTHON to an interpreter with torch)"
        torch=0
    fi
fi
echo "memory budget ${mem_gib} GiB over the ranks of a run; $threads threads in all; allgrad --update $update; logs in $out"

# One run of an implementation with W ranks, per_rank threads each, under the memory limit;
# its output goes to LOG. Returns the run's exit status.
one_run() { # impl W C r LOG [extra args...]
    local impl=$1 w=$2 c=$3 r=$4 log=$5
    shift 5
    local t=$((threads / w > 0 ? threads / w : 1))
    local kib slack=$slack_allgrad
    [[ $impl == torch ]] && slack=$slack_torch
    kib=$(awk -v g="$mem_gib" -v w="$w" -v s="$slack" 'BEGIN { printf "%d", (g / w + s) * 1048576 }')
    (
        ulimit -v "$kib"
        export RAYON_NUM_THREADS=$t CANDLE_NUM_THREADS=$t OMP_NUM_THREADS=$t MKL_NUM_THREADS=$t
        if [[ $impl == allgrad ]]; then
            exec "$launch" --nproc-per-node "$w" "$rank_bin" --classes "$c" --rate "$r" --update "$update" "$@"
        else
            exec "$PYTHON" scripts/bench/bench_face_head.py --nproc "$w" --threads "$t" --classes "$c" --rate "$r" "$@"
        fi
    ) >"$log" 2>&1
}

failed=0
if ((check)); then
    echo
    echo "== check: losses on the same inputs, initial centres and sampled classes, C $check_classes"
    printf '%-3s %-8s %-5s %-6s %-16s %-16s %-9s %s\n' W margin r step allgrad PyTorch rel.diff verdict
    for w in 1 2; do
        for case in arcface:1.0 arcface:0.1 cosface:1.0 cosface:0.1; do
            m=${case%:*} r=${case#*:} dir=$out/check_${w}_${m}_$r
            if ! one_run allgrad "$w" "$check_classes" "$r" "$dir.allgrad.log" --margin "$m" --dump "$dir"; then
                echo "$w $m $r: allgrad --dump failed (log $dir.allgrad.log)"; failed=1; continue
            fi
            la=$(grep -o 'face_head_check.*' "$dir.allgrad.log")
            if ((torch)) && ! one_run torch "$w" "$check_classes" "$r" "$dir.torch.log" --margin "$m" --check "$dir"; then
                # PyTorch 2.15's gloo can abort a rank while the processes exit ("terminate
                # called without an active exception") after the losses were printed: those
                # losses are still compared; a run that printed none fails the check.
                if grep -q 'face_head_check' "$dir.torch.log"; then
                    echo "$w $m $r: PyTorch exited abnormally after printing its losses (log $dir.torch.log); they are compared"
                else
                    echo "$w $m $r: PyTorch --check failed (log $dir.torch.log)"; failed=1; continue
                fi
            fi
            lt=$( ((torch)) && grep -o 'face_head_check.*' "$dir.torch.log" || true)
            for key in loss loss2 loss3; do
                [[ $key != loss && $m != cosface ]] && continue
                a=$(grep -o "$key=[^ ]*" <<<"$la" | cut -d= -f2)
                b=$(grep -o "$key=[^ ]*" <<<"$lt" | cut -d= -f2 || true)
                verdict=$(awk -v a="$a" -v b="$b" 'BEGIN {
                    if (b == "") { print "- -"; exit } d = (a > b ? a - b : b - a) / (a > 0 ? a : -a);
                    printf "%.1e %s", d, (d <= 1e-5 ? "agree" : "DIFFER") }')
                [[ $verdict == *DIFFER ]] && failed=1
                step=${key#loss}
                step=${step:-1}
                printf '%-3s %-8s %-5s %-6s %-16s %-16s %s\n' "$w" "$m" "$r" "$step" "$a" "${b:--}" "$verdict"
            done
        done
    done
fi

# Median (min / max) of the numbers on stdin, or "-".
stats() { sort -g | awk '{ v[NR] = $1 } END { if (!NR) { print "-"; exit }
    m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2; printf "%.3f (%.3f/%.3f)", m, v[1], v[NR] }'; }
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR) print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
# Values of KEY on the timed step lines of the logs given.
timed() { awk -v k="$1" '/face_head_step/ && /timed=1/ { for (i = 1; i <= NF; i++) { split($i, kv, "=");
    if (kv[1] == k) print kv[2] } }' "${@:2}"; }
# "INIT/PEAK" MiB, the largest over ranks and the logs given.
memory() { awk '/face_head_mem/ { for (i = 1; i <= NF; i++) { split($i, kv, "=");
    if (kv[1] == "init_mib" && kv[2] > a) a = kv[2]; if (kv[1] == "peak_mib" && kv[2] > p) p = kv[2] } }
    END { if (p) printf "%.0f/%.0f", a, p; else print "-" }' "$@"; }
# Why a run failed, in a few words.
why() { # LOG
    if grep -q 'memory allocation of\|allocate memory' "$1"; then echo "out of memory under the limit"
    else tail -n 1 "$1" | cut -c1-80; fi
}

echo
echo "== step time, s: median (min/max) over rounds x steps; ratio allgrad/PyTorch; MiB per rank: after setup / peak in the steps"
printf '%-8s %-2s %-4s %-8s %-24s %-24s %-6s %-13s %-13s\n' C W r threads allgrad PyTorch ratio "allgrad MiB" "PyTorch MiB"
phases=()
for c in "${classes[@]}"; do
    for w in "${worlds[@]}"; do
        for r in "${rates[@]}"; do
            cell=$out/run_${c}_${w}_$r
            logs_a=() logs_t=() notes="" oom_a=0 oom_t=0
            for ((k = 0; k < rounds; k++)); do
                echo "  C $c W $w r $r round $((k + 1))/$rounds ..." >&2
                # A run out of memory would be out of memory again: its later rounds are skipped.
                if ((!oom_a)); then
                    if ! one_run allgrad "$w" "$c" "$r" "$cell.allgrad.$k.log" --steps "$steps"; then
                        notes+=" allgrad round $((k + 1)) failed: $(why "$cell.allgrad.$k.log");"
                        [[ $(why "$cell.allgrad.$k.log") == out* ]] && oom_a=1
                    fi
                    logs_a+=("$cell.allgrad.$k.log")
                fi
                if ((torch && !oom_t)); then
                    if ! one_run torch "$w" "$c" "$r" "$cell.torch.$k.log" --steps "$steps"; then
                        notes+=" PyTorch round $((k + 1)) failed: $(why "$cell.torch.$k.log");"
                        [[ $(why "$cell.torch.$k.log") == out* ]] && oom_t=1
                    fi
                    logs_t+=("$cell.torch.$k.log")
                fi
            done
            thr_a=$(grep -ho 'threads_per_rank=[0-9]* candle=[0-9]*' "${logs_a[@]}" | head -1 | grep -o '[0-9]*' | paste -sd/ || true)
            thr_t=$( ((torch)) && grep -ho 'impl=torch world=[0-9]* threads_per_rank=[0-9]*' "${logs_t[@]}" | head -1 | grep -o '[0-9]*$' || true)
            sa=$(timed wall "${logs_a[@]}" | stats)
            st=$( ((torch)) && timed wall "${logs_t[@]}" | stats || echo -)
            ma=$(timed wall "${logs_a[@]}" | median)
            mt=$( ((torch)) && timed wall "${logs_t[@]}" | median || true)
            ratio=$(awk -v a="$ma" -v b="$mt" 'BEGIN { if (a == "" || b == "" || b == 0) print "-"; else printf "%.2f", a / b }')
            mem_t=$( ((torch)) && memory "${logs_t[@]}" || echo -)
            printf '%-8s %-2s %-4s %-8s %-24s %-24s %-6s %-13s %-13s%s\n' "$c" "$w" "$r" "${thr_a:--}/${thr_t:--}" "$sa" \
                "$st" "$ratio" "$(memory "${logs_a[@]}")" "$mem_t" "$notes"
            ph=""
            for key in fwd bwd opt; do ph+=" $(timed "$key" "${logs_a[@]}" | median)"; done
            ph+=" |"
            for key in fwd bwd opt; do ph+=" $( ((torch)) && timed "$key" "${logs_t[@]}" | median || true)"; done
            phases+=("$(printf '%-8s %-2s %-4s' "$c" "$w" "$r") $(awk '{ for (i = 1; i <= NF; i++) printf "%s ", ($i == "|" ? "|" : sprintf("%7.3f", $i)) }' <<<"$ph")")
        done
    done
done
echo
echo "== phases, s (medians): forward, backward, optimizer step; allgrad | PyTorch"
printf '%-8s %-2s %-4s %7s %7s %7s | %7s %7s %7s\n' C W r fwd bwd opt fwd bwd opt
for p in "${phases[@]}"; do echo "$p"; done
echo "(threads: allgrad rayon/candle per rank / torch per rank; samples/s = 512 / step time)"
read -r load1 load5 load15 _ </proc/loadavg
echo "load average after: $load1 $load5 $load15 (includes this benchmark's own processes)"
if ((failed)); then
    echo "CHECK FAILED: the two implementations disagree (see above)"
    exit 1
fi
