#!/bin/bash
# Data-plane benchmark: a ~100M-parameter random Llama (f32) made by
# `tessera model-init`, served by real coordinator and worker processes on
# this machine.  For tp in {1,2} x pp in {1,2} it reports prefill tokens/s on
# a 128-token prompt, decode tokens/s, each worker's peak resident memory
# against its share of the weights plus its KV cache, the overhead of each
# layout against tp=1 pp=1, and the time from the YAML to every worker
# ready.  Decode is compared with the memory-bandwidth bound: weight bytes
# divided by a STREAM-like copy bandwidth (bench/stream.c).
#   bench/data.sh            (after `make`; about 3 minutes on 2 cores)
set -u
cd "$(dirname "$0")/.."
BIN="${TSR_BIN:-bin}" BUILD="${TSR_BUILD:-build}"
MODEL="$BUILD/models/bench100m"
T=$(mktemp -d /tmp/tsr-bench.XXXXXX)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null; done; wait 2>/dev/null; rm -rf "$T"; }
trap cleanup EXIT
NPROC=$(nproc)

if [ ! -f "$MODEL/config.json" ]; then
    "$BIN/tessera" model-init "$MODEL" --hidden 768 --intermediate 2048 --layers 12 --heads 12 \
        --kv-heads 4 --vocab 16000 --max-pos 1024 --dtype f32 --seed 3 --force || exit 1
fi
WBYTES=$(stat -c %s "$MODEL/model.safetensors")
S1=$("$BUILD/bench/stream" --threads 1); SN=$("$BUILD/bench/stream" --threads "$NPROC")
BW1=$(echo "$S1" | awk '{print $2}'); BWN=$(echo "$SN" | awk '{print $2}')
echo "== data-plane benchmark"
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $NPROC cores"
echo "model: $MODEL, $(python3 -c "import json;c=json.load(open('$MODEL/config.json'));print('hidden %d, %d layers, %d heads / %d kv heads, intermediate %d, vocab %d' % (c['hidden_size'],c['num_hidden_layers'],c['num_attention_heads'],c['num_key_value_heads'],c['intermediate_size'],c['vocab_size']))"), $((WBYTES / 1000000)) MB of f32 weights"
echo "STREAM-like copy bandwidth (read + written): ${BW1} GB/s (1 thread), ${BWN} GB/s ($NPROC threads);" \
     "memcpy for comparison: $(echo "$S1" | awk '{print $4}') / $(echo "$SN" | awk '{print $4}') GB/s"
awk -v b1="$BW1" -v bn="$BWN" -v w="$WBYTES" -v n="$NPROC" 'BEGIN {
    printf "decode bound (weight bytes / copy bandwidth): %.1f tokens/s with 1 thread, %.1f with %d\n", b1*1e9/w, bn*1e9/w, n }'
