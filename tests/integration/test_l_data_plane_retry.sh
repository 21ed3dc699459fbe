# A replica whose data plane breaks without any worker dying (here: its TCP
# connections are torn down, as a network blip would) reports the failure,
# is rewired after a backoff and serves the same tokens again, without an
# operator and without any worker being declared dead.
source "$(dirname "$0")/lib.sh"
command -v ss > /dev/null || fail "ss (iproute2) is needed"
write_yaml "$T/d.yaml" 2 1 1
start_coord "$T/d.yaml"
for i in 0 1; do start_worker "w$i"; done
wait_until 15 all_ready || fail "not ready"
before=$(tsr generate tiny --prompt-ids 5,6,7 --max-tokens 8 --ids) || fail "generate failed"
leader=$(piece_holder 0 0 0)
port=$(worker_field "$leader" data_endpoint | sed 's/.*://')
[ -n "$port" ] || fail "no data endpoint in status"
ss -K "( sport = :$port or dport = :$port )" > /dev/null 2>&1 || fail "ss -K failed"
failed_seen() { grep -q "data plane failed" "$T/coordinator.log"; }
wait_until 5 failed_seen || fail "no data-plane failure reported: $(tail -5 "$T/coordinator.log")"
grep -q "rewiring in 2000 ms" "$T/coordinator.log" || fail "no retry scheduled"
serves() {
    all_ready || return 1
    local g; g=$(tsr generate tiny --prompt-ids 5,6,7 --max-tokens 8 --ids 2>/dev/null) || return 1
    [ "$g" = "$before" ]
}
wait_until 15 serves || fail "the replica did not recover: $(tsr status 2>&1 | head -12)"
[ "$(status_json | jget "d['coordinator']['stats']['deaths']")" = 0 ] || fail "a worker was declared dead"
ok "torn connections broke the data plane; the replica was rewired and serves the same tokens"
