# A peer killed while a request is running: the request is not lost.  The
# coordinator resumes it, from its prompt and the tokens already delivered,
# once the spare is wired in; the client sees one stream with no gap or
# repeat, and its tokens are the reference's.
source "$(dirname "$0")/lib.sh"
write_yaml "$T/d.yaml" 2 2 1
start_coord "$T/d.yaml"
for i in 0 1 2 3 4; do start_worker "w$i"; done
wait_until 15 all_ready || fail "not ready"
ref=$(python3 "$ROOT/tests/reference/llama_ref.py" "$MODEL" --prompt-ids 1,2,3 --max-tokens 250) \
    || fail "reference failed"
victim=$(piece_holder 0 1 1)
stream_long_request
kill -9 "${WPID[$victim]}"; t0=$(now_ms)
wait "$GEN"; rc=$?
took=$(( $(now_ms) - t0 ))
[ "$rc" = 0 ] || fail "the request failed when a peer died (exit $rc): $(cat "$T/err")"
got=$(tr -s ' \n' ',' < "$T/out" | sed 's/,$//')
[ "$got" = "$ref" ] || fail "resumed tokens differ from the reference:
got $got
ref $ref"
replayed=$(status_json | jget "d['coordinator']['stats']['requests_replayed']")
[ "$replayed" -ge 1 ] || fail "the request was not replayed (stats.requests_replayed $replayed)"
[ "$(piece_holder 0 1 1)" != "$victim" ] || fail "the victim still holds its piece"
# The survivors' failure reports name the dead peer by worker and node, not
# by address alone.
grep -Eq "failed: .*rank [0-9]+ \(worker $victim on node [^,]+, [^)]+\)" "$T/coordinator.log" \
    || fail "no failure report names the dead peer as worker $victim on its node:
$(grep -E 'reports .* failed' "$T/coordinator.log" | head -3)"
ok "a request caught by a dead peer resumed on the rewired replica ($took ms) with the reference's 250 tokens"
