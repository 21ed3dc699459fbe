#!/bin/bash
# Changing a serving deployment's cut by editing its file, while clients stream.
#
# A 270M-parameter random Llama (f32, about 1.1 GB: hidden 1024, 16 layers, vocab 32000,
# made once by `tessera model-init`) is served by a real coordinator and 6 CPU workers
# on loopback (1 thread each), (tensor, pipeline, replicas) (2, 1, 2), which leaves two
# idle workers: one replica of each cut below.  bench/serve loads it (4 streams, each
# sending its next request when the last finished; prompts of 8-64 ids, 48 tokens).
# Four phases of --phase-s seconds (default 25), the file edited and `tessera reload`ed
# --edit-s seconds (default 5) into each:
#   1. steady: nothing changes (the baseline);
#   2. -> (1, 2, 2), 3. -> (1, 1, 4), 4. -> (2, 1, 2): each built beside the running cut
#      as far as the idle workers go, swapped in, the old replicas finishing their
#      requests in place, the rest loading on the workers they free.
# For each it prints failed requests, ITL p99 and the longest gap between two tokens of
# one request, TTFT p99 and the longest, and for 2-4 the time from the reload to the new
# layout serving whole; last, the longest gap against the target of twice the steady
# phase's ITL p99 plus one step (its ITL p50).  Exit status: 0 no request failed and
# every layout came up, 1 otherwise.
#
# --small serves the 58M model of bench/serve.sh instead (f32, 230 MB: hidden 512, 8
# layers), whose loads cost the serving workers a quarter as much.
#
#   bench/reshard.sh [--phase-s S] [--edit-s S] [--small]     about 2 minutes
# Needs `make` plus build/bench/serve (make bench builds it).
set -u
cd "$(dirname "$0")/.."
source bench/lib.sh
PHASE_S=25 EDIT_S=5 SMALL=0
while [ $# -gt 0 ]; do
    case "$1" in
    --phase-s | --edit-s)
        case "${2:-}" in '' | *[!0-9]*) echo "bench/reshard.sh: $1 takes whole seconds" >&2; exit 2 ;; esac
        [ "$1" = --phase-s ] && PHASE_S=$2 || EDIT_S=$2
        shift ;;
    --small) SMALL=1 ;;
    -h | --help) sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "usage: bench/reshard.sh [--phase-s S] [--edit-s S] [--small]" >&2; exit 2 ;;
    esac
    shift
done
[ "$EDIT_S" -lt "$PHASE_S" ] || { echo "bench/reshard.sh: --edit-s must be below --phase-s" >&2; exit 2; }
bench_setup bench/reshard.sh "$BIN/tessera" "$BIN/tessera-coordinator" "$BIN/tessera-worker" \
    "$BUILD/bench/serve"
trap 'exit 130' INT TERM
NW=6
if [ "$SMALL" = 1 ]; then
    MODEL="$BUILD/models/serve58m" ABOUT="58M parameters, f32, about 230 MB"
    [ -f "$MODEL/config.json" ] ||
        "$BIN/tessera" model-init "$MODEL" --hidden 512 --intermediate 1376 --layers 8 --heads 8 \
            --kv-heads 8 --vocab 32000 --max-pos 1024 --dtype f32 --seed 5 --force > /dev/null || exit 1
else
    MODEL="$BUILD/models/reshard270m" ABOUT="270M parameters, f32, about 1.1 GB"
    [ -f "$MODEL/config.json" ] ||
        "$BIN/tessera" model-init "$MODEL" --hidden 1024 --intermediate 2752 --layers 16 --heads 16 \
            --kv-heads 8 --vocab 32000 --max-pos 1024 --dtype f32 --seed 7 --force > /dev/null || exit 1
fi
now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
WP=$(free_port) CP=$(free_port)
yaml() {
    cat > "$T/d.yaml" <<YAML
version: 1
coordinator: {workers_endpoint: "tcp://127.0.0.1:$WP", control_endpoint: "tcp://127.0.0.1:$CP", security: none}
deployments:
  - name: m
    model: $(realpath "$MODEL")
    parallel: {tensor: $1, pipeline: $2, replicas: $3}
    max_seq_len: 512
    max_batch: 8
YAML
}
C="$BIN/tessera --coordinator tcp://127.0.0.1:$CP"
S="$BUILD/bench/serve --coordinator tcp://127.0.0.1:$CP --deployment m --vocab 32000 --json --timeout 120000 --concurrency 4 --min-prompt 8 --max-prompt 64 --max-tokens 48"
layout() { $C status --json 2>/dev/null | python3 -c 'import json,sys; d=json.load(sys.stdin)["deployments"][0]; print(d["tensor"], d["pipeline"], d["replicas"], d["state"], (d.get("reshard") or {}).get("doing", ""))' 2>/dev/null; }

