#!/bin/bash
# The layout chooser's cost model against measured decoding on this machine's CPU cluster.
#
# For each layout (tensor x pipeline: 1x1, 2x1, 1x2, 2x2, each one replica) of the
# 58M-parameter random Llama of bench/serve.sh (f32, max_batch 8), served by a real
# coordinator and tensor x pipeline workers on loopback (each with nproc / workers
# threads), it measures:
#   - one stream's decode rate: 3 requests of an 8-token prompt and 128 tokens, one
#     after the other, the best request's (tokens - 1) / (last - first);
#   - max_batch streams' aggregate tokens/s (4 requests each, prompts of 8-64 ids,
#     128 tokens);
# and prints beside them what `tessera plan --explain` estimates for the same file
# (MS/TOKEN as tokens/s, and TOK/S/REPL), with each worker's rate given as the planner
# takes it from a worker's --mem-gbs: bench/stream --read with that worker's threads
# (the best of three runs of 10 passes each), and the machine's cores and the workers'
# threads (--cores, --threads: workers that outnumber the cores share them).  The ratio is measured / estimated; the run fails when one
# is outside [0.5, 2].
#
#   bench/cost_model.sh        about 2 minutes on 2 cores
# Needs `make` plus build/bench/serve and build/bench/stream (make bench builds them).
# Exit status: 0 every ratio within [0.5, 2] and every request finished, 1 otherwise.
set -u
cd "$(dirname "$0")/.."
source bench/lib.sh
case "${1:-}" in
-h | --help) sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
'') ;;
*) echo "usage: bench/cost_model.sh" >&2; exit 2 ;;
esac
bench_setup bench/cost_model.sh "$BIN/tessera" "$BIN/tessera-coordinator" "$BIN/tessera-worker" \
    "$BUILD/bench/serve" "$BUILD/bench/stream"
trap 'exit 130' INT TERM
MODEL="$BUILD/models/serve58m" BATCH=8 NPROC=$(nproc)
if [ ! -f "$MODEL/config.json" ]; then
    "$BIN/tessera" model-init "$MODEL" --hidden 512 --intermediate 1376 --layers 8 --heads 8 \
        --kv-heads 8 --vocab 32000 --max-pos 1024 --dtype f32 --seed 5 --force > /dev/null || exit 1
fi
echo "== cost model against measured decoding"
echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $NPROC cores," \
     "load average $(cut -d' ' -f1-3 /proc/loadavg) at the start"
echo "model: $MODEL (58M parameters, f32, 8 layers); max_seq_len 512, max_batch $BATCH; one replica per layout"
echo
printf "%-7s %7s %8s | %9s %9s %6s | %9s %9s %6s\n" layout threads "GB/s" "1 stream" estimate ratio \
       "$BATCH strm" estimate ratio
RC=0
for lay in "1 1" "2 1" "1 2" "2 2"; do
    read -r tp pp <<< "$lay"
    nw=$((tp * pp)) threads=$((NPROC / (tp * pp))); [ "$threads" -lt 1 ] && threads=1
    gbs=$(for i in 1 2 3; do "$BUILD/bench/stream" --read --threads "$threads" --mib 1024; done |
          awk '{print $2}' | sort -g | tail -1)   # the best of three: the host is shared
    wp=$(free_port); cp=$(free_port)
    cat > "$T/d.yaml" <<YAML
version: 1
coordinator: {workers_endpoint: "tcp://127.0.0.1:$wp", control_endpoint: "tcp://127.0.0.1:$cp", security: none, canary_interval_ms: 0}
deployments:
  - name: m
    model: $(realpath "$MODEL")
    parallel: {tensor: $tp, pipeline: $pp, replicas: 1}
    max_seq_len: 512
    max_batch: $BATCH
YAML
    read -r est_ms est_batch <<< "$("$BIN/tessera" plan "$T/d.yaml" --explain --per-node "$nw" --mem-gbs "$gbs" \
                             --cores "$NPROC" --threads "$threads" |
        awk '$1 ~ /=/ { print $9, $10 }')"
    "$BIN/tessera-coordinator" --adopt-grace-ms 0 "$T/d.yaml" 2> "$T/c.log" & PIDS+=($!)
    for i in $(seq 0 $((nw - 1))); do
        TSR_THREADS=$threads "$BIN/tessera-worker" --coordinator "tcp://127.0.0.1:$wp" --name "k$i" \
            --mem-gbs "$gbs" 2> "$T/w$i.log" & PIDS+=($!)
    done
    C="$BIN/tessera --coordinator tcp://127.0.0.1:$cp"
    S="$BUILD/bench/serve --coordinator tcp://127.0.0.1:$cp --deployment m --vocab 32000 --json --timeout 120000"
    if ! $C status --wait-ready 120 > /dev/null; then echo "tp $tp pp $pp: not ready"; RC=1; continue; fi
    $S --requests-per-stream 1 --min-prompt 8 --max-prompt 8 --max-tokens 8 > /dev/null 2>&1
    $S --requests-per-stream 3 --min-prompt 8 --max-prompt 8 --max-tokens 128 > "$T/one.json" || RC=1
    $S --concurrency "$BATCH" --requests-per-stream 4 --min-prompt 8 --max-prompt 64 \
        --max-tokens 128 > "$T/many.json" || RC=1
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null; done
    PIDS=()
    read -r one <<< "$(json_get "$T/one.json" decode_best_tok_per_s)"
    read -r many <<< "$(json_get "$T/many.json" tok_per_s)"
    line=$(awk -v l="tp$tp pp$pp" -v th="$threads" -v g="$gbs" -v o="$one" -v em="$est_ms" -v m="$many" \
               -v eb="$est_batch" 'BEGIN {
        e1 = 1000 / em; r1 = o / e1; r2 = m / eb
        printf "%-7s %7d %8.1f | %9.1f %9.1f %5.2fx | %9.1f %9.1f %5.2fx", l, th, g, o, e1, r1, m, eb, r2
        bad = (r1 < 0.5 || r1 > 2 || r2 < 0.5 || r2 > 2)
        print (bad ? "  outside 2x" : "") }')
    echo "$line"
    case "$line" in *"outside 2x"*) RC=1 ;; esac
done
echo
echo "tokens/s; estimates from tessera plan --explain --per-node WORKERS --mem-gbs (each worker's"
echo "read bandwidth with its threads) --cores $NPROC --threads THREADS and the default 200 GFLOP/s;"
echo "ratio = measured / estimated"
exit $RC
