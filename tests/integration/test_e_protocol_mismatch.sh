# (e) A worker speaking another protocol version is refused, with a message
# in both logs, and exits with status 2 (do not restart).
source "$(dirname "$0")/lib.sh"
write_yaml "$T/d.yaml" 1 1 1
start_coord "$T/d.yaml"
start_worker good
start_worker old --protocol-version 99
wait_until 10 all_ready || fail "good worker did not serve"
wait "${WPID[old]}"; rc=$?
[ "$rc" = 2 ] || fail "mismatched worker exited $rc, expected 2"
grep -q "refused worker old.*protocol version 99.*speaks version 2" "$T/coordinator.log" || fail "coordinator log lacks the refusal"
grep -q "refused registration: protocol version 99" "$T/old.log" || fail "worker log lacks the refusal"
[ "$(status_json | jget "[w['name'] for w in d['workers']]")" = '["good"]' ] || fail "refused worker was registered"
[ "$(status_json | jget "d['coordinator']['stats']['refused']")" = 1 ] || fail "refusal not counted"
ok "protocol 99 refused in both logs: $(grep -o 'refused registration.*' "$T/old.log" | head -c 120)"
