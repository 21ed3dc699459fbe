#!/bin/bash
# Replicas that follow load: a step from 1 stream to 32 and back on 8 CPU workers.
#
# A deployment with `replicas: {min: 1, max: 8}` (max_batch 4, scale_up_queue_ms 200,
# scale_up_window_s 2, scale_down_idle_s 5) of a small random Llama made by
# `tessera model-init` (bench/lib.sh's small one) is served by a real coordinator and 8 workers on loopback and
# loaded by bench/serve (C streams, each sending its next request when the last
# finished).  One stream for 6 s, then 32 streams for --load-s seconds (default 40),
# then one stream again until the replicas are back at 1 (at most 60 s).  The
# coordinator's status is read every 200 ms.  It prints:
#   - the time from the step up to the first replica added and to the most replicas
#     the load reached (each counted from when the 32 streams started), and how many;
#   - the time from the step down to the count back at 1;
#   - tokens/s and TTFT p50/p99 of the 32 streams, against the same 32 streams on a
#     fixed layout of the same 8 workers (replicas: 8) started ready;
#   - failed requests (the run fails when any did).
# On 2 cores the replicas share the cores: more replicas add batch slots, not compute,
# so the fixed layout's tokens/s is the ceiling and the figure to compare with.
#
#   bench/autoscale.sh [--load-s S]     about 2.5 minutes at the default
# Needs `make` plus build/bench/serve (make bench builds it).
# Exit status: 0 every request finished and the replicas went up and back down,
# 1 otherwise (the reason is printed), 2 bad usage.
set -u
cd "$(dirname "$0")/.."
source bench/lib.sh
LOAD_S=40
while [ $# -gt 0 ]; do
    case "$1" in
    --load-s)
        case "${2:-}" in '' | *[!0-9]*) echo "bench/autoscale.sh: --load-s takes whole seconds" >&2; exit 2 ;; esac
        LOAD_S=$2; shift ;;
    -h | --help) sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "usage: bench/autoscale.sh [--load-s S]" >&2; exit 2 ;;
    esac
    shift
done
bench_setup bench/autoscale.sh "$BIN/tessera" "$BIN/tessera-coordinator" "$BIN/tessera-worker" \
    "$BUILD/bench/serve"
trap 'exit 130' INT TERM
NW=8 MAX_TOKENS=64 QUEUE_MS=200 WINDOW_S=2 IDLE_S=5
bench_small_model
now_ms() { echo $(( $(date +%s%N) / 1000000 )); }

# start REPLICAS: a coordinator and NW workers; C is the CLI, S the load generator
start() {
    local wp cp; wp=$(free_port); cp=$(free_port)
    cat > "$T/d.yaml" <<YAML
version: 1
coordinator: {workers_endpoint: "tcp://127.0.0.1:$wp", control_endpoint: "tcp://127.0.0.1:$cp", security: none, canary_interval_ms: 0}
deployments:
  - name: m
    model: $(realpath "$MODEL")
    parallel: {tensor: 1, pipeline: 1, replicas: $1}
    max_seq_len: 512
    max_batch: 4
YAML
    [ "$1" = 1 ] || [ "${1#\{}" = "$1" ] || printf '    scale_up_queue_ms: %s\n    scale_up_window_s: %s\n    scale_down_idle_s: %s\n' \
        "$QUEUE_MS" "$WINDOW_S" "$IDLE_S" >> "$T/d.yaml"
    "$BIN/tessera-coordinator" --adopt-grace-ms 0 "$T/d.yaml" 2> "$T/c.log" & PIDS+=($!)
    local i
    for i in $(seq 0 $((NW - 1))); do
        TSR_THREADS=1 "$BIN/tessera-worker" --coordinator "tcp://127.0.0.1:$wp" --name "a$i" \
            2> "$T/w$i.log" & PIDS+=($!)
    done
    C="$BIN/tessera --coordinator tcp://127.0.0.1:$cp"
    S="$BUILD/bench/serve --coordinator tcp://127.0.0.1:$cp --deployment m --vocab 1024 --json --timeout 120000 --min-prompt 8 --max-prompt 64 --max-tokens $MAX_TOKENS"
    $C status --wait-ready 120 > /dev/null || { echo "not ready after 120 s"; $C status; exit 1; }
}
stop() {
    local p
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null; done
    PIDS=()
}
replicas() { $C status --json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["deployments"][0]["replicas"])' 2>/dev/null || echo "?"; }

