# (a3) replicas that follow load, with real daemons: replicas {min 1, max 3} on
# four workers with coordinator.reserve_spares 1.  Six clients each sending
# their next request as the last ends queue at one replica of max_batch 1; the
# coordinator adds replicas until three serve (the fourth worker stays a spare),
# and after the load stops drains and removes them back to one.  No request
# fails, the streams' tokens are the reference's, status and the CLI say why.
# scale_up_queue_ms is low (10) because a fast core serves the tiny model's
# 120-token requests in about 10 ms: with 40, two replicas' queue waits
# (about twice that) stayed under it on a Zen 5 VM and the third never came.
source "$(dirname "$0")/lib.sh"
{ coordinator_yaml "reserve_spares: 1"; cat <<YAML
deployments:
  - name: tiny
    model: $MODEL
    parallel:
      replicas: {min: 1, max: 3}
    max_seq_len: 256
    max_batch: 1
    scale_up_queue_ms: 10
    scale_up_window_s: 1
    scale_down_idle_s: 2
YAML
} > "$T/d.yaml"
start_coord "$T/d.yaml"
for i in 0 1 2 3; do start_worker "w$i"; done
replicas() { status_json | jget "d['deployments'][0]['replicas']"; }
auto() { status_json | jget "d['deployments'][0]['autoscale']['$1']"; }
ready_at() { [ "$(replicas)" = "$1" ] && all_ready; }
wait_until 15 ready_at 1 || fail "not one ready replica within 15 s: $(tsr status 2>&1)"

CLIENTS=()
for k in 3 4 5 6 7 8; do stream_client "$k" 120 & CLIENTS+=("$!"); PIDS+=("$!"); done
wait_until 40 ready_at 3 || fail "replicas did not grow to 3 under load: $(tsr status 2>&1)"
[ "$(status_json | jget "len(d['idle'])")" = 1 ] || fail "the spare was taken: $(tsr status)"
[ "$(auto ups)" -ge 2 ] || fail "ups: $(auto ups)"
auto last | grep -q "above scale_up_queue_ms 10" || fail "no reason: $(auto last)"
tsr status | grep -q "replicas follow load: 3 in 1..3" || fail "tessera status: $(tsr status)"
clients_done_with_reference 120 3 6
wait_until 30 ready_at 1 || fail "replicas did not shrink back to 1: $(tsr status 2>&1)"
[ "$(auto downs)" -ge 2 ] || fail "downs: $(auto downs)"
auto last | grep -q "scale_down_idle_s" || fail "no reason: $(auto last)"
grep -q "draining replica 1 to remove it" "$T/coordinator.log" || fail "no drain logged"
expect_reference_tokens
ok "replicas followed load: 1 -> 3 under 6 streams (a spare kept), back to 1 after, nothing failed"
