# A client that sends its request and then half-closes its connection
# (shutdown(SHUT_WR)) still reads its answer: the HTTP server must not take
# the end of its request stream for a client gone away
# (tests/http/test_half_close.py); and one that half-closes, then closes,
# is still noticed and its request cancelled.  That a client which closes
# at once is noticed is test_w_http_api's.
source "$(dirname "$0")/lib.sh"
# A model with a tokenizer (the HTTP API answers in text)
M2="$T/text-model"
"$BIN/tessera" model-init "$M2" --hidden 64 --intermediate 128 --layers 4 --heads 8 \
    --kv-heads 4 --vocab 1024 --max-pos 512 --seed 4 > /dev/null || fail "model-init"
# A slower one (about 10 ms a token), so that a request is still making tokens when its
# client leaves
M3="$T/slow-model"
"$BIN/tessera" model-init "$M3" --dtype bf16 --hidden 512 --intermediate 1536 --layers 8 --heads 8 \
    --kv-heads 4 --vocab 1024 --max-pos 1024 --seed 4 > /dev/null || fail "model-init"
HPORT=$(free_port)
{ coordinator_yaml "http_endpoint: 127.0.0.1:$HPORT"; cat <<YAML
deployments:
  - name: tiny
    model: $M2
    max_seq_len: 256
  - name: slow
    model: $M3
    max_seq_len: 1000
YAML
} > "$T/d.yaml"
start_coord "$T/d.yaml"
start_worker w0
start_worker w1
wait_until 15 all_ready || fail "not ready: $(tsr status 2>&1)"
TSR_HTTP="127.0.0.1:$HPORT" python3 "$ROOT/tests/http/test_half_close.py" ||
    fail "a half-closed client did not get its answer"
ok "a half-closed HTTP client gets its whole answer, streamed or not; one that then closes is noticed"
