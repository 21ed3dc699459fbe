# Text in, text out through the CLI: the coordinator encodes --prompt with the
# deployment's tokenizer (the one model-init writes) and streams the text each token
# completes.  The same tokens as the prompt's ids; text equal to decoding the ids; a
# request resumed after a coordinator restart goes on without a gap or a repeat in the
# text; a deployment without a tokenizer, and invalid UTF-8, are refused with reasons; a
# tokenizer that does not cover the model's ids is refused at load (and model-init writes
# none).
source "$(dirname "$0")/lib.sh"
M2="$T/text-model"
"$BIN/tessera" model-init "$M2" --hidden 64 --intermediate 128 --layers 8 --heads 8 \
    --kv-heads 4 --vocab 1024 --max-pos 512 --seed 9 > /dev/null || fail "model-init"
[ -s "$M2/tokenizer.json" ] || fail "model-init wrote no tokenizer.json"
# A model wider than the shipped tokenizer (1,024 ids): model-init writes none, and says
# so; the tokenizer copied in anyway (as an older model-init wrote it) is refused at load.
MW="$T/wide-model"
"$BIN/tessera" model-init "$MW" --hidden 64 --intermediate 128 --layers 2 --heads 4 \
    --kv-heads 2 --vocab 4096 --max-pos 512 --seed 9 > /dev/null 2> "$T/mi-err" || fail "model-init"
[ ! -e "$MW/tokenizer.json" ] || fail "model-init wrote a 1,024-id tokenizer beside 4,096 ids"
grep -q "no tokenizer.json.*1024 ids.*4096" "$T/mi-err" || fail "model-init does not say why: $(cat "$T/mi-err")"
cp "$M2/tokenizer.json" "$M2/tokenizer_config.json" "$MW/"
{ coordinator_yaml; cat <<YAML
deployments:
  - name: text
    model: $M2
    parallel: {tensor: 1, pipeline: 2, replicas: 1}
    max_seq_len: 400
  - name: ids
    model: $MODEL
    parallel: {tensor: 1, pipeline: 1, replicas: 1}
    max_seq_len: 256
  - name: broken
    model: $T/broken-model
    parallel: {tensor: 1, pipeline: 1, replicas: 1}
    max_seq_len: 256
  - name: wide
    model: $MW
    parallel: {tensor: 1, pipeline: 1, replicas: 1}
    max_seq_len: 256
YAML
} > "$T/d.yaml"
# a tokenizer.json that is there but cannot be used: a fault the status names
cp -r "$M2" "$T/broken-model"
printf '{"model": ' > "$T/broken-model/tokenizer.json"
start_coord "$T/d.yaml"
for i in 0 1 2 3 4; do start_worker "w$i"; done
wait_until 15 all_ready || fail "not ready: $(tsr status 2>&1)"

PROMPT="Tessera shards a model across GPU machines — ça marche, 日本語も 🚀."
pids=$("$BIN/tessera" tokenize "$M2" "$PROMPT") || fail "tokenize"
a=$(tsr generate text --prompt "$PROMPT" --max-tokens 60 --ids) || fail "generate --prompt --ids"
b=$(tsr generate text --prompt-ids "$pids" --max-tokens 60 --ids) || fail "generate --prompt-ids"
[ "$a" = "$b" ] || fail "a text prompt and its ids gave different tokens: $a / $b"
txt=$(tsr generate text --prompt "$PROMPT" --max-tokens 60) || fail "generate --prompt"
dec=$("$BIN/tessera" tokenize "$M2" --decode "$(echo "$a" | tr ' ' ',')") || fail "decode"
[ "$txt" = "$dec" ] || fail "streamed text differs from the decoded ids:
got $txt
dec $dec"
txt2=$(tsr generate text --prompt-ids "$pids" --max-tokens 60 --text) || fail "generate --text"
[ "$txt2" = "$dec" ] || fail "--text for an id prompt differs: $txt2"
ok "text prompt = its ids; streamed text = decoded ids ($(echo "$a" | wc -w) tokens)"

s=$(tsr generate text --prompt "$PROMPT" --max-tokens 40 --temperature 1 --seed 3 --ids)
st=$(tsr generate text --prompt "$PROMPT" --max-tokens 40 --temperature 1 --seed 3)
[ "$st" = "$("$BIN/tessera" tokenize "$M2" --decode "$(echo "$s" | tr ' ' ',')")" ] ||
    fail "sampled text differs from its decoded ids"

