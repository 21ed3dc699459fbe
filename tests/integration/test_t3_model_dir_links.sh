# Issue 38, item 10: a model directory's tokenizer.json linked to a file outside it
# (/etc/shadow in the report) put a line of that file into `status --json`, which every
# key reads.  The coordinator refuses the link, naming the file, and a worker refuses a
# linked model.safetensors the same way; nothing of the linked file shows.  Started
# with --allow-model-links-outside both follow links out: the weights load from the
# copy outside, and the tokenizer's syntax error still quotes none of the file.
source "$(dirname "$0")/lib.sh"
printf 'root:SECRETHASH:19000:0:99999:7:::\n' > "$T/secret"
mkdir "$T/m"
cp "$MODEL/config.json" "$T/m/"
ln -s "$MODEL/model.safetensors" "$T/m/model.safetensors"
ln -s "$T/secret" "$T/m/tokenizer.json"
write_yaml "$T/d.yaml" 1 1 1 tiny "$T/m"
no_secret() { ! status_json | grep -qE 'root|SECRET|19000'; }

start_coord "$T/d.yaml"
tok_refused() { status_json | jget "d['deployments'][0].get('tokenizer_error', '')" | grep -q "tokenizer.json: a link that leads out of the model directory"; }
wait_until 10 tok_refused || fail "the linked tokenizer.json was not refused: $(status_json | jget "d['deployments'][0]")"
start_worker w0
st_refused() { status_json | jget "d['deployments'][0]['message']" | grep -q "model.safetensors: a link that leads out of the model directory"; }
wait_until 10 st_refused || fail "the linked model.safetensors was not refused: $(status_json | jget "d['deployments'][0]")"
no_secret || fail "status quotes the linked file: $(status_json | grep -oE '.{60}(root|SECRET).{20}' | head -2)"
refused=$(status_json | jget "d['deployments'][0]['message']")

kill "${WPID[w0]}" "$COORD_PID"
wait "${WPID[w0]}" "$COORD_PID" 2>/dev/null
start_coord "$T/d.yaml" --allow-model-links-outside
start_worker w1 --allow-model-links-outside
wait_until 15 all_ready || fail "not ready with links allowed out: $(status_json | jget "d['deployments'][0]")"
got=$(tsr generate tiny --prompt-ids 3,14,15 --max-tokens 4 --ids) || fail "generate failed"
syntax() { status_json | jget "d['deployments'][0].get('tokenizer_error', '')" | grep -q "tokenizer.json: line 1, column"; }
wait_until 5 syntax || fail "no syntax error for the linked tokenizer.json: $(status_json | jget "d['deployments'][0]")"
no_secret || fail "status quotes the linked file: $(status_json | grep -oE '.{60}(root|SECRET).{20}' | head -2)"
ok "links out of the model directory refused ($refused), followed when allowed (tokens $got), the linked file never quoted"
