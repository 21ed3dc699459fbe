# The prefix cache seen from outside: a long prompt sent again starts after
# the cached part (the replica says how many prompt tokens it took from its
# cache, in the CLI's summary and in the OpenAI usage), its first token
# comes in well under the time of prefilling it whole, and its tokens equal
# those of a deployment with prefix_cache: false; /metrics and status count
# the cached tokens and blocks; after a coordinator restart (the workers keep
# their caches) the prompt still hits and the tokens stay; a reload
# to another model starts with an empty cache; a reload that turns the cache
# off gives no hits and the same tokens.
source "$(dirname "$0")/lib.sh"
M="$T/wide"
# wide enough that prefilling 960 positions takes a visible while on a CPU
"$BIN/tessera" model-init "$M" --hidden 256 --intermediate 768 --layers 6 --heads 8 \
    --kv-heads 4 --vocab 1024 --max-pos 1024 --seed 9 > /dev/null || fail "model-init"
HPORT=$(free_port)
deployments() {
    cat <<YAML
deployments:
  - name: cached
    model: ${2:-$M}
    max_seq_len: 1024
    prefill_chunk: 1024
    prefix_cache: $1
  - name: plain
    model: $M
    max_seq_len: 1024
    prefill_chunk: 1024
    prefix_cache: false
YAML
}
{ coordinator_yaml "http_endpoint: 127.0.0.1:$HPORT"; deployments true; } > "$T/d.yaml"
start_coord "$T/d.yaml"
for i in 0 1; do start_worker "w$i"; done
wait_until 15 all_ready || fail "not ready: $(tsr status 2>&1)"

LONG=$(python3 -c 'import random; r=random.Random(5); print(",".join(str(r.randrange(3, 500)) for _ in range(960)))')
MORE="$LONG,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22"
# gen DEP IDS TAG: ids into $T/TAG.ids, the summary into $T/TAG.err
gen() { tsr generate "$1" --prompt-ids "$2" --max-tokens 6 > "$T/$3.ids" 2> "$T/$3.err" || fail "$3: $(cat "$T/$3.err")"; }
ttft() { sed -n 's/.*first token after \([0-9]*\) ms.*/\1/p' "$T/$1.err"; }
cached() { sed -n "s/.*(\([0-9]*\) of the prompt's [0-9]* tokens cached).*/\1/p" "$T/$1.err"; }

gen cached "$LONG" first
[ "$(cached first)" = 0 ] || fail "a first prompt found $(cached first) cached tokens"
gen cached "$MORE" hit
gen plain "$MORE" plain
gen plain "$MORE" plain2
# the cached prefix: every full block of the first prompt (960 = 60 blocks)
[ "$(cached hit)" = 960 ] || fail "the second prompt took $(cached hit) cached tokens, not 960: $(cat "$T/hit.err")"
[ "$(cached plain)" = 0 ] && [ "$(cached plain2)" = 0 ] || fail "prefix_cache: false still hit"
cmp -s "$T/hit.ids" "$T/plain.ids" || fail "tokens differ with the cache: $(cat "$T/hit.ids") vs $(cat "$T/plain.ids")"
echo "first token: whole prompt $(ttft plain2) ms, cached $(ttft hit) ms"
# loosely: a 16-token prefill instead of 976 is far below half of it
[ $(( $(ttft hit) * 2 )) -lt "$(ttft plain2)" ] || fail "the cached first token took $(ttft hit) ms, the uncached $(ttft plain2) ms"
ok "a cached prefix of 960 tokens: the same tokens, first token in $(ttft hit) ms against $(ttft plain2) ms"

# the OpenAI usage and /metrics
python3 - "$HPORT" "$MORE" > "$T/usage.txt" <<'PY' || fail "usage: $(cat "$T/usage.txt")"
import json, sys, time, urllib.request
port, ids = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
req = urllib.request.Request("http://127.0.0.1:%s/v1/completions" % port, method="POST",
    data=json.dumps({"model": "cached", "prompt": ids, "max_tokens": 3}).encode(),
    headers={"Content-Type": "application/json"})
