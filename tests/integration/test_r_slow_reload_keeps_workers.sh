# A reload that holds the coordinator's loop for longer than worker_timeout_ms
# (here: a model whose tokenizer.json is 32 MB, read and parsed on the loop)
# declares no worker dead: the heartbeats that came meanwhile wait in the
# socket, and the loop reads them before it judges anyone silent.
source "$(dirname "$0")/lib.sh"
M="$T/m"
"$BIN/tessera" model-init "$M" --hidden 64 --intermediate 128 --layers 2 --heads 4 \
    --kv-heads 2 --vocab 1024 --max-pos 256 --seed 3 > /dev/null || fail "model-init"
cp -r "$M" "$T/big-tok"
python3 - "$T/big-tok/tokenizer.json" <<'EOF' || fail "cannot write the big tokenizer"
import json, sys
d = json.load(open(sys.argv[1]))
v = d["model"]["vocab"]
n = len(v)
for i in range(1600000):
    v["x%07d" % i] = n + i
json.dump(d, open(sys.argv[1], "w"))
EOF
yaml_head() {
    printf 'version: 1\ncoordinator:\n  workers_endpoint: %s\n  control_endpoint: %s\n' "$WEP" "$CEP"
    printf '  heartbeat_interval_ms: 50\n  worker_timeout_ms: 300\n  keys_dir: %s\n' "$KEYS"
    printf 'deployments:\n  - name: a\n    model: %s\n    max_seq_len: 128\n' "$M"
}
yaml_head > "$T/d.yaml"
start_coord "$T/d.yaml"
start_worker w0
start_worker w1
wait_until 15 all_ready || fail "not ready: $(tsr status 2>&1)"
want=$(tsr generate a --prompt-ids 1,2,3 --max-tokens 8 --ids) || fail "generate"
deaths() { status_json | jget "d['coordinator']['stats']['deaths']"; }
before=$(deaths)
{ yaml_head; printf '  - name: b\n    model: %s\n    max_seq_len: 128\n' "$T/big-tok"; } > "$T/d.yaml"
t0=$(now_ms)
tsr reload > "$T/reload.txt" 2>&1 || fail "reload: $(cat "$T/reload.txt")"
took=$(( $(now_ms) - t0 ))
[ "$took" -gt 400 ] || fail "the reload took $took ms, too little to hold the loop past the 300 ms timeout"
wait_until 15 all_ready || fail "not ready after the reload: $(tsr status 2>&1)"
[ "$(deaths)" = "$before" ] ||
    fail "a reload of $took ms declared workers dead: $(grep -h 'is dead' "$T/coordinator.log" | head -3)"
[ "$(tsr generate a --prompt-ids 1,2,3 --max-tokens 8 --ids)" = "$want" ] || fail "a's tokens changed"
ok "a reload that held the loop $took ms (worker_timeout_ms 300) declared no worker dead"