# Refusals, with reasons and exit status 3 (2 for bad usage).
tsr generate ids --prompt "hello" 2> "$T/e1"; [ $? = 3 ] || fail "text to an ids-only deployment"
grep -q "takes token ids only" "$T/e1" || fail "no reason: $(cat "$T/e1")"
tsr generate text --prompt $'ab\xff' 2> "$T/e2"; [ $? = 3 ] || fail "invalid UTF-8 accepted"
grep -q "not valid UTF-8 at byte 2" "$T/e2" || fail "no offset: $(cat "$T/e2")"
tsr generate text --prompt x --prompt-ids 1 2> /dev/null; [ $? = 2 ] || fail "both prompts accepted"
tsr generate broken --prompt "hello" 2> "$T/e3"; [ $? = 3 ] || fail "text to a broken tokenizer"
grep -q "broken-model/tokenizer.json" "$T/e3" || fail "the refusal does not name the file: $(cat "$T/e3")"
dep() { status_json | jget "[x for x in d['deployments'] if x['name'] == '$1'][0].get('$2')"; }
[ "$(dep broken text_prompts)" = false ] && [ "$(dep text text_prompts)" = true ] &&
    [ "$(dep ids text_prompts)" = false ] || fail "text_prompts: $(status_json | head -c 600)"
dep broken tokenizer_error | grep -q "broken-model/tokenizer.json" ||
    fail "status does not say why the tokenizer cannot be used: $(dep broken tokenizer_error)"
[ "$(dep ids tokenizer_error)" = null ] || fail "a model without a usable tokenizer for its vocabulary is not broken"
tsr status | grep -A1 "deployment broken" | grep -q "token ids only: its tokenizer cannot be used" ||
    fail "tessera status does not show the broken tokenizer: $(tsr status)"
ok "refusals name their reason; status names a tokenizer.json that cannot be used"

# A tokenizer that does not cover the model's ids would give empty text: refused at load,
# with the reason in status and in the refusal of a text prompt; token ids still served.
[ "$(dep wide text_prompts)" = false ] || fail "a 1,024-id tokenizer serves a 4,096-id model"
dep wide tokenizer_error | grep -q "wide-model/tokenizer.json has tokens for 1024 of the model's 4096 ids" ||
    fail "status does not say why: $(dep wide tokenizer_error)"
tsr status | grep -A1 "deployment wide" | grep -q "token ids only: its tokenizer cannot be used: .*1024 of the model's 4096" ||
    fail "tessera status does not show why: $(tsr status)"
tsr generate wide --prompt "hello" 2> "$T/e4"; [ $? = 3 ] || fail "text to a tokenizer that does not cover the model"
grep -q "1024 of the model's 4096 ids" "$T/e4" || fail "no reason: $(cat "$T/e4")"
n=$(tsr generate wide --prompt-ids 1,2,3 --max-tokens 5 --ids | wc -w)
[ "$n" = 5 ] || fail "token ids are not served by the wide deployment ($n)"
ok "a tokenizer that does not cover the model is refused at load, with the reason; ids are served"

# A reload checks again: the same tokenizer.json beside weights of 1,024 ids serves text;
# beside 4,096 ids again (the file unchanged, the tokenizer kept from before the reload)
# it is refused.
"$BIN/tessera" model-init "$T/narrow" --hidden 64 --intermediate 128 --layers 2 --heads 4 \
    --kv-heads 2 --vocab 1024 --max-pos 512 --seed 9 > /dev/null || fail "model-init"
mkdir "$T/wide-weights" && mv "$MW/config.json" "$MW/model.safetensors" "$T/wide-weights/"
cp "$T/narrow/config.json" "$T/narrow/model.safetensors" "$MW/"
tsr reload > /dev/null || fail "reload"
wide_text() { [ "$(dep wide text_prompts)" = "$1" ]; }
wait_until 10 wide_text true || fail "the tokenizer does not serve the model it covers after a reload: $(dep wide tokenizer_error)"
cp "$T/wide-weights/config.json" "$T/wide-weights/model.safetensors" "$MW/"
tsr reload > /dev/null || fail "reload"
wait_until 10 wide_text false || fail "a reload kept a tokenizer that no longer covers the model"
dep wide tokenizer_error | grep -q "1024 of the model's 4096 ids" || fail "no reason after the reload: $(dep wide tokenizer_error)"
ok "a reload checks the tokenizer against the model again, also one it keeps"

# A coordinator restart mid-stream: the text goes on where it stopped.
ref=$(tsr generate text --prompt "$PROMPT" --max-tokens 360) || fail "reference run"
tsr generate text --prompt "$PROMPT" --max-tokens 360 --token-timeout 60000 > "$T/out" 2> "$T/err" &
GEN=$!
first_token_arrived
kill -9 "$COORD_PID"
noticed() { grep -q "lost the connection to the coordinator" "$T/err"; }
wait_until 3 noticed || fail "the client did not notice: $(cat "$T/err")"
start_coord "$T/d.yaml"
wait "$GEN" || fail "the request did not resume: $(cat "$T/err")"
[ "$(cat "$T/out")" = "$ref" ] || fail "resumed text differs:
got $(cat "$T/out")
ref $ref"
ok "the text resumed after a coordinator restart with no gap or repeat"
