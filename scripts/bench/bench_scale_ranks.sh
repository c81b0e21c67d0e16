#!/usr/bin/env bash
# allgrad's control plane at W ranks (processes) on this one machine, beside PyTorch gloo.
#
#   scripts/bench/bench_scale_ranks.sh [--sizes 8,32,128,256,512,1024] [--nnodes 1[,2,4,8]] [--netns] \
#       [--iters 20] [--time-limit-s 600] [--no-gloo] [--no-kill] [--start-only]
#
# For each K of --nnodes and each W: `bench_scale_ranks` (the start of the W processes, first
# to last, and the group's formation after the last start, apart; 4-byte and 1 MiB all_reduce
# and all_gather, frames per call, open fds, threads and memory per rank, time for the survivors
# to name a SIGKILLed rank), then, for K = 1, the same with gloo through torchrun
# (scripts/bench/bench_scale_gloo.py) when torch is importable. K > 1 runs allgrad's ranks under
# K launchers, W/K ranks each, as K simulated hosts: with --netns (root) each in a network
# namespace of its own joined by a bridge (scripts/bench/netns_hosts.sh), shared memory inside a
# host and TCP between hosts, each node's own group measured too and the survivors naming the
# killed rank counted per host; without it all on one loopback with ALLGRAD_SHM=0 (TCP between
# every pair of ranks). Each job is stopped at --time-limit-s; a W whose estimated memory exceeds
# what the machine has available is skipped, with the estimate printed. The machine's limits
# are printed first. --start-only: the ranks note when they were forked and started and exit
# without joining (the cost of starting W processes through the launcher alone; no gloo).
# Rows go to $BENCH_OUT/scale.jsonl (default: a new temporary folder).
# ALLGRAD_BENCH_BIN names a prebuilt bench_scale_ranks; TORCHRUN and PYTHON name gloo's
# (default: those of ~/.cache/allgrad/torch-2.15.0, as scripts/ci/get_torch.sh installs them).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SIZES="8,32,128,256,512,1024"
NNODES=1
NETNS=0
ITERS=20
LIMIT=600
GLOO=1
KILL=()
START_ONLY=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --sizes) SIZES="$2"; shift 2 ;;
        --nnodes) NNODES="$2"; shift 2 ;;
        --netns) NETNS=1; shift ;;
        --iters) ITERS="$2"; shift 2 ;;
        --time-limit-s) LIMIT="$2"; shift 2 ;;
        --no-gloo) GLOO=0; shift ;;
        --no-kill) KILL=(--no-kill); shift ;;
        --start-only) START_ONLY=(--start-only); GLOO=0; shift ;;
        -h|--help) sed -n '2,23p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "bench_scale_ranks.sh: unknown argument $1" >&2; exit 64 ;;
    esac
done
OUT="${BENCH_OUT:-$(mktemp -d "${TMPDIR:-/tmp}/allgrad-scale.XXXXXX")}"
mkdir -p "$OUT"

TORCH_VENV="${HOME}/.cache/allgrad/torch-2.15.0"
TORCHRUN="${TORCHRUN:-$TORCH_VENV/bin/torchrun}"
PYTHON="${PYTHON:-$TORCH_VENV/bin/python}"

sysctl_of() { cat "/proc/sys/$1" 2>/dev/null | tr '\t' ' ' || echo "?"; }
mem_kb() { awk -v k="$1:" '$1 == k { print $2 }' /proc/meminfo; }

echo "== machine"
echo "   cores $(nproc); memory $(( $(mem_kb MemTotal) / 1024 )) MiB, available $(( $(mem_kb MemAvailable) / 1024 )) MiB; load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "   ulimit -n $(ulimit -Sn) (hard $(ulimit -Hn)); ulimit -u $(ulimit -Su); fs.file-max $(sysctl_of fs/file-max); fs.nr_open $(sysctl_of fs/nr_open)"
echo "   net.ipv4.ip_local_port_range $(sysctl_of net/ipv4/ip_local_port_range); net.core.somaxconn $(sysctl_of net/core/somaxconn); tcp_max_syn_backlog $(sysctl_of net/ipv4/tcp_max_syn_backlog)"
echo "   kernel.pid_max $(sysctl_of kernel/pid_max); kernel.threads-max $(sysctl_of kernel/threads-max); $(uname -sr)"
echo "   (the figures below are this machine's only if the load average above is near 0)"

if [[ -n "${ALLGRAD_BENCH_BIN:-}" ]]; then
    BIN="$ALLGRAD_BENCH_BIN"
else
    (cd "$ROOT" && cargo build --release --workspace --bin bench_scale_ranks)
    BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release/bench_scale_ranks"
fi
[[ -x "$BIN" ]] || { echo "bench_scale_ranks.sh: no bench_scale_ranks binary at $BIN" >&2; exit 1; }

HAVE_TORCH=0
if [[ "$GLOO" == 1 ]]; then
    if [[ -x "$TORCHRUN" ]] && "$PYTHON" -c "import torch.distributed" >/dev/null 2>&1; then
        HAVE_TORCH=1
    else
        echo "== gloo: no torchrun at $TORCHRUN with torch importable by $PYTHON (scripts/ci/get_torch.sh installs them): allgrad only"
    fi
