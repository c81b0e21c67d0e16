#!/usr/bin/env bash
# allgrad's collectives next to PyTorch gloo's across two "hosts" on this machine: two network
# namespaces joined by a veth pair, 2 ranks in each (`launch --nnodes 2`), the link limited to
# RATE with tbf and, where the kernel has sch_netem, delayed by DELAY each way. Needs root.
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

NS=(agbench-a agbench-b)
DEV=(agbench-va agbench-vb)
IPS=(10.231.0.1 10.231.0.2)
cleanup() { for ns in "${NS[@]}"; do ip netns del "$ns" 2>/dev/null || true; done; }
trap cleanup EXIT
cleanup
ip netns add "${NS[0]}"
ip netns add "${NS[1]}"
ip link add "${DEV[0]}" type veth peer name "${DEV[1]}"
SHAPE="rate $RATE"
for i in 0 1; do
    ip link set "${DEV[$i]}" netns "${NS[$i]}"
    ip -n "${NS[$i]}" addr add "${IPS[$i]}/24" dev "${DEV[$i]}"
    ip -n "${NS[$i]}" link set "${DEV[$i]}" up
    ip -n "${NS[$i]}" link set lo up
    if ip netns exec "${NS[$i]}" tc qdisc add dev "${DEV[$i]}" root netem delay "$DELAY" rate "$RATE" 2>/dev/null; then
        SHAPE="netem delay $DELAY rate $RATE"
    else
        ip netns exec "${NS[$i]}" tc qdisc add dev "${DEV[$i]}" root tbf rate "$RATE" burst 256kb latency 100ms
        SHAPE="tbf rate $RATE (this kernel has no sch_netem: no added delay)"
    fi
done
echo "link: veth between two namespaces, $SHAPE; load average: $(cut -d' ' -f1-3 /proc/loadavg)"

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
