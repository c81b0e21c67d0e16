#!/usr/bin/env bash
# allgrad's collectives next to PyTorch gloo's across two "hosts" on this machine: two network
# namespaces joined by a bridge (scripts/bench/netns_hosts.sh), 2 ranks in each
# (`launch --nnodes 2`), each host's outgoing traffic limited to RATE with tbf and, where the
# kernel has sch_netem, delayed by DELAY. Needs root.
#
#   sudo scripts/bench/bench_two_hosts.sh [--min-bytes 64K] [--max-bytes 64M] [--ops all_reduce] ...
#
# RATE (default 1gbit), DELAY (default 1ms), PYTHON (default python3, needs torch for gloo),
# BENCH_OUT (folder for the JSON lines). The arguments go to both benchmarks. Prints the load
# average first: figures taken while something else runs are not comparable.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
RATE="${RATE:-1gbit}"
DELAY="${DELAY:-1ms}"
OUT="${BENCH_OUT:-$(mktemp -d "${TMPDIR:-/tmp}/allgrad-two-hosts.XXXXXX")}"
mkdir -p "$OUT"
[[ "$(id -u)" == 0 ]] || { echo "bench_two_hosts.sh: needs root (network namespaces)" >&2; exit 1; }

(cd "$ROOT" && cargo build --release -p allgrad -p allgrad-bench --bin launch --bin bench_collectives)
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release"

# shellcheck source=scripts/bench/netns_hosts.sh
. "$ROOT/scripts/bench/netns_hosts.sh"
hosts_up 2 agbench 10.231.0
hosts_shape "$RATE" "$DELAY"
NS=("${HOSTS_NS[@]}")
DEV=("${HOSTS_DEV[@]}")
IPS=("${HOSTS_IP[@]}")
echo "link: two namespaces joined by a bridge, each sending through $HOSTS_SHAPE; load average: $(cut -d' ' -f1-3 /proc/loadavg)"

# Runs "$@" as a 2-node job, 2 ranks per node, one node per namespace.
two_nodes() {
    local port=$((20000 + RANDOM % 20000))
    export ALLGRAD_JOB_TOKEN="bench-two-hosts-$$"
    GLOO_SOCKET_IFNAME="${DEV[1]}" ip netns exec "${NS[1]}" "$BIN/launch" --nnodes 2 --node-rank 1 --nproc-per-node 2 \
        --master-addr "${IPS[0]}" --master-port "$port" --ranks-filter 0 "$@" &
    local other=$!
    GLOO_SOCKET_IFNAME="${DEV[0]}" ip netns exec "${NS[0]}" "$BIN/launch" --nnodes 2 --node-rank 0 --nproc-per-node 2 \
        --master-addr "${IPS[0]}" --master-port "$port" --ranks-filter 0 "$@"
    wait "$other"
}

echo "== allgrad"
two_nodes "$BIN/bench_collectives" "$@" --json "$OUT/allgrad.jsonl"
GLOO=0
if "$PYTHON" -c "import torch, torch.distributed" >/dev/null 2>&1; then
    echo "== PyTorch gloo"
    two_nodes "$(command -v "$PYTHON")" "$ROOT/scripts/bench/bench_gloo.py" "$@" --json "$OUT/gloo.jsonl"
    GLOO=1
else
    echo "== PyTorch is not importable with $PYTHON: skipping the gloo baseline"
fi
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
"$PYTHON" "$ROOT/scripts/bench/bench_table.py" "$OUT/allgrad.jsonl" "$OUT/gloo.jsonl" "$GLOO"
echo "(JSON lines in $OUT)"
