# The coordinator killed while a request streams: the client notices at once,
# and when the coordinator is back (it re-adopts the workers' pieces) the
# client resubmits the prompt with the tokens it already has.  The request
# goes on where it stopped: one stream, no gap or repeat, the reference's
# tokens.  The abandoned sequence on the replica is cancelled, not run out.
source "$(dirname "$0")/lib.sh"
write_yaml "$T/d.yaml" 1 2 1
start_coord "$T/d.yaml"
for i in 0 1; do start_worker "w$i"; done
wait_until 15 all_ready || fail "not ready"
ref=$(python3 "$ROOT/tests/reference/llama_ref.py" "$MODEL" --prompt-ids 1,2,3 --max-tokens 250) \
    || fail "reference failed"
# Not --ids: the summary on standard error names the request.
tsr generate tiny --prompt-ids 1,2,3 --max-tokens 250 --token-timeout 60000 > "$T/out" 2> "$T/err" &
GEN=$!
first_token_arrived
kill -9 "$COORD_PID"; t0=$(now_ms)
noticed() { grep -q "lost the connection to the coordinator" "$T/err"; }
wait_until 3 noticed || fail "the client did not notice: $(cat "$T/err")"
took=$(( $(now_ms) - t0 ))
echo "client noticed the coordinator's death after $took ms"
kill -0 "$GEN" || fail "the client gave up: $(cat "$T/err")"
start_coord "$T/d.yaml"
wait "$GEN"; rc=$?
[ "$rc" = 0 ] || fail "the request did not resume (exit $rc): $(cat "$T/err")"
got=$(tr -s ' \n' ',' < "$T/out" | sed 's/,$//')
# The request kept its id across the restart: the one the client had before
# the coordinator died is the one the new coordinator finished.
before=$(sed -n 's/.*resuming request \([0-9]*\) when.*/\1/p' "$T/err")
after=$(sed -n 's/^request \([0-9]*\): 250 token(s).*resumed after the coordinator restarted.*/\1/p' "$T/err")
[ -n "$before" ] && [ "$before" != 0 ] && [ "$before" = "$after" ] ||
    fail "the request id changed across the restart ($before, then $after): $(cat "$T/err")"
[ "$got" = "$ref" ] || fail "resumed tokens differ from the reference:
got $got
ref $ref"
tsr generate tiny --prompt-ids 1,2,3 --max-tokens 5 --ids > /dev/null || fail "no service after the restart"
ok "coordinator death noticed in $took ms; request $before resumed after the restart, same id, with the reference's 250 tokens"
