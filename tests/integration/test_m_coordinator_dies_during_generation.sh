# The coordinator killed while a request streams: the client says so at once
# (it does not wait out --token-timeout); the restarted coordinator re-adopts
# the workers and serves again.
source "$(dirname "$0")/lib.sh"
write_yaml "$T/d.yaml" 1 2 1
start_coord "$T/d.yaml"
for i in 0 1; do start_worker "w$i"; done
wait_until 15 all_ready || fail "not ready"
stream_long_request
kill -9 "$COORD_PID"; t0=$(now_ms)
wait "$GEN"; rc=$?
took=$(( $(now_ms) - t0 ))
[ "$rc" != 0 ] || fail "the request finished although its coordinator died ($(wc -w < "$T/out") tokens)"
grep -q "lost the connection to the coordinator" "$T/err" || fail "unclear error: $(cat "$T/err")"
echo "client gave up $took ms after the coordinator died"
[ "$took" -le 3000 ] || fail "the client took $took ms to notice"
start_coord "$T/d.yaml"
wait_until 10 all_ready || fail "not ready after the restart"
tsr generate tiny --prompt-ids 1,2,3 --max-tokens 5 --ids > /dev/null || fail "no service after the restart"
ok "coordinator death noticed by the client in $took ms; served again after the restart"
