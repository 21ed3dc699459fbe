# A reload that brings a model with a large tokenizer.json (32 MB here) reads it off the
# loop (held 4 s longer by a test setting): status right after shows it being read, a text prompt to that deployment is
# refused as "try again" (token ids are served), and then the new tokenizer is in.  The
# reload also holds the loop for a second (the test setting TSR_TEST_RELOAD_HOLD_MS, as a
# slow disk would), past worker_timeout_ms: no worker is declared dead, because the
# heartbeats that came meanwhile wait in the socket and the loop reads them before it
# judges anyone silent.
source "$(dirname "$0")/lib.sh"
M="$T/m"
"$BIN/tessera" model-init "$M" --hidden 64 --intermediate 128 --layers 2 --heads 4 \
    --kv-heads 2 --vocab 1024 --max-pos 256 --seed 3 > /dev/null || fail "model-init"
cp -r "$M" "$T/big-tok"
python3 - "$T/big-tok/tokenizer.json" <<'PY' || fail "cannot write the big tokenizer"
import json, sys
d = json.load(open(sys.argv[1]))
v = d["model"]["vocab"]
# "qzqzqzqz" becomes one token, past the model's vocabulary, so the text is refused
for a, b in (("q", "z"), ("qz", "qz"), ("qzqz", "qzqz")):
    if a + b not in v:
        v[a + b] = len(v)
    d["model"]["merges"].insert(0, [a, b])
n = len(v)
for i in range(1600000):
    v["x%07d" % i] = n + i
json.dump(d, open(sys.argv[1], "w"))
PY
HPORT=$(free_port)
yaml_head() {
    printf 'version: 1\ncoordinator:\n  workers_endpoint: %s\n  control_endpoint: %s\n' "$WEP" "$CEP"
    printf '  heartbeat_interval_ms: 50\n  worker_timeout_ms: 300\n  keys_dir: %s\n' "$KEYS"
    printf '  http_endpoint: 127.0.0.1:%s\n' "$HPORT"
    printf 'deployments:\n  - name: a\n    model: %s\n    max_seq_len: 128\n' "$M"
}
# with_b DIR [DIR2]: deployments a, b on DIR, and b2 on DIR2
with_b() {
    yaml_head; printf '  - name: b\n    model: %s\n    max_seq_len: 128\n' "$1"
    [ -z "${2:-}" ] || printf '  - name: b2\n    model: %s\n    max_seq_len: 128\n' "$2"
}

with_b "$M" > "$T/d.yaml"
# TSR_TEST_TOKLOAD_HOLD_MS: every read off the loop waits 4 s before it starts, so the
# checks made while the tokenizer is read find it so on any machine
TSR_TEST_RELOAD_HOLD_MS=1000 TSR_TEST_TOKLOAD_HOLD_MS=4000 start_coord "$T/d.yaml"
start_worker w0
start_worker w1
start_worker w2
wait_until 15 all_ready || fail "not ready: $(tsr status 2>&1)"
want=$(tsr generate a --prompt-ids 1,2,3 --max-tokens 8 --ids) || fail "generate"
tsr generate b --prompt "hello there" --max-tokens 4 --ids > /dev/null || fail "text generate"
deaths() { status_json | jget "d['coordinator']['stats']['deaths']"; }
b_field() { status_json | jget "[x for x in d['deployments'] if x['name'] == 'b'][0].get('$1')"; }
b_text() { [ "$(b_field text_prompts)" = true ]; }
before=$(deaths)
# b and the new b2 share the big tokenizer's directory: it is read once for both
with_b "$T/big-tok" "$T/big-tok" > "$T/d.yaml"
t0=$(now_ms)
tsr reload > "$T/reload.txt" 2>&1 || fail "reload: $(cat "$T/reload.txt")"
took=$(( $(now_ms) - t0 ))
[ "$took" -gt 900 ] || fail "the reload took $took ms: the hold did not hold the loop"
doc=$(status_json) || fail "no status right after the reload"
loading=$(echo "$doc" | jget "[x for x in d['deployments'] if x['name'] == 'b'][0].get('tokenizer_loading', False)")
[ "$loading" = true ] ||
    fail "right after the reload, b's 32 MB tokenizer is not shown being read (read on the loop?): $loading"
