# (d) kill -9 the coordinator and restart it: the workers re-attach with their
# pieces, nothing is reshuffled, and status is complete within 2 s.
source "$(dirname "$0")/lib.sh"
write_yaml "$T/d.yaml" 2 2 1
start_coord "$T/d.yaml"
for i in 0 1 2 3 4; do start_worker "w$i"; done
wait_until 10 all_ready || fail "not ready"
placement() { status_json | jget "sorted((w['name'], w['assignment'] and [w['assignment'][k] for k in ('deployment','replica','stage','tp','epoch')]) for w in d['workers'])"; }
before=$(placement)
epoch_before=$(status_json | jget "d['coordinator']['epoch']")
kill -9 "$COORD_PID"; wait "$COORD_PID" 2>/dev/null
start_coord "$T/d.yaml"; t0=$(now_ms)
complete() { all_ready && [ "$(placement)" = "$before" ]; }
wait_until 4 complete || fail "not complete after restart: before $before, now $(placement)"
took=$(( $(now_ms) - t0 ))
echo "status complete $took ms after restart"
[ "$took" -le 2000 ] || fail "took $took ms > 2000"
# Once the adoption grace is over and the planner has run, it has moved
# nothing.
planned() { [ "$(status_json | jget "d['coordinator']['planning'] and d['coordinator']['stats']['plans'] >= 1")" = true ]; }
wait_until 5 planned || fail "the new coordinator never planned"
[ "$(placement)" = "$before" ] || fail "pieces were reshuffled: $(placement)"
[ "$(status_json | jget "d['coordinator']['stats']['assigns']")" = 0 ] || fail "the new coordinator sent assignments"
[ "$(status_json | jget "d['coordinator']['epoch'] >= $epoch_before")" = true ] || fail "epoch went backwards"
grep -q "adopted worker" "$T/coordinator.log" || fail "no adoption logged"
ok "re-attached in $took ms with the same placement"
