# Network namespaces for the chaos test's --netns variant (sourced by chaos.sh,
# after tests/integration/lib.sh).  Needs root and iproute2.
#
# Topology: a "switch" namespace holds a bridge; the coordinator stays in the
# calling namespace on 10.231.NET.1, linked to the bridge by a veth pair; worker
# i runs in its own namespace on 10.231.NET.(10+i), linked the same way.  The
# bridge lives in its own namespace so that the host's packet filter (bridged
# traffic may pass the host's iptables) never sees the cluster's traffic.
# Cutting a link sets the switch's end of its veth down: the far end loses its
# carrier and every packet is dropped, as when a cable is pulled; TCP
# connections are not reset, they stall until the link comes back.
#
# The CLI keeps using the coordinator's control endpoint on loopback, so the
# test's own view of the cluster is never cut.

NET=$(( $$ % 200 + 20 ))          # one /24 and one name prefix per run
NET_PREFIX="tsr$NET"
NS_SW="$NET_PREFIX-sw"
NET_COORD="10.231.$NET.1"

net_ns() { echo "$NET_PREFIX-w$1"; }          # worker i's namespace
net_addr() { echo "10.231.$NET.$(( 10 + $1 ))"; }

# net_down: removes everything net_up made (safe to call twice).
net_down() {
    local n
    for n in $(ip netns list 2>/dev/null | awk '{print $1}'); do
        case "$n" in "$NET_PREFIX"-*) ip netns del "$n" 2>/dev/null ;; esac
    done
    ip link del "${NET_PREFIX}c" 2>/dev/null
    return 0
}

# net_up N: the switch and N worker namespaces.
net_up() {
    local n=$1 i ns
    [ "$(id -u)" = 0 ] || { echo "FAIL: the --netns variant needs root (ip netns)"; exit 1; }
    command -v ip > /dev/null || { echo "FAIL: the --netns variant needs iproute2 (ip)"; exit 1; }
    net_down
    ip netns add "$NS_SW" || { echo "FAIL: cannot create a network namespace"; exit 1; }
    ip -n "$NS_SW" link set lo up
    ip -n "$NS_SW" link add br0 type bridge || { echo "FAIL: cannot create a bridge"; exit 1; }
    ip -n "$NS_SW" link set br0 up
    ip link add "${NET_PREFIX}c" type veth peer name c netns "$NS_SW" \
        || { echo "FAIL: cannot create a veth pair"; exit 1; }
    ip addr add "$NET_COORD/24" dev "${NET_PREFIX}c"
    ip link set "${NET_PREFIX}c" up
    ip -n "$NS_SW" link set c master br0
    ip -n "$NS_SW" link set c up
    for i in $(seq 0 $((n - 1))); do
        ns=$(net_ns "$i")
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        ip -n "$NS_SW" link add "w$i" type veth peer name eth0 netns "$ns"
        ip -n "$NS_SW" link set "w$i" master br0
        ip -n "$NS_SW" link set "w$i" up
        ip -n "$ns" addr add "$(net_addr "$i")/24" dev eth0
        ip -n "$ns" link set eth0 up
    done
}

# net_cut PORT / net_restore PORT: PORT is "w$i" (worker i) or "c" (the coordinator).
net_cut() { ip -n "$NS_SW" link set "$1" down; }
net_restore() { ip -n "$NS_SW" link set "$1" up; }

# start_worker_ns I NAME: worker NAME in worker i's namespace (pid in WPID[NAME]).
start_worker_ns() {
    local i=$1 name=$2
    [ -e "$KEYS/$name.key" ] || "$BIN/tessera" keys add "$KEYS" "$name" > /dev/null \
        || fail "cannot add a key for $name"
    ip netns exec "$(net_ns "$i")" "$BIN/tessera-worker" --coordinator "$WEP" --name "$name" \
        --data-address "$(net_addr "$i")" >> "$T/$name.log" 2>&1 &
    WPID[$name]=$!
    PIDS+=("$!")
}
