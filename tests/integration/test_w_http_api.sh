# The OpenAI-compatible HTTP API, driven by the official `openai` Python client
# (tests/http/test_api.py): completions and chat, streamed and not, equal to the CLI's
# tokens decoded; with a SentencePiece-style tokenizer, prompt + completion text equal to
# the reference library's decode of all the ids (HTTP and `tessera generate --prompt`);
# a tokenizer that does not cover its model refused with the reason; stop strings; every
# error status; API keys; a closed connection cancels, a half-closed one gets its answer;
# 32 concurrent streams; /metrics parsed by the Prometheus parser and counting what was
# sent; /health.
source "$(dirname "$0")/lib.sh"
PY="$ROOT/build/pyenv/bin/python"
[ -x "$PY" ] || fail "no $PY: run scripts/pyenv.sh (make test does)"
M2="$T/text-model"
"$BIN/tessera" model-init "$M2" --hidden 64 --intermediate 128 --layers 4 --heads 8 \
    --kv-heads 4 --vocab 1024 --max-pos 512 --seed 4 > /dev/null || fail "model-init"
# A slower model (about 10 ms a token here), so that a request is still making tokens
# when its client leaves
M3="$T/slow-model"
"$BIN/tessera" model-init "$M3" --dtype bf16 --hidden 512 --intermediate 1536 --layers 8 --heads 8 \
    --kv-heads 4 --vocab 1024 --max-pos 1024 --seed 4 > /dev/null || fail "model-init"
# A SentencePiece-style tokenizer (Metaspace, byte fallback) built with the reference
# library, beside a model of its vocabulary: its words start with "▁", so a completion
# decoded on its own would lose the space before its first word.
(cd "$ROOT/tests/tokenizer" && "$PY" build_tokenizers.py "$T/tok" sp) || fail "build_tokenizers.py"
SPV=$("$PY" -c "import sys; from tokenizers import Tokenizer
print(Tokenizer.from_file(sys.argv[1]).get_vocab_size(True))" "$T/tok/sp-metaspace/tokenizer.json")
M4="$T/sp-model"
"$BIN/tessera" model-init "$M4" --hidden 64 --intermediate 128 --layers 2 --heads 4 \
    --kv-heads 2 --vocab "$SPV" --max-pos 512 --seed 5 --no-tokenizer > /dev/null || fail "model-init"
cp "$T/tok/sp-metaspace/tokenizer.json" "$T/tok/sp-metaspace/tokenizer_config.json" "$M4/"
# A model wider than the shipped tokenizer, with it copied in (as an older model-init did)
MW="$T/wide-model"
"$BIN/tessera" model-init "$MW" --hidden 64 --intermediate 128 --layers 2 --heads 4 \
    --kv-heads 2 --vocab 4096 --max-pos 512 --seed 5 > /dev/null 2>&1 || fail "model-init"
cp "$M2/tokenizer.json" "$M2/tokenizer_config.json" "$MW/"
HPORT=$(free_port)
KEY="tsr-test-$(od -An -N12 -tx1 /dev/urandom | tr -d ' \n')"
echo "$KEY" > "$T/api-keys"
chmod 600 "$T/api-keys"
{ coordinator_yaml "http_endpoint: 127.0.0.1:$HPORT" "api_keys_file: $T/api-keys"; cat <<YAML
deployments:
  - name: text
    model: $M2
    max_seq_len: 400
  - name: tight
    model: $M2
    max_seq_len: 400
    max_batch: 1
    max_queue: 0
  - name: slow
    model: $M3
    max_seq_len: 1000
  - name: sp
    model: $M4
    max_seq_len: 400
  - name: wide
    model: $MW
    max_seq_len: 400
YAML
} > "$T/d.yaml"
start_coord "$T/d.yaml"
for i in 0 1 2 3 4; do start_worker "w$i"; done
wait_until 15 all_ready || fail "not ready: $(tsr status 2>&1)"
TSR_HTTP="http://127.0.0.1:$HPORT" TSR_KEY="$KEY" TSR_BIN="$BIN" TSR_CEP="$CEP" TSR_MODEL="$M2" TSR_SP_MODEL="$M4" \
    TSR_YAML="$T/d.yaml" "$PY" "$ROOT/tests/http/test_api.py" || fail "the HTTP API test failed"
ok "the HTTP API behaves for the openai client"
