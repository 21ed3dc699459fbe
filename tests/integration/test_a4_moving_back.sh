# (a4) moving back with real daemons: tp 2 x 2 replicas on nodes a (w0 w1), b (w2 w3)
# and a spare on c (w4), rebalance_interval_s 8, clients streaming throughout.  A
# kill -9 of w1 puts its piece on w4, so a group spans a and c; when w1 comes back on
# a, it loads the piece as a standby and the group is on node a again well within
# rebalance_interval_s, with w4 idle again; no request fails and the streams' tokens
# are the reference's.
source "$(dirname "$0")/lib.sh"
{ coordinator_yaml "rebalance_interval_s: 8"; cat <<YAML
deployments:
  - name: tiny
    model: $MODEL
    parallel: {tensor: 2, pipeline: 1, replicas: 2}
    max_seq_len: 256
YAML
} > "$T/d.yaml"
start_coord "$T/d.yaml"
start_worker w0 --node a; start_worker w1 --node a
start_worker w2 --node b; start_worker w3 --node b
start_worker w4 --node c
wait_until 15 all_ready || fail "not ready: $(tsr status 2>&1)"
spans() { status_json | jget "d['deployments'][0]['tp_groups_spanning_nodes']"; }
[ "$(spans)" = 0 ] || fail "a group spans nodes from the start: $(tsr status)"

CLIENTS=()
for k in 3 4 5; do stream_client "$k" 100 & CLIENTS+=("$!"); PIDS+=("$!"); done

kill -9 "${WPID[w1]}"
spanning() { [ "$(spans)" = 1 ] && all_ready; }
wait_until 15 spanning || fail "w4 did not take w1's piece: $(tsr status 2>&1)"
tsr status | grep -q "warning: .*spans" || fail "the span is not shown: $(tsr status)"
start_worker w1 --node a
back_at=$(now_ms)
home() { [ "$(spans)" = 0 ] && all_ready && [ "$(worker_field w1 state)" = ready ] &&
         [ "$(worker_field w4 state)" = idle ]; }
wait_until 8 home || fail "the group is not back on node a within 8 s: $(tsr status 2>&1)"
took=$(( $(now_ms) - back_at ))
status_json | jget "d['coordinator']['rebalance']['last']" | grep -q "moved tiny r.* from w4 (node c) to w1 (node a)" ||
    fail "rebalance: $(status_json | jget "d['coordinator']['rebalance']")"
grep -q "rebalance: moving tiny .*w1 loads its weights" "$T/coordinator.log" || fail "no standby logged"
clients_done_with_reference 100 3 5
ok "a group left across nodes by kill -9 moved back to node a $took ms after w1 returned (standby first), nothing failed"