u = json.load(urllib.request.urlopen(req, timeout=60))["usage"]
print(json.dumps(u))
assert u["prompt_tokens"] == len(ids), u
assert u["prompt_tokens_details"]["cached_tokens"] == 960, u
want = [('tessera_prompt_tokens_cached_total{deployment="cached"}', 1920),
        ('tessera_replica_prompt_tokens_cached_total{deployment="cached"', 1920),
        ('tessera_replica_prompt_tokens_computed_total{deployment="cached"', 960),
        ('tessera_kv_blocks_cached{deployment="cached"', 60)]
# /metrics answers from a text at most 250 ms old, and heartbeats come every 100 ms
for attempt in range(50):
    m = urllib.request.urlopen("http://127.0.0.1:%s/metrics" % port, timeout=10).read().decode()
    val = lambda prefix: sum(float(l.split()[-1]) for l in m.splitlines() if l.startswith(prefix))
    short = [(p, val(p), n) for p, n in want if val(p) < n]
    if not short and val('tessera_prompt_tokens_cached_total{deployment="plain"}') == 0:
        break
    time.sleep(0.1)
else:
    sys.exit("metrics short of what was sent: %s" % short)
PY
[ "$(status_json | jget "sum(w['kv_blocks_cached'] for w in d['workers'] if w['assignment'] and w['assignment']['deployment'] == 'cached')")" -ge 60 ] \
    || fail "status shows no cached blocks"
tsr status > "$T/status.txt"
grep -Eq ' [0-9]+\+([6-9][0-9]|[0-9]{3,})/[0-9]+$' "$T/status.txt" || fail "tessera status shows no cached blocks: $(cat "$T/status.txt")"
ok "usage, /metrics and status count the cached tokens: $(cat "$T/usage.txt")"

# a coordinator restart: the same key store derives the same keys
kill -9 "$COORD_PID"; wait "$COORD_PID" 2>/dev/null
start_coord "$T/d.yaml"
wait_until 10 all_ready || fail "not ready after the restart"
gen cached "$MORE" again
[ "$(cached again)" -ge 960 ] || fail "after a restart the prompt took $(cached again) cached tokens"
cmp -s "$T/again.ids" "$T/plain.ids" || fail "tokens differ after a coordinator restart"
ok "after a coordinator restart: $(cached again) cached tokens, the same tokens"

# a reload that changes the model (the same weights under another path) drops the cache
cp -r "$M" "$T/wide2"
epoch() { status_json | jget "max(w['assignment']['epoch'] for w in d['workers'] if w['assignment'] and w['assignment']['deployment'] == 'cached')"; }
before=$(epoch)
{ coordinator_yaml "http_endpoint: 127.0.0.1:$HPORT"; deployments true "$T/wide2"; } > "$T/d.yaml"
tsr reload > "$T/reload.txt" 2>&1 || fail "reload: $(cat "$T/reload.txt")"
moved() { [ "$(epoch)" -gt "$before" ] && all_ready; }
wait_until 15 moved || fail "the new model did not load: $(tsr status 2>&1)"
gen cached "$MORE" newmodel
[ "$(cached newmodel)" = 0 ] || fail "a new model found $(cached newmodel) cached tokens"
gen cached "$MORE" newmodel2
[ "$(cached newmodel2)" = 960 ] || fail "the new model's cache took $(cached newmodel2) tokens"
cmp -s "$T/newmodel.ids" "$T/plain.ids" && cmp -s "$T/newmodel2.ids" "$T/plain.ids" || fail "tokens differ on the new model"
ok "a reload to another model starts with an empty cache"

# a reload that turns it off
{ coordinator_yaml "http_endpoint: 127.0.0.1:$HPORT"; deployments false; } > "$T/d.yaml"
tsr reload > "$T/reload.txt" 2>&1 || fail "reload: $(cat "$T/reload.txt")"
off() { gen cached "$MORE" off; [ "$(cached off)" = 0 ]; }
wait_until 10 off || fail "still cached after prefix_cache: false: $(cat "$T/off.err")"
gen cached "$MORE" off   # sent twice: nothing was kept the first time
[ "$(cached off)" = 0 ] || fail "prefix_cache: false still caches: $(cat "$T/off.err")"
cmp -s "$T/off.ids" "$T/plain.ids" || fail "tokens differ with the cache turned off"
ok "prefix_cache: false by reload: no hits, the same tokens"
