# A client that goes away before any token was sent to it (its replica is
# busy or stalled) is noticed from its closed connection, not at the next
# token: the coordinator cancels its request at the leader at once.
source "$(dirname "$0")/lib.sh"
write_yaml "$T/d.yaml" 1 1 1
sed -i 's/worker_timeout_ms: 1000/worker_timeout_ms: 10000/' "$T/d.yaml"
start_coord "$T/d.yaml" --adopt-grace-ms 300
start_worker w0
wait_until 15 all_ready || fail "not ready"
stat() { status_json | jget "d['coordinator']['stats']['$1']"; }
kill -STOP "${WPID[w0]}"    # nothing it holds moves on; its lease is 10 s
"$BIN/tessera" --coordinator "$CEP" generate tiny --prompt-ids 1,2,3 --max-tokens 5 \
    --token-timeout 60000 > "$T/out" 2> "$T/err" &
G=$!
inflight() { [ "$(stat in_flight)" = 1 ]; }
wait_until 5 inflight || { kill -CONT "${WPID[w0]}"; fail "the request did not arrive"; }
kill -9 "$G"; wait "$G" 2>/dev/null
t0=$(now_ms)
cancelled() { [ "$(stat requests_cancelled)" = 1 ] && [ "$(stat in_flight)" = 0 ]; }
wait_until 3 cancelled || { status_json > "$T/st.json"; kill -CONT "${WPID[w0]}"; fail "the gone client request was not cancelled: $(cat "$T/st.json" | head -c 900)"; }
took=$(( $(now_ms) - t0 ))
kill -CONT "${WPID[w0]}"
[ -s "$T/out" ] && fail "the client got tokens: $(cat "$T/out")"
tsr generate tiny --prompt-ids 4,5 --max-tokens 3 --ids > /dev/null || fail "no service after"
ok "a client gone before its first token was noticed and its request cancelled in $took ms"
