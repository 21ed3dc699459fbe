# A peer killed while a request is running: the request fails with a clear
# error within a bounded time, it never hangs; the deployment serves again
# once the spare is wired in.
source "$(dirname "$0")/lib.sh"
write_yaml "$T/d.yaml" 2 2 1
start_coord "$T/d.yaml"
for i in 0 1 2 3 4; do start_worker "w$i"; done
wait_until 15 all_ready || fail "not ready"
victim=$(piece_holder 0 1 1)
stream_long_request
kill -9 "${WPID[$victim]}"; t0=$(now_ms)
wait "$GEN"; rc=$?
took=$(( $(now_ms) - t0 ))
[ "$rc" != 0 ] || fail "the request survived the death of a peer: $(wc -w < "$T/out") tokens"
echo "request failed after $took ms: $(tr '\n' ' ' < "$T/err")"
grep -qE "failed after [0-9]+ token\(s\)" "$T/err" || fail "unclear error: $(cat "$T/err")"
[ "$took" -le 5000 ] || fail "the failure took $took ms"
replaced() { [ "$(piece_holder 0 1 1)" != "$victim" ] && all_ready; }
wait_until 10 replaced || fail "not whole again"
tsr generate tiny --prompt-ids 1,2,3 --max-tokens 5 --ids > /dev/null || fail "no service after failover"
ok "request caught by a dead peer failed clearly in $took ms; service resumed"
