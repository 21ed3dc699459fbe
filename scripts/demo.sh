#!/bin/bash
# `make demo`: a coordinator and five CPU workers on this machine serving the
# tp=2 pp=2 deployment of configs/demo.yaml (a small random Llama checkpoint
# that `make` writes to build/models/demo).  Generates tokens, then text through
# the CLI and through the HTTP API, kills a worker
# to show the spare taking over, generates the same tokens again, then stops
# everything.
set -u
cd "$(dirname "$0")/.."
BIN=bin
LOGS=build/demo-logs
CEP=tcp://127.0.0.1:7401
mkdir -p "$LOGS"; rm -f "$LOGS"/*.log

if "$BIN/tessera" --config configs/demo.yaml --timeout 300 status > /dev/null 2>&1; then
    echo "demo: a coordinator already answers on $CEP; stop it first" >&2
    exit 1
fi
"$BIN/tessera" local configs/demo.yaml --workers 5 --log-dir "$LOGS" &
LOCAL=$!
trap 'kill -TERM $LOCAL 2>/dev/null; wait $LOCAL 2>/dev/null' EXIT

# `tessera local` makes the cluster's CURVE keys (configs/demo.yaml: keys_dir
# build/demo-keys) before it starts anything; the CLI needs its own.
for _ in $(seq 100); do [ -e build/demo-keys/cli.key ] && break; sleep 0.1; done

echo "== waiting for the deployment to be ready"
"$BIN/tessera" --config configs/demo.yaml status --wait-ready 15 || { echo "demo: not ready; logs in $LOGS" >&2; exit 1; }

echo
echo "== generate: prompt 1,2,3,4, 16 greedy tokens through 2 stages x 2 tensor ranks"
"$BIN/tessera" --config configs/demo.yaml generate tiny --prompt-ids 1,2,3,4 --max-tokens 16 || exit 1
echo
echo "== generate with a text prompt (the model is random: so is its text)"
"$BIN/tessera" --config configs/demo.yaml generate tiny --prompt "Tessera shards a model" \
    --max-tokens 24 || exit 1
echo
echo "== the same through the OpenAI-compatible HTTP API (POST /v1/completions)"
python3 - <<'PY' || exit 1
import json, urllib.request
req = urllib.request.Request("http://127.0.0.1:8000/v1/completions", data=json.dumps(
    {"model": "tiny", "prompt": "Tessera shards a model", "max_tokens": 24,
     "temperature": 0}).encode(), headers={"Content-Type": "application/json"})
r = json.load(urllib.request.urlopen(req, timeout=30))
print(repr(r["choices"][0]["text"]), "finish_reason", r["choices"][0]["finish_reason"],
      "usage", r["usage"])
PY

victim=$("$BIN/tessera" --config configs/demo.yaml status --json | python3 -c \
  'import json,sys; d=json.load(sys.stdin); r=d["deployments"][0]["replica_list"][0]["stages"][1]["ranks"][0]; print(r["worker"], r["pid"])')
set -- $victim
echo
echo "== kill -9 $1 (pid $2), which holds stage 1 tp 0; the idle worker takes over"
kill -9 "$2"
sleep 1.5
"$BIN/tessera" --config configs/demo.yaml status --wait-ready 5
echo
echo "== the same prompt again, now served with the spare wired in"
"$BIN/tessera" --config configs/demo.yaml generate tiny --prompt-ids 1,2,3,4 --max-tokens 16 || exit 1
echo
echo "== demo done; logs in $LOGS"
