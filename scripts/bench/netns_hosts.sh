# Simulated hosts on this machine, for the benchmarks that span several: K network namespaces
# <prefix>0 .. <prefix>K-1, each with its loopback and one veth interface into a bridge that
# lies in a namespace of its own (<prefix>br), so that nothing is added to this machine's own
# network. Host k has the address <net>.(k+1)/24 on the bridge. A launcher run under
# `ip netns exec <prefix>k` is then a host: its ranks reach each other over that namespace's
# loopback and the other hosts only through the bridge; and since `ip netns exec` gives each
# command a mount namespace of its own, allgrad's groups see the hosts as different ones and
# use shared memory only inside a host (`cpu/shm/setup.rs`). Needs root.
#
# Sourced (not run) by bench_two_hosts.sh and bench_scale_ranks.sh:
#
#   . scripts/bench/netns_hosts.sh
#   hosts_up K PREFIX NET          # NET: the first three numbers, e.g. 10.231.0
#   hosts_shape RATE DELAY         # optional: each host's outgoing traffic limited and delayed
#   ... "${HOSTS_NS[k]}" "${HOSTS_IP[k]}" "${HOSTS_DEV[k]}" ...
#   hosts_down                     # also on EXIT: hosts_up sets the trap
#
# hosts_shape sets HOSTS_SHAPE to what it did (netem delay and rate, or tbf rate where the kernel
# has no sch_netem). Names are kept short: an interface name has at most 15 characters.
# shellcheck shell=bash

HOSTS_NS=()
HOSTS_IP=()
HOSTS_DEV=()
HOSTS_BRIDGE_NS=""
HOSTS_SHAPE="none"

hosts_down() {
    local ns
    # Deleting a namespace deletes the veth end inside it, and with it the pair.
    for ns in "${HOSTS_NS[@]}" "$HOSTS_BRIDGE_NS"; do
        [[ -n "$ns" ]] && ip netns del "$ns" 2>/dev/null || true
    done
    HOSTS_NS=()
    HOSTS_IP=()
    HOSTS_DEV=()
    HOSTS_BRIDGE_NS=""
}

hosts_up() { # K PREFIX NET
    local k="$1" prefix="$2" net="$3" i ns
    if [[ "$(id -u)" != 0 ]]; then
        echo "netns_hosts.sh: network namespaces need root" >&2
        return 1
    fi
    if (( k < 1 || k > 250 )) || (( ${#prefix} > 9 )); then
        echo "netns_hosts.sh: between 1 and 250 hosts, and a prefix of at most 9 characters (got $k, '$prefix')" >&2
        return 1
    fi
    HOSTS_BRIDGE_NS="${prefix}br"
    for (( i = 0; i < k; i++ )); do
        HOSTS_NS+=("${prefix}${i}")
        HOSTS_IP+=("${net}.$(( i + 1 ))")
        HOSTS_DEV+=("${prefix}h${i}")
    done
    trap hosts_down EXIT
    # Left over from an earlier run that was killed before its cleanup.
    for ns in "${HOSTS_NS[@]}" "$HOSTS_BRIDGE_NS"; do ip netns del "$ns" 2>/dev/null || true; done
    ip netns add "$HOSTS_BRIDGE_NS"
    ip -n "$HOSTS_BRIDGE_NS" link add br0 type bridge
    ip -n "$HOSTS_BRIDGE_NS" link set br0 up
    for (( i = 0; i < k; i++ )); do
        local ns="${HOSTS_NS[$i]}" dev="${HOSTS_DEV[$i]}" port="${prefix}b${i}"
        ip netns add "$ns"
        ip link add "$dev" type veth peer name "$port"
        ip link set "$dev" netns "$ns"
        ip link set "$port" netns "$HOSTS_BRIDGE_NS"
        ip -n "$HOSTS_BRIDGE_NS" link set "$port" master br0
        ip -n "$HOSTS_BRIDGE_NS" link set "$port" up
        ip -n "$ns" addr add "${HOSTS_IP[$i]}/24" dev "$dev"
        ip -n "$ns" link set "$dev" up
        ip -n "$ns" link set lo up
    done
}

hosts_shape() { # RATE DELAY
    local rate="$1" delay="$2" i
    for (( i = 0; i < ${#HOSTS_NS[@]}; i++ )); do
        if ip netns exec "${HOSTS_NS[$i]}" tc qdisc add dev "${HOSTS_DEV[$i]}" root netem delay "$delay" rate "$rate" 2>/dev/null; then
            HOSTS_SHAPE="netem delay $delay rate $rate"
        else
            ip netns exec "${HOSTS_NS[$i]}" tc qdisc add dev "${HOSTS_DEV[$i]}" root tbf rate "$rate" burst 256kb latency 100ms
            HOSTS_SHAPE="tbf rate $rate (this kernel has no sch_netem: no added delay)"
        fi
    done
}