echo "== changing the cut while clients stream"
echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores," \
     "load average $(cut -d' ' -f1-3 /proc/loadavg) at the start"
echo "model: $MODEL ($ABOUT); $NW cpu workers, 1 thread each;" \
     "4 streams of 48-token requests; phases of $PHASE_S s, the edit $EDIT_S s in"
yaml 2 1 2
"$BIN/tessera-coordinator" --adopt-grace-ms 0 "$T/d.yaml" 2> "$T/c.log" & PIDS+=($!)
for i in $(seq 0 $((NW - 1))); do
    TSR_THREADS=1 "$BIN/tessera-worker" --coordinator "tcp://127.0.0.1:$WP" --name "r$i" \
        2> "$T/w$i.log" & PIDS+=($!)
done
$C status --wait-ready 180 > /dev/null || { echo "not ready after 180 s"; $C status; exit 1; }
$S --concurrency 1 --requests-per-stream 1 --max-tokens 4 > /dev/null 2>&1   # first-call costs
RC=0
printf "\n%-34s %6s %9s %9s %9s %9s %12s\n" phase failed "ITL p99" "ITL max" "TTFT p99" "TTFT max" "to serving"
# phase LABEL [TENSOR PIPELINE REPLICAS]: PHASE_S s of load, the file edited EDIT_S s in
WORST=0
phase() {
    local label=$1 t0 took="-"
    $S --duration "$PHASE_S" > "$T/p.json" 2> "$T/p.err" &
    local load=$!
    sleep "$EDIT_S"
    if [ $# -gt 1 ]; then
        yaml "$2" "$3" "$4"
        t0=$(now_ms)
        $C reload > "$T/reload.txt" || { echo "$label: reload refused: $(cat "$T/reload.txt")"; RC=1; }
        while :; do
            read -r tp pp rep st doing <<< "$(layout)"
            [ "$tp" = "$2" ] && [ "$pp" = "$3" ] && [ "$rep" = "$4" ] && [ "$st" = ready ] &&
                [ -z "$doing" ] && break
            [ $(( $(now_ms) - t0 )) -gt 120000 ] && { echo "$label: not serving after 120 s"; RC=1; break; }
            sleep 0.05
        done
        took=$(awk -v t=$(( $(now_ms) - t0 )) 'BEGIN {printf "%.2f s", t / 1000}')
        sed 's/^/  /' "$T/reload.txt" | tail -n +2 > "$T/how.txt"
    fi
    wait "$load" || RC=1
    read -r failed i99 imax t99 tmax i50 <<< "$(json_get "$T/p.json" failed itl_p99_ms itl_max_ms ttft_p99_ms ttft_max_ms itl_p50_ms)"
    [ "$failed" = 0 ] || RC=1
    if [ $# -gt 1 ]; then
        WORST=$(awk -v a="$WORST" -v b="$imax" 'BEGIN {print (b > a) ? b : a}')
    else
        STEADY_P99=$i99 STEADY_STEP=$i50
    fi
    printf "%-34s %6s %7.0fms %7.0fms %7.0fms %7.0fms %12s\n" "$label" "$failed" "$i99" "$imax" "$t99" "$tmax" "$took"
    [ -s "$T/how.txt" ] && cat "$T/how.txt" && rm -f "$T/how.txt"
}
phase "steady, (2, 1, 2)"
phase "-> (1, 2, 2): 1 of 2 beside" 1 2 2
phase "-> (1, 1, 4): 2 of 4 beside" 1 1 4
phase "-> (2, 1, 2): 1 of 2 beside" 2 1 2
replayed=$($C status --json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["coordinator"]["stats"]["requests_replayed"])')
awk -v w="$WORST" -v p="$STEADY_P99" -v s="$STEADY_STEP" -v r="$replayed" 'BEGIN {
    t = 2 * p + s
    printf "\nlongest token gap while the cut changed: %.0f ms; target 2 x steady ITL p99 + one step" \
           " (p50) = 2 x %.0f + %.0f = %.0f ms: %s; requests moved and prefilled again: %d\n",
           w, p, s, t, (w <= t) ? "met" : "not met", r }'
exit $RC
