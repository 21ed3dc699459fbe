# lib.sh: what the loopback benchmark scripts share (sourced from the
# repository root): the binaries, a scratch folder whose processes die with
# the script, free ports, the small model, and a one-worker cluster.
BIN="${TSR_BIN:-bin}" BUILD="${TSR_BUILD:-build}"
PIDS=()

# bench_setup NAME FILE...: NAME's scratch folder $T, cleaned up (and its
# processes killed) on exit, once every FILE is an executable.
bench_setup() {
    local name="$1"; shift
    for f in "$@"; do
        [ -x "$f" ] || { echo "$name: $f is missing (make bench builds it)" >&2; exit 1; }
    done
    T=$(mktemp -d "/tmp/tsr-$(basename "$name" .sh).XXXXXX")
    trap 'for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null; done; wait 2>/dev/null; rm -rf "$T"' EXIT
}

# bench_no_args SCRIPT ARG...: a script that takes no arguments: -h or
# --help prints its header comment (up to `set -u`), anything else its usage.
bench_no_args() {
    local script="$1"; shift
    case "${1:-}" in
    -h | --help) sed -n '2,/^set -u/p' "$script" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    "") ;;
    *) echo "usage: $script" >&2; exit 2 ;;
    esac
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# The small model both serving benchmarks use: hidden 256, 4 layers, f32.
bench_small_model() {
    MODEL="$BUILD/models/http-bench"
    [ -f "$MODEL/tokenizer.json" ] && return 0
    "$BIN/tessera" model-init "$MODEL" --hidden 256 --intermediate 688 --layers 4 --heads 8 \
        --kv-heads 4 --vocab 1024 --max-pos 512 --seed 3 --force > /dev/null || exit 1
}

# bench_one_worker NAME: a coordinator on $T/d.yaml (workers on port $WP,
# control on $CP) and one CPU worker, ready.
bench_one_worker() {
    "$BIN/tessera-coordinator" "$T/d.yaml" > "$T/coord.log" 2>&1 & PIDS+=($!)
    "$BIN/tessera-worker" --coordinator "tcp://127.0.0.1:$WP" --name w0 > "$T/w0.log" 2>&1 & PIDS+=($!)
    "$BIN/tessera" --coordinator "tcp://127.0.0.1:$CP" status --wait-ready 30 > /dev/null ||
        { echo "$1: not ready"; cat "$T"/*.log; exit 1; }
}

# json_get FILE KEY...: the keys' values in FILE's JSON object, space-separated ("-": null).
json_get() {
    python3 - "$@" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(" ".join("-" if d.get(k) is None else str(d[k]) for k in sys.argv[2:]))
PY
}