echo "== replicas that follow load"
echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores," \
     "load average $(cut -d' ' -f1-3 /proc/loadavg) at the start"
echo "model: $MODEL (hidden 256, 4 layers, vocab 1024, f32); $NW cpu workers, 1 thread each;" \
     "max_batch 4; requests of 8-64 prompt ids and $MAX_TOKENS tokens, greedy"
echo "rule: replicas {min: 1, max: $NW}, scale_up_queue_ms $QUEUE_MS, scale_up_window_s $WINDOW_S," \
     "scale_down_idle_s $IDLE_S; load: 1 stream 6 s, 32 streams ${LOAD_S} s, then 1 stream"
RC=0

start "{min: 1, max: $NW}"
$S --concurrency 1 --duration 6 > "$T/low1.json" 2> "$T/low1.err" || RC=1
t0=$(now_ms)
$S --concurrency 32 --duration "$LOAD_S" > "$T/high.json" 2> "$T/high.err" &
LOAD=$!
first_up="" most=1 most_at=0
while kill -0 "$LOAD" 2>/dev/null; do
    r=$(replicas)
    if [ "$r" != "?" ] && [ "$r" -gt 1 ] && [ -z "$first_up" ]; then first_up=$(( $(now_ms) - t0 )); fi
    if [ "$r" != "?" ] && [ "$r" -gt "$most" ]; then most=$r; most_at=$(( $(now_ms) - t0 )); fi
    sleep 0.2
done
wait "$LOAD" || { RC=1; echo "the 32 streams had failures: $(head -c 300 "$T/high.err")"; }
t1=$(now_ms)
$S --concurrency 1 --duration 60 > "$T/low2.json" 2> "$T/low2.err" &
LOW=$!
back=""
while kill -0 "$LOW" 2>/dev/null; do
    r=$(replicas)
    if [ "$r" = 1 ]; then back=$(( $(now_ms) - t1 )); break; fi
    sleep 0.2
done
kill "$LOW" 2>/dev/null; wait "$LOW" 2>/dev/null
ups=$($C status --json | python3 -c 'import json,sys; a=json.load(sys.stdin)["deployments"][0]["autoscale"]; print(a["ups"], a["downs"])')
stop
read -r a_done a_failed a_tps a_t50 a_t99 <<< "$(json_get "$T/high.json" done failed tok_per_s ttft_p50_ms ttft_p99_ms)"

start "$NW"
$S --concurrency 1 --duration 2 > /dev/null 2>&1
$S --concurrency 32 --duration "$LOAD_S" > "$T/fixed.json" 2> "$T/fixed.err" || { RC=1; echo "fixed layout: failures"; }
stop
read -r f_done f_failed f_tps f_t50 f_t99 <<< "$(json_get "$T/fixed.json" done failed tok_per_s ttft_p50_ms ttft_p99_ms)"

echo
printf "step up (1 -> 32 streams): first replica added after %s, %d replicas reached after %s\n" \
    "$([ -n "$first_up" ] && awk -v t="$first_up" 'BEGIN {printf "%.1f s", t / 1000}' || echo never)" \
    "$most" "$(awk -v t="$most_at" 'BEGIN {printf "%.1f s", t / 1000}')"
printf "step down (32 -> 1 stream): back at 1 replica after %s\n" \
    "$([ -n "$back" ] && awk -v t="$back" 'BEGIN {printf "%.1f s", t / 1000}' || echo "more than 60 s")"
echo "decisions: $ups (up, down)"
printf "%-36s %9s %9s %10s %10s\n" "32 streams for ${LOAD_S} s" requests "tok/s" "TTFT p50" "TTFT p99"
printf "%-36s %9s %9.1f %8.0fms %8.0fms\n" "following load (from 1 replica)" "$a_done/${a_failed}F" "$a_tps" "$a_t50" "$a_t99"
printf "%-36s %9s %9.1f %8.0fms %8.0fms\n" "fixed: $NW replicas, ready before" "$f_done/${f_failed}F" "$f_tps" "$f_t50" "$f_t99"
[ "$a_failed" = 0 ] && [ "$f_failed" = 0 ] || { echo "requests failed"; RC=1; }
[ "$most" -gt 1 ] || { echo "the replicas never grew"; RC=1; }
[ -n "$back" ] || { echo "the replicas did not come back to 1 within 60 s"; RC=1; }
exit $RC
