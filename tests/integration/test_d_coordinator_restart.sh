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

# A coordinator that comes back with another collective_timeout_ms (an
# upgrade whose default changed, or the file edited while it was down)
# adopts the pieces all the same, then rewires the replica with the file's
# value once every member is back: a new epoch, the same placement, and no
# weights loaded again (each worker's engine is made once).
sed -i 's/^    max_seq_len: 256$/    max_seq_len: 256\n    collective_timeout_ms: 20000/' "$T/d.yaml"
grep -q "collective_timeout_ms: 20000" "$T/d.yaml" || fail "could not edit the file"
epoch_before=$(status_json | jget "d['coordinator']['epoch']")
kill -9 "$COORD_PID"; wait "$COORD_PID" 2>/dev/null
start_coord "$T/d.yaml"
names() { status_json | jget "sorted((w['name'], w['assignment'] and [w['assignment'][k] for k in ('deployment','replica','stage','tp')]) for w in d['workers'])"; }
rewired() {
    all_ready && [ "$(status_json | jget "d['deployments'][0]['collective_timeout_ms'] == 20000 and min(r['epoch'] for s in d['deployments'][0]['replica_list'][0]['stages'] for r in s['ranks']) > $epoch_before")" = true ]
}
wait_until 10 rewired || fail "the replica was not rewired with the new collective_timeout_ms: $(status_json | head -c 600)"
[ "$(names)" = "$(echo "$before" | python3 -c 'import json,sys; print(json.dumps(sorted((n, a and a[:4]) for n, a in json.load(sys.stdin))))')" ] ||
    fail "pieces moved: $(names)"
for i in 0 1 2 3 4; do
    n=$(grep -c "cpu engine: " "$T/w$i.log")
    [ "$n" -le 1 ] || fail "w$i loaded its weights $n times"
done
grep -q "not adopted" "$T/coordinator.log" && fail "a piece was not adopted: $(grep 'not adopted' "$T/coordinator.log" | head -1)"
ok "with collective_timeout_ms changed meanwhile: adopted, rewired in a new epoch with the file's value, no weights reloaded"

# During the adoption grace the status says so, and the epoch it shows is
# the adopted one (none adopted yet: no plan, not "epoch 0").
epoch_before=$(status_json | jget "d['coordinator']['epoch']")
kill -9 "$COORD_PID"; wait "$COORD_PID" 2>/dev/null
start_coord "$T/d.yaml" --adopt-grace-ms 4000
answers() { tsr status > "$T/st.txt" 2>&1; }
wait_until 2 answers || fail "the restarted coordinator does not answer: $(cat "$T/st.txt")"
head -1 "$T/st.txt" | grep -Eq "adopting workers \(grace [0-9.]+ s left\)" ||
    fail "status during the grace does not say it is adopting workers: $(head -1 "$T/st.txt")"
head -1 "$T/st.txt" | grep -q "epoch 0 " && fail "status during the grace shows epoch 0: $(head -1 "$T/st.txt")"
wait_until 3 all_ready || fail "not ready again during the grace"
tsr status > "$T/st.txt" 2>&1
head -1 "$T/st.txt" | grep -Eq "epoch $epoch_before .*adopting workers|adopting workers.*epoch $epoch_before " ||
    fail "status with every piece adopted does not show the adopted epoch $epoch_before during the grace: $(head -1 "$T/st.txt")"
[ "$(status_json | jget "d['coordinator']['grace_left_ms'] > 0")" = true ] ||
    fail "status --json gives no grace_left_ms during the grace"
graced() { [ "$(status_json | jget "d['coordinator']['planning']")" = true ]; }
wait_until 6 graced || fail "the grace never ended"
tsr status | head -1 | grep -q "adopting" && fail "status still says adopting after the grace: $(tsr status | head -1)"
ok "during the adoption grace status says so, with the adopted epoch"
