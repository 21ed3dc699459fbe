# Cancellation frees KV blocks: of 64 requests on one replica (tp=1 pp=2),
# 16 lose their client mid-stream, 16 pass their deadline (generate
# --timeout) and 32 run to the end with the reference's tokens.  Status
# shows blocks in use while they run, and every piece's pool whole again
# afterwards.
source "$(dirname "$0")/lib.sh"
# A copy of the model without an eos token and with room for 2048
# positions, so no request ends early and a long one runs for seconds.
cp -r "$MODEL" "$T/long"
python3 -c 'import json,sys; p=sys.argv[1]+"/config.json"; c=json.load(open(p)); c.pop("eos_token_id"); c["max_position_embeddings"]=2048; json.dump(c, open(p,"w"))' "$T/long"
MODEL="$T/long"
write_yaml "$T/d.yaml" 1 2 1
sed -i 's/    max_seq_len: 256/    max_seq_len: 2048\n    max_batch: 32\n    max_queue: 64/' "$T/d.yaml"
start_coord "$T/d.yaml"
for i in 0 1; do start_worker "w$i"; done
wait_until 15 all_ready || fail "not ready: $(tsr status 2>&1)"
for k in 0 1 2 3; do
    python3 "$ROOT/tests/reference/llama_ref.py" "$MODEL" --prompt-ids "$((k + 5)),7,$((k * 11 + 1))" \
        --max-tokens 12 > "$T/ref.$k" || fail "reference $k failed"
done
used() { status_json | jget "sum(w.get('kv_blocks_used', 0) for w in d['workers'])"; }
total() { status_json | jget "min(w.get('kv_blocks_total', 0) for w in d['workers'])"; }

gone=() deadline=() normal=()
for c in $(seq 0 15); do   # clients that go away: 2000 tokens would take many seconds
    "$BIN/tessera" --coordinator "$CEP" generate tiny --prompt-ids "1,2,$c" --max-tokens 2000 --ids \
        > "$T/gone.$c" 2>&1 &
    gone+=($!)
done
streaming() { for c in $(seq 0 15); do [ -s "$T/gone.$c" ] || return 1; done; }
wait_until 20 streaming || fail "the clients to kill got no token"
busy() { [ "$(used)" -gt 0 ]; }
wait_until 10 busy || fail "status never showed KV blocks in use"
echo "in use while running: $(used) of $(total) blocks per piece"
# Every member's heartbeat counts the forward steps its data plane finished
# (how the coordinator tells a busy replica computing from a hung one).
steps() { status_json | jget "min(w.get('steps', 0) for w in d['workers'])"; }
s0=$(steps)
moved() { [ "$(steps)" -gt "$s0" ]; }
wait_until 5 moved || fail "a worker's step count did not move while it ran: $(status_json | jget "[(w['name'], w.get('steps')) for w in d['workers']]")"
kill -9 "${gone[@]}" || fail "a client to kill had already finished"
for c in $(seq 0 15); do   # requests that pass their deadline
    "$BIN/tessera" --coordinator "$CEP" generate tiny --prompt-ids "3,4,$c" --max-tokens 2000 --ids \
        --timeout 400 > "$T/dl.$c" 2> "$T/dl.err.$c" &
    deadline+=($!)
done
for c in $(seq 0 31); do
    "$BIN/tessera" --coordinator "$CEP" generate tiny --prompt-ids "$((c % 4 + 5)),7,$((c % 4 * 11 + 1))" \
        --max-tokens 12 --ids > "$T/ok.$c" 2> "$T/ok.err.$c" &
    normal+=($!)
done
for c in $(seq 0 15); do
    if wait "${deadline[$c]}"; then fail "request $c finished before its deadline: $(cat "$T/dl.$c") / $(cat "$T/dl.err.$c")"; fi
    # The client sends what is left of its 400 ms when it sends the request.
    grep -Eq "passed its deadline of (3[0-9][0-9]|400) ms" "$T/dl.err.$c" ||
        fail "deadline $c: $(cat "$T/dl.err.$c")"
done
for c in $(seq 0 31); do
    wait "${normal[$c]}" || fail "request $c failed: $(cat "$T/ok.err.$c")"
    [ "$(tr ' ' ',' < "$T/ok.$c")" = "$(cat "$T/ref.$((c % 4))")" ] || fail "request $c: $(cat "$T/ok.$c")"
done
empty() { [ "$(used)" = 0 ]; }
wait_until 1 empty || fail "KV blocks still held 1 s after the last request ended: $(status_json | jget "[(w['name'], w.get('kv_blocks_used'), w.get('kv_blocks_total')) for w in d['workers']]")"
[ "$(total)" -gt 0 ] || fail "no pool size in status"
# The 16 whose client went away are cancelled; the 16 past their deadline failed (the
# service ended them: counted failed, not also cancelled).
cancelled=$(status_json | jget "d['coordinator']['stats']['requests_cancelled']")
failed=$(status_json | jget "d['coordinator']['stats']['requests_failed']")
[ "$cancelled" -ge 16 ] || fail "the coordinator cancelled $cancelled requests, expected 16"
[ "$failed" -ge 16 ] || fail "the coordinator failed $failed requests, expected the 16 past their deadline"
# Cancelled sequences left the batch: the workers sent only the few tokens
# already in the pipeline for them, not the rest of their 2000 each (those
# would reach the coordinator after the request ended, and be dropped).
stale=$(status_json | jget "d['coordinator']['stats']['stale_dropped']")
echo "tokens for ended requests: $stale"
[ "$stale" -lt 256 ] || fail "$stale tokens came for cancelled requests: they kept running"
ok "32 of 64 requests ended early (16 cancelled as their client went, 16 failed at their deadline); the others got the reference's tokens; every pool is whole again"
