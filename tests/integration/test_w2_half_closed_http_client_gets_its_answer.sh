# A client that sends its request and then half-closes its connection
# (shutdown(SHUT_WR)) still reads its answer: the HTTP server must not take
# the end of its request stream for a client gone away
# (tests/http/test_half_close.py).  That a client which really closed is
# still noticed is test_w_http_api's.
source "$(dirname "$0")/lib.sh"
# A model with a tokenizer (the HTTP API answers in text)
M2="$T/text-model"
"$BIN/tessera" model-init "$M2" --hidden 64 --intermediate 128 --layers 4 --heads 8 \
    --kv-heads 4 --vocab 1024 --max-pos 512 --seed 4 > /dev/null || fail "model-init"
HPORT=$(free_port)
{ coordinator_yaml "http_endpoint: 127.0.0.1:$HPORT"; cat <<YAML
deployments:
  - name: tiny
    model: $M2
    max_seq_len: 256
YAML
} > "$T/d.yaml"
start_coord "$T/d.yaml"
start_worker w0
wait_until 15 all_ready || fail "not ready: $(tsr status 2>&1)"
TSR_HTTP="127.0.0.1:$HPORT" python3 "$ROOT/tests/http/test_half_close.py" ||
    fail "a half-closed client did not get its answer"
ok "a half-closed HTTP client gets its whole answer, streamed or not"
