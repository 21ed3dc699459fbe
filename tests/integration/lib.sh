# Helpers for integration tests: real processes on loopback, each test in
# its own temp directory with its own ports.  Everything started is killed
# on exit.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BIN="${TSR_BIN:-build/test/bin}"
case "$BIN" in /*) ;; *) BIN="$ROOT/$BIN" ;; esac
T="$(mktemp -d /tmp/tsr-it.XXXXXX)"
PIDS=()
# Sanitizer builds are slower; give them more time where a test waits.
SLOW="${TSR_SLOW:-0}"

cleanup() {
    local rc=$?
    # SIGTERM first, so sanitizer builds run their exit-time leak checks.
    for p in "${PIDS[@]}"; do kill -CONT "$p" 2>/dev/null; kill -TERM "$p" 2>/dev/null; done
    local end=$(( $(date +%s) + 5 ))
    for p in "${PIDS[@]}"; do
        while kill -0 "$p" 2>/dev/null && [ "$(date +%s)" -lt "$end" ]; do sleep 0.05; done
        kill -9 "$p" 2>/dev/null
    done
    wait 2>/dev/null || true
    # A sanitizer report in any daemon's log fails the test.
    local pat="ERROR: (AddressSanitizer|LeakSanitizer)|runtime error:|WARNING: ThreadSanitizer"
    if grep -lE "$pat" "$T"/*.log > /dev/null 2>&1; then
        echo "FAIL: sanitizer report in a daemon log"
        grep -hE -A12 "$pat" "$T"/*.log | head -60
        rc=1
    fi
    if [ "${KEEP_TMP:-0}" != 1 ]; then rm -rf "$T"; fi
    exit $rc
}
trap cleanup EXIT

fail() {
    echo "FAIL: $*"
    for f in "$T"/*.log; do [ -f "$f" ] && { echo "--- $f"; tail -25 "$f"; }; done
    exit 1
}
ok() { echo "ok: $*"; }

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

now_ms() { echo $(( $(date +%s%N) / 1000000 )); }

WPORT=$(free_port); CPORT=$(free_port)
while [ "$CPORT" = "$WPORT" ]; do CPORT=$(free_port); done
WEP="tcp://127.0.0.1:$WPORT"
CEP="tcp://127.0.0.1:$CPORT"
MODELS="$ROOT/configs/models"
# A small random checkpoint (GQA: 8 heads over 4 KV heads, 8 layers) for the
# workers to load.
MODEL="$T/model"
"$BIN/tessera" model-init "$MODEL" --hidden 64 --intermediate 128 --layers 8 --heads 8 \
    --kv-heads 4 --vocab 256 --max-pos 256 --seed 5 > "$T/model-init.log" 2>&1 \
    || { echo "FAIL: model-init: $(cat "$T/model-init.log")"; exit 1; }

# Every test runs with CURVE (the default): a key store with the CLI's key;
# start_worker adds each worker's.  TESSERA_KEYS is how the CLI and the
# workers find it.
KEYS="$T/keys"
{ "$BIN/tessera" keys init "$KEYS" && "$BIN/tessera" keys add "$KEYS" cli; } > "$T/keys.log" 2>&1 \
    || { echo "FAIL: keys: $(cat "$T/keys.log")"; exit 1; }
export TESSERA_KEYS="$KEYS"
unset TESSERA_IDENTITY

# coordinator_yaml [LINE...]: the head of a deployment file for this test's endpoints
# and key store, with extra coordinator keys given as lines ("http_endpoint: ...").
coordinator_yaml() {
    printf 'version: 1\ncoordinator:\n  workers_endpoint: %s\n  control_endpoint: %s\n' "$WEP" "$CEP"
    printf '  heartbeat_interval_ms: 100\n  worker_timeout_ms: 1000\n  keys_dir: %s\n' "$KEYS"
    local line
    for line in "$@"; do printf '  %s\n' "$line"; done
}

# write_yaml FILE TP PP REPLICAS [NAME] [MODEL] [DEVICE]
write_yaml() {
    { coordinator_yaml; cat <<YAML
deployments:
  - name: ${5:-tiny}
    model: ${6:-$MODEL}
    device: ${7:-cpu}
    parallel:
      tensor: $2
      pipeline: $3
      replicas: $4
    max_seq_len: 256
YAML
    } > "$1"
}

# start_coord YAML [args...]: sets COORD_PID; log in $T/coordinator.log
start_coord() {
    local yaml="$1"; shift
    "$BIN/tessera-coordinator" "$@" "$yaml" >> "$T/coordinator.log" 2>&1 &
    COORD_PID=$!
    PIDS+=("$COORD_PID")
}

# start_worker NAME [args...]: pid in WPID[NAME]; log in $T/NAME.log.
# WORKER_BIN=PATH starts another build of the worker.
declare -A WPID
start_worker() {
    local name="$1"; shift
    [ -e "$KEYS/$name.key" ] || "$BIN/tessera" keys add "$KEYS" "$name" > /dev/null \
        || fail "cannot add a key for $name"
    "${WORKER_BIN:-$BIN/tessera-worker}" --coordinator "$WEP" --name "$name" "$@" >> "$T/$name.log" 2>&1 &
    WPID[$name]=$!
    PIDS+=("$!")
}

# use_fake_nccl_worker: later start_worker calls start the worker whose cuda
# row is the CPU engine over a fake NCCL (tests/integration/fake_nccl_worker.c;
# make all-tests builds it), with a stand-in GPU of 4 GiB.
use_fake_nccl_worker() {
    WORKER_BIN="${TSR_BUILD:-build/test}/tests/tessera-worker-fake-nccl"
    case "$WORKER_BIN" in /*) ;; *) WORKER_BIN="$ROOT/$WORKER_BIN" ;; esac
    [ -x "$WORKER_BIN" ] || fail "no $WORKER_BIN (make all-tests builds it)"
    export TSR_TEST_FAKE_CUDA_MIB=4096
}

# nccl_test_deployment NAME DEVICE TP PP [KEY: VALUE]...: a deployments: entry of the
# NCCL tests, with the extra keys given.  A cuda one gets 8 MiB of KV; a cpu one the bf16
# types a cuda one uses by default, so that their tokens compare.
nccl_test_deployment() {
    cat <<YAML
  - name: $1
    model: $MODEL
    device: $2
    parallel: {tensor: $3, pipeline: $4, replicas: 1}
    max_seq_len: 256
YAML
    if [ "$2" = cuda ]; then echo "    kv_cache_mib: 8"
    else printf '    kv_dtype: bf16\n    matmul_dtype: bf16\n'; fi
    local kv
    for kv in "${@:5}"; do echo "    $kv"; done
}

# duo_deployment [KEY: VALUE]...: the cuda tp=2 deployment "duo" of the NCCL tests.
duo_deployment() { nccl_test_deployment duo cuda 2 1 "$@"; }

# start_fake_nccl_gpus N: N fake-NCCL workers g0.. whose groups span
# processes (TSR_TEST_FAKE_NCCL=tcp), each on its own stand-in GPU.
start_fake_nccl_gpus() {
    use_fake_nccl_worker
    export TSR_TEST_FAKE_NCCL=tcp
    local i
    for ((i = 0; i < $1; i++)); do start_worker "g$i" --device cuda --device-index "$i"; done
}

tsr() { "$BIN/tessera" --coordinator "$CEP" "$@"; }
status_json() { tsr status --json 2>/dev/null; }

# jq-like: status_json | jget 'EXPR' where d is the document.
jget() { python3 -c 'import json,sys; d=json.load(sys.stdin); r=eval(sys.argv[1]); print(json.dumps(r) if not isinstance(r,str) else r)' "$1"; }

# wait_until SECONDS CMD...: polls CMD every 50 ms; returns 1 on timeout.
wait_until() {
    poll_until "$1" 0.05 "${@:2}"
}
# poll_until SECS INTERVAL CMD...: wait_until, looking every INTERVAL
# seconds (for conditions that last less than wait_until's 50 ms).
poll_until() {
    local secs="$1" every="$2"; shift 2
    [ "$SLOW" = 1 ] && secs=$((secs * 3))
    local end=$(( $(now_ms) + secs * 1000 ))
    while [ "$(now_ms)" -lt "$end" ]; do
        "$@" && return 0
        sleep "$every"
    done
    return 1
}

all_ready() { tsr --timeout 1000 status --wait-ready 0 > /dev/null 2>&1; }

# expect_dtype_reload_refused KEY NOW BAD: editing deployment tiny's KEY
# from NOW to BAD is refused at reload, naming file, line, column and key,
# and the deployment keeps serving with KEY still NOW.
expect_dtype_reload_refused() {
    local key=$1 now=$2 bad=$3 held types="f32 or bf16"
    [ "$key" = kv_dtype ] && types="f32, bf16 or int8"
    [ "$key" = weights_dtype ] && types="or int8"
    sed -i "s/    $key: $now/    $key: $bad/" "$T/d.yaml"
    tsr reload 2> "$T/err.txt" && fail "a reload with $key $bad was accepted"
    grep -qE "d.yaml:[0-9]+:[0-9]+: deployments\[0\].$key: expected auto,? $types, got '$bad'" "$T/err.txt" ||
        fail "bad reload message: $(cat "$T/err.txt")"
    tsr generate tiny --prompt-ids 5,7,1 --max-tokens 4 --ids > /dev/null ||
        fail "generate after the refused reload failed"
    held=$(status_json | jget "d['deployments'][0]['$key']")
    [ "$held" = "$now" ] || fail "the refused reload changed $key to $held"
    ok "$key $bad refused, the running deployment kept ($now, still generating)"
}

# expect_reference_tokens REF_FLAGS...: three short greedy prompts on
# deployment tiny give the NumPy reference's tokens (run with REF_FLAGS).
expect_reference_tokens() {
    local k ids want got
    for k in 0 1 2; do
        ids="$((k + 5)),7,$((k * 11 + 1))"
        want=$(python3 "$ROOT/tests/reference/llama_ref.py" "$MODEL" --prompt-ids "$ids" \
               --max-tokens 16 --stop-at-eos "$@") || fail "reference $k ($*) failed"
        got=$(tsr generate tiny --prompt-ids "$ids" --max-tokens 16 --ids | tr ' ' ',') ||
            fail "generate $k failed"
        [ "$got" = "$want" ] || fail "prompt $ids: tessera $got, reference ($*) $want"
    done
}

# piece_holder R S T: name of the worker holding replica R stage S tp T.
piece_holder() {
    status_json | jget "d['deployments'][0]['replica_list'][$1]['stages'][$2]['ranks'][$3]['worker'] or '-'"
}
# worker_field NAME FIELD
worker_field() {
    status_json | jget "[w.get('$2') for w in d['workers'] if w['name']=='$1'][0]"
}

# stream_long_request: starts a 250-token request in the background (ids to
# $T/out, errors to $T/err, pid in GEN) and returns once its first token has
# arrived, so what follows lands mid-request.  The whole stream takes about
# 50 ms on the tests' model, so the first token is looked for every
# millisecond or so (first_token_arrived).
stream_long_request() {
    tsr generate tiny --prompt-ids 1,2,3 --max-tokens 250 --ids --token-timeout 60000 \
        > "$T/out" 2> "$T/err" &
    GEN=$!
    first_token_arrived
}
# first_token_arrived: waits until $T/out holds the stream's first token.
first_token_arrived() {
    started() { [ -s "$T/out" ]; }
    poll_until 10 0.001 started || fail "no token arrived"
}

# stream_client K MAX_TOKENS: requests of prompt 1,2,K one after the other until $T/stop
# exists (60 s at most): the last stream's ids in $T/cK.out, errors in $T/cK.err, a line
# in $T/failed for each request that failed.  Run it in the background.
stream_client() {
    local end=$(( $(date +%s) + 60 ))
    while [ ! -e "$T/stop" ] && [ "$(date +%s)" -lt "$end" ]; do
        tsr generate tiny --prompt-ids "1,2,$1" --max-tokens "$2" --ids --token-timeout 30000 \
            > "$T/c$1.next" 2>> "$T/c$1.err" || echo "client $1" >> "$T/failed"
        [ -s "$T/c$1.next" ] && mv "$T/c$1.next" "$T/c$1.out"
    done
}

# clients_done_with_reference MAX_TOKENS K...: stops the stream clients (CLIENTS, their
# pids), fails if any request failed, and checks each K's last stream against the NumPy
# reference.
clients_done_with_reference() {
    local max=$1 k want got p; shift
    touch "$T/stop"
    for p in "${CLIENTS[@]}"; do wait "$p"; done
    [ -e "$T/failed" ] && fail "requests failed: $(cat "$T/failed") $(cat "$T"/c*.err)"
    for k in "$@"; do
        want=$(python3 "$ROOT/tests/reference/llama_ref.py" "$MODEL" --prompt-ids "1,2,$k" \
               --max-tokens "$max" --stop-at-eos) || fail "reference $k failed"
        got=$(tr ' ' ',' < "$T/c$k.out" | sed 's/,$//')
        [ "$got" = "$want" ] || fail "client $k: tessera $got, reference $want"
    done
}