PROMPT128=$(python3 -c 'print(",".join(str((i * 37) % 15000 + 3) for i in range(128)))')

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# run_layout LABEL TP PP WORKERS THREADS
run_layout() {
    local label=$1 tp=$2 pp=$3 nw=$4 threads=$5
    local wp cp; wp=$(free_port); cp=$(free_port)
    cat > "$T/d.yaml" <<YAML
version: 1
coordinator: {workers_endpoint: "tcp://127.0.0.1:$wp", control_endpoint: "tcp://127.0.0.1:$cp", security: none}
deployments:
  - name: m
    model: $PWD/$MODEL
    parallel: {tensor: $tp, pipeline: $pp, replicas: 1}
    max_seq_len: 512
YAML
    local t0; t0=$(date +%s%N)
    "$BIN/tessera-coordinator" --adopt-grace-ms 0 "$T/d.yaml" 2> "$T/c.log" & PIDS+=($!)
    local wpids=()
    for i in $(seq 0 $((nw - 1))); do
        TSR_THREADS=$threads "$BIN/tessera-worker" --coordinator "tcp://127.0.0.1:$wp" \
            --name "b$i" 2> "$T/w$i.log" & PIDS+=($!); wpids+=($!)
    done
    C="$BIN/tessera --coordinator tcp://127.0.0.1:$cp"
    if ! $C status --wait-ready 120 > /dev/null; then echo "$label: not ready"; $C status; return; fi
    local ready_ms=$(( ($(date +%s%N) - t0) / 1000000 ))
    local best_pf=0 best_dec=0
    for rep in 1 2 3; do
        $C generate m --prompt-ids "$PROMPT128" --max-tokens 1 > /dev/null 2> "$T/pf.txt"
        local ms; ms=$(sed -n 's/.*first token after \([0-9]*\) ms.*/\1/p' "$T/pf.txt")
        best_pf=$(awk -v a="$best_pf" -v ms="$ms" 'BEGIN { v = 128000 / ms; print (v > a ? v : a) }')
        $C generate m --prompt-ids 1,2,3,4,5,6,7,8 --max-tokens 65 > /dev/null 2> "$T/dec.txt"
        local tps; tps=$(sed -n 's/.*, \([0-9.]*\) tokens\/s after it.*/\1/p' "$T/dec.txt")
        best_dec=$(awk -v a="$best_dec" -v b="$tps" 'BEGIN { print (b > a ? b : a) }')
    done
    # Peak resident memory of each worker holding a piece, against its share
    # of the weights plus its KV cache (as the worker reports them).
    local mem=""
    local doc; doc=$($C status --json)
    for i in $(seq 0 $((nw - 1))); do
        local pid=${wpids[$i]}
        local hwm; hwm=$(awk '/VmHWM/ {print $2}' "/proc/$pid/status")
        local share; share=$(echo "$doc" | python3 -c "import json,sys; d=json.load(sys.stdin); w=[w for w in d['workers'] if w['pid']==$pid][0]; print(w['weight_bytes'] + w['kv_bytes'])")
        [ "$share" = 0 ] && continue
        mem="$mem $(awk -v h="$hwm" -v s="$share" 'BEGIN { printf "%.0f/%.0f MB (%.2fx)", h*1024/1e6, s/1e6, h*1024/s }')"
    done
    printf "%-34s prefill %7.1f tok/s   decode %6.2f tok/s   ready in %5d ms   peak RSS/share:%s\n" \
        "$label" "$best_pf" "$best_dec" "$ready_ms" "$mem"
    echo "$label $best_pf $best_dec" >> "$T/results"
    for p in "${wpids[@]}"; do kill "$p" 2>/dev/null; done
    kill "${PIDS[0]}" 2>/dev/null
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null; done
    PIDS=()
}

echo
echo "layouts (2 workers, 1 BLAS thread each; tp=2 pp=2 needs 4 workers, so 4 processes share $NPROC cores):"
run_layout "tp=1 pp=1 (1 worker, 1 thread)" 1 1 1 1
run_layout "tp=2 pp=1 (2 workers)" 2 1 2 1
run_layout "tp=1 pp=2 (2 workers)" 1 2 2 1
run_layout "tp=2 pp=2 (4 workers)" 2 2 4 1
run_layout "one worker alone, $NPROC threads" 1 1 1 "$NPROC"
echo
python3 - "$T/results" "$BW1" "$BWN" "$WBYTES" <<'PY'
import sys
rows = [l.rsplit(None, 2) for l in open(sys.argv[1])]
base_pf, base_dec = float(rows[0][1]), float(rows[0][2])
print("overhead against tp=1 pp=1 (1 worker, 1 thread): time per token ratio")
for label, pf, dec in rows[1:]:
    print("  %-34s prefill x%.2f   decode x%.2f" % (label, base_pf / float(pf), base_dec / float(dec)))
bw1, bwn, w = float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
b1 = bw1 * 1e9 / w
print("decode at tp=1 pp=1, 1 thread: %.2f tok/s = %.2fx below the bandwidth bound of %.2f tok/s (target: within 1.3x)"
      % (base_dec, b1 / base_dec, b1))
alone = float(rows[-1][2]); bn = bwn * 1e9 / w
print("decode alone, all threads: %.2f tok/s = %.2fx below the bound of %.2f tok/s" % (alone, bn / alone, bn))
PY