fi

# Memory per rank (MiB) of the previous W, to estimate the next (defaults before any).
RANK_MB=16
GLOO_MB=300
estimate_ok() { # name W per_rank_MiB
    local need=$(( $2 * $3 )) avail=$(( $(mem_kb MemAvailable) / 1024 ))
    if (( need * 5 / 4 > avail )); then
        echo "== $1, W = $2: skipped: about $need MiB needed ($2 ranks x $3 MiB, from the previous W), $avail MiB available"
        return 1
    fi
}
last_uss_mb() { # jsonl file -> max USS of its last row in MiB (or nothing)
    "$PYTHON" - "$1" <<'EOF' 2>/dev/null || true
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
if rows and "uss_kb_max" in rows[-1]:
    print(int(rows[-1]["uss_kb_max"] / 1024) + 1)
EOF
}

if [[ "$NETNS" == 1 ]]; then
    [[ "$(id -u)" == 0 ]] || { echo "bench_scale_ranks.sh: --netns needs root (network namespaces)" >&2; exit 1; }
    # shellcheck source=scripts/bench/netns_hosts.sh
    . "$ROOT/scripts/bench/netns_hosts.sh"
fi

IFS=',' read -r -a WS <<< "$SIZES"
IFS=',' read -r -a KS <<< "$NNODES"
for K in "${KS[@]}"; do
    HOSTS=()
    if [[ "$NETNS" == 1 && "$K" -gt 1 ]]; then
        hosts_up "$K" agscale 10.232.0
        HOSTS=(--node-netns "$(IFS=,; echo "${HOSTS_NS[*]}")" --master-addr "${HOSTS_IP[0]}")
        echo
        echo "== $K simulated hosts: network namespaces ${HOSTS_NS[*]} joined by a bridge, rank 0's store on ${HOSTS_IP[0]}"
        echo "   in each: somaxconn $(ip netns exec "${HOSTS_NS[0]}" cat /proc/sys/net/core/somaxconn), tcp_max_syn_backlog $(ip netns exec "${HOSTS_NS[0]}" cat /proc/sys/net/ipv4/tcp_max_syn_backlog), ip_local_port_range $(ip netns exec "${HOSTS_NS[0]}" cat /proc/sys/net/ipv4/ip_local_port_range | tr '\t' ' ')"
    fi
    for W in "${WS[@]}"; do
        echo
        if (( W % K != 0 )); then
            echo "== W = $W: skipped, not a multiple of $K nodes"
            continue
        fi
        # allgrad: ranks plus the kernel's sockets, up to about 8 KiB for each of the W - 1 per rank.
        PER=$(( RANK_MB + (W * 8) / 1024 + 1 ))
        if estimate_ok allgrad "$W" "$PER"; then
            "$BIN" --nproc "$W" --nnodes "$K" "${HOSTS[@]}" --iters "$ITERS" --time-limit-s "$LIMIT" "${KILL[@]}" "${START_ONLY[@]}" \
                --json "$OUT/scale.jsonl" --out "$OUT/allgrad-$K-$W" 2> >(tail -n 20 >&2) || echo "   (harness exited with $?)"
            M=$(last_uss_mb "$OUT/scale.jsonl"); [[ -n "$M" ]] && RANK_MB=$M
        fi
        if [[ "$HAVE_TORCH" == 1 && "$K" == 1 ]] && estimate_ok gloo "$W" "$GLOO_MB"; then
            D="$OUT/gloo-$W"; rm -rf "$D"; mkdir -p "$D"
            T0=$(date +%s%N)
            set +e
            ALLGRAD_SCALE_T0_NS=$T0 OMP_NUM_THREADS=1 timeout --kill-after=10 "$LIMIT" "$TORCHRUN" --nproc-per-node "$W" \
                --master-port "$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')" \
                "$ROOT/scripts/bench/bench_scale_gloo.py" --out "$D" --iters "$ITERS" "${KILL[@]}" >"$D/torchrun.log" 2>&1
            RC=$?
            set -e
            (( RC == 124 || RC == 137 )) && echo "   (gloo: TIME LIMIT of $LIMIT s hit)"
            "$PYTHON" "$ROOT/scripts/bench/bench_scale_gloo.py" --summarise "$D" --nproc "$W" "${KILL[@]}"
            G=$("$PYTHON" -c "
import os,sys
v=[int(l.split()[1]) for r in range($W) for l in open(os.path.join('$D',f'rank-{r}.txt')) if l.startswith('uss_kb ')] if os.path.exists('$D/rank-0.txt') else []
print(max(v)//1024+1 if v else '')" 2>/dev/null || true)
            [[ -n "$G" ]] && GLOO_MB=$G
        fi
    done
    if [[ "$NETNS" == 1 && "$K" -gt 1 ]]; then hosts_down; fi
done
echo
echo "(rows: $OUT/scale.jsonl; reports per rank under $OUT)"
