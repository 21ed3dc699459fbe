#!/bin/bash
# `make demo`: a coordinator and five CPU workers on this machine serving the
# tiny tp=2 pp=2 deployment of configs/demo.yaml.  Shows the placement, kills
# a worker to show the spare taking over, then stops everything.
set -u
cd "$(dirname "$0")/.."
BIN=bin
LOGS=build/demo-logs
CEP=tcp://127.0.0.1:7401
mkdir -p "$LOGS"; rm -f "$LOGS"/*.log

if "$BIN/tessera" --coordinator "$CEP" --timeout 300 status > /dev/null 2>&1; then
    echo "demo: a coordinator already answers on $CEP; stop it first" >&2
    exit 1
fi
"$BIN/tessera" local configs/demo.yaml --workers 5 --log-dir "$LOGS" &
LOCAL=$!
trap 'kill -TERM $LOCAL 2>/dev/null; wait $LOCAL 2>/dev/null' EXIT

echo "== waiting for the deployment to be ready"
"$BIN/tessera" --coordinator "$CEP" status --wait-ready 15 || { echo "demo: not ready; logs in $LOGS" >&2; exit 1; }

victim=$("$BIN/tessera" --coordinator "$CEP" status --json | python3 -c \
  'import json,sys; d=json.load(sys.stdin); r=d["deployments"][0]["replica_list"][0]["stages"][1]["ranks"][0]; print(r["worker"], r["pid"])')
set -- $victim
echo
echo "== kill -9 $1 (pid $2), which holds stage 1 tp 0; the idle worker takes over"
kill -9 "$2"
sleep 1.5
"$BIN/tessera" --coordinator "$CEP" status --wait-ready 5
echo
echo "== demo done; logs in $LOGS"