[ "$(echo "$doc" | jget "[x for x in d['deployments'] if x['name'] == 'b'][0]['text_prompts']")" = false ] ||
    fail "text_prompts true while the tokenizer is being read"
tsr status > "$T/st.txt" 2>&1
grep -q "until its tokenizer.json is read" "$T/st.txt" || fail "tessera status does not say: $(cat "$T/st.txt")"
out=$(tsr generate b --prompt "hello there" --max-tokens 4 --ids 2>&1); rc=$?
[ "$rc" = 3 ] || fail "a text prompt while the tokenizer is read: exit $rc ($out), want 3"
echo "$out" | grep -q "tokenizer.json is being read" || fail "the refusal does not say why: $out"
# over HTTP: 503 with Retry-After, the reason named
http=$(python3 - "$HPORT" <<'PY'
import json, sys, urllib.request, urllib.error
req = urllib.request.Request("http://127.0.0.1:%s/v1/completions" % sys.argv[1],
                             json.dumps({"model": "b", "prompt": "hi", "max_tokens": 2}).encode(),
                             {"Content-Type": "application/json"})
try:
    urllib.request.urlopen(req, timeout=10)
    print("200")
except urllib.error.HTTPError as e:
    print(e.code, e.headers.get("Retry-After"), json.load(e)["error"]["message"])
PY
)
case "$http" in "503 1 "*"tokenizer.json is being read"*) ;; *) fail "HTTP while the tokenizer is read: $http";; esac
wait_until 30 b_text ||
    fail "b's tokenizer never came in: $(tsr status 2>&1)"
[ "$(b_field tokenizer_loading)" = null ] || fail "still loading after text_prompts"
wait_until 15 all_ready || fail "not ready after the reload: $(tsr status 2>&1)"
# "qzqzqzqz" is one id of the big tokenizer's (past the model's 1024, so refused by
# name), several of the small one's
out=$(tsr generate b --prompt "qzqzqzqz" --max-tokens 2 --ids 2>&1) &&
    fail "b encoded with the old tokenizer: $out"
echo "$out" | grep -q "outside the vocabulary" || fail "b's text prompt: $out"
tsr generate a --prompt "qzqzqzqz" --max-tokens 2 --ids > /dev/null || fail "a's text prompt"
out=$(tsr generate b2 --prompt "qzqzqzqz" --max-tokens 2 --ids 2>&1) &&
    fail "b2 encoded with the old tokenizer: $out"
reads=$(grep -c "reading $T/big-tok/tokenizer.json off the loop" "$T/coordinator.log")
[ "$reads" = 1 ] || fail "the directory b and b2 share was read $reads times"
[ "$(deaths)" = "$before" ] ||
    fail "a reload of $took ms declared workers dead: $(grep -h 'is dead' "$T/coordinator.log" | head -3)"
[ "$(tsr generate a --prompt-ids 1,2,3 --max-tokens 8 --ids)" = "$want" ] || fail "a's tokens changed"
ok "a reload that held the loop $took ms (worker_timeout_ms 300) declared no worker dead"
ok "the reload's 32 MB tokenizer was read off the loop, once for the two deployments that share it; text waited for it, then used it"

# A reload that changes nothing keeps the tokenizer; one after tokenizer.json was replaced
# in place reads it again.
tsr reload > "$T/reload.txt" 2>&1 || fail "reload: $(cat "$T/reload.txt")"
[ "$(b_field tokenizer_loading)" = null ] || fail "an unchanged tokenizer.json is read again"
cp "$M/tokenizer.json" "$T/big-tok/tokenizer.json.new"
mv "$T/big-tok/tokenizer.json.new" "$T/big-tok/tokenizer.json"
tsr reload > "$T/reload.txt" 2>&1 || fail "reload: $(cat "$T/reload.txt")"
[ "$(b_field tokenizer_loading)" = true ] || fail "a tokenizer.json replaced in place is not read again"
wait_until 30 b_text || fail "the replaced tokenizer never came in: $(tsr status 2>&1)"
tsr generate b --prompt "qzqzqzqz" --max-tokens 2 --ids > /dev/null ||
    fail "b still encodes with the tokenizer.json that was replaced"
ok "a reload keeps an unchanged tokenizer and reads one replaced in place again"
