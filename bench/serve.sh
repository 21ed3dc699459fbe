#!/bin/bash
# Serving benchmark in the style of vLLM's benchmark_serving: a 58M-parameter
# random Llama (f32, vocabulary 32,000) made by `tessera model-init`, served by
# real coordinator and worker processes on loopback, loaded by bench/serve.c
# (C streams, each sending its next request when the previous one finished;
# prompts of 8-256 random ids, 128 tokens each, greedy).
#
# For tp=1 pp=1 (1 worker) and tp=1 pp=2 (2 workers) at concurrency 1, 2, 4,
# 8, 16, 32 it prints aggregate generated tokens/s, the speed-up over
# concurrency 1 of the same layout, TTFT and ITL p50/p99.  Then:
#   - single-stream decode against the memory-bandwidth bound: bytes one
#     decode step reads (every layer's weights, the final norm, the LM head,
#     one embedding row, the KV cache up to the average position) over the
#     read bandwidth of nproc threads (bench/stream.c --read over a buffer of
#     1 GiB or 4 times the last-level cache, whichever is larger, measured
#     before each decode request and after the last, the largest of the
#     four; when a step's bytes fit in that cache the bound is DRAM's and
#     the script says so), and
#     a measured decode (8-token prompt, 256 tokens, 3 requests one after the
#     other; the best request's rate, the least disturbed on a shared host,
#     as the bandwidth is the best of four) as a percentage of it, with the
#     mean of the three beside it;
#   - each worker's peak RSS (VmHWM) against its weights plus KV budget as
#     the coordinator reports them.
# The batching keys (max_batch, prefill_chunk, kv_cache_mib, max_queue, and
# kv_dtype when it is not f32) go into the deployment only when `tessera plan`
# accepts them.
#
#   bench/serve.sh            about 1.5 minutes on 2 Zen 5 cores with f32 products (88-93 s
#                             in runs of 2026-12-04), about 1 minute with bf16 products
#   bench/serve.sh --quick    concurrency 1, 8, 32 and fewer requests: about half a minute (28 s)
#   --kv-dtype bf16|int8      the KV cache in bf16 or int8 (kv_dtype; default f32): the
#                             budget is what keeps 32 sequences of 384 in that type (half
#                             of f32's for bf16, head_dim + 4 bytes a row for int8), and the
#                             bound counts those bytes
#   --matmul-dtype bf16       the weights in bf16 and the products on AMX or AVX512-BF16 where
#                             the CPU has it (matmul_dtype; default f32); the bound counts
#                             2-byte weights
#   --weights-dtype int8      every weight matrix in int8 with a scale a row, multiplied in
#                             f32 (weights_dtype); the bound counts 1-byte weights and the
#                             scales
# Needs `make` plus build/bench/serve and build/bench/stream (make bench builds them).
# Exit status: 0 every request finished, 1 a request failed or a layout did not
# come up (the reason is printed), 2 bad usage.
set -u
cd "$(dirname "$0")/.."
BIN="${TSR_BIN:-bin}" BUILD="${TSR_BUILD:-build}"

QUICK=0 KV_DTYPE=f32 MM_DTYPE=f32 WT_DTYPE=auto KERNELS=""
while [ $# -gt 0 ]; do
    case "$1" in
    --quick) QUICK=1 ;;
    --kv-dtype)
        case "${2:-}" in f32 | bf16 | int8) KV_DTYPE=$2; shift ;;
        *) echo "bench/serve.sh: --kv-dtype takes f32, bf16 or int8, not '${2:-}'" >&2; exit 2 ;;
        esac ;;
    --matmul-dtype)
        case "${2:-}" in f32 | bf16) MM_DTYPE=$2; shift ;;
        *) echo "bench/serve.sh: --matmul-dtype takes f32 or bf16, not '${2:-}'" >&2; exit 2 ;;
        esac ;;
    --weights-dtype)
        case "${2:-}" in auto | int8) WT_DTYPE=$2; shift ;;
        *) echo "bench/serve.sh: --weights-dtype takes auto or int8, not '${2:-}'" >&2; exit 2 ;;
        esac ;;
    -h | --help) sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "usage: bench/serve.sh [--quick] [--kv-dtype f32|bf16|int8] [--matmul-dtype f32|bf16]" \
            "[--weights-dtype auto|int8]" >&2; exit 2 ;;
    esac
    shift
done
for f in "$BIN/tessera" "$BIN/tessera-coordinator" "$BIN/tessera-worker" "$BUILD/bench/serve" \
         "$BUILD/bench/stream"; do
    if [ ! -x "$f" ]; then
        echo "bench/serve.sh: $f is missing; run 'make && make $BUILD/bench/serve $BUILD/bench/stream'" >&2
        exit 1
    fi
done

if [ "$WT_DTYPE" = int8 ] && [ "$MM_DTYPE" = bf16 ]; then
    echo "bench/serve.sh: int8 weights multiply as integers: --weights-dtype int8 goes without --matmul-dtype bf16" >&2
    exit 2
fi
# the type the weight matrices are held in
HELD=$MM_DTYPE; [ "$WT_DTYPE" = int8 ] && HELD=int8
if [ "$QUICK" = 1 ]; then CONCS="1 8 32" TOTAL=4 PER_STREAM=2; else CONCS="1 2 4 8 16 32" TOTAL=16 PER_STREAM=4; fi
# Each level sends max(TOTAL, PER_STREAM * C) requests: every stream sends
# PER_STREAM requests or more, one after the other, so a level measures
# streams of requests (as benchmark_serving's --max-concurrency does over
# many prompts), not one burst of C requests whose ramp up and down, a
# prefill-only start and a shrinking batch at the end, would be most of it.
MAX_TOKENS=128 MIN_PROMPT=8 MAX_PROMPT=256 MAX_SEQ=512
DEC_PROMPT=8 DEC_TOKENS=256 DEC_REQUESTS=3
KV_SEQS=32 KV_POSITIONS=384     # the KV budget: 32 sequences of 384 positions
MODEL="$BUILD/models/serve58m"
T=$(mktemp -d /tmp/tsr-serve.XXXXXX)
PIDS=()
# PIPE ignored: a reader that went first (| tee, | head) must not stop the cleanup.
cleanup() { trap '' PIPE; for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null; done; wait 2>/dev/null; rm -rf "$T"; }
trap cleanup EXIT
trap 'exit 130' INT TERM
NPROC=$(nproc)
START=$(date +%s)
RC=0

if [ ! -f "$MODEL/config.json" ]; then
    "$BIN/tessera" model-init "$MODEL" --hidden 512 --intermediate 1376 --layers 8 --heads 8 \
        --kv-heads 8 --vocab 32000 --max-pos 1024 --dtype f32 --seed 5 --force > /dev/null || exit 1
fi

# The model's shape and what one decode step reads, from config.json.  The
# engine keeps weight matrices in HELD whatever the checkpoint's dtype
# (norm weights in f32; int8 rows with a 4-byte scale each), the KV cache in
# KV_DTYPE.
eval "$(python3 - "$MODEL/config.json" "$KV_DTYPE" "$HELD" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
w_elem = {"bf16": 2, "int8": 1}.get(sys.argv[3], 4)
scale = 4 if sys.argv[3] == "int8" else 0        # bytes of a row's scale
H, I, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
NH, KVH, V = c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]
HD = c.get("head_dim") or H // NH
mats = H * NH * HD + 2 * H * KVH * HD + NH * HD * H + 3 * H * I   # q k v o, mlp
rows = NH * HD + 2 * KVH * HD + H + 2 * I + H                      # their rows
layer = mats + 2 * H                                                 # and 2 norms
params = L * layer + H + V * H + (0 if c.get("tie_word_embeddings") else V * H)
# bytes of one position of one KV head (common/deploy.c's tsr_kv_row_bytes)
kv_row = {"bf16": 2 * HD, "int8": HD + 4}.get(sys.argv[2], 4 * HD)
kv_layer = 2 * KVH * kv_row                    # bytes of K and V per position and layer
print(f"H={H} I={I} L={L} NH={NH} KVH={KVH} HD={HD} V={V} PARAMS={params}")
print(f"LAYER_BYTES={L * (mats * w_elem + rows * scale + 2 * H * 4)} "
      f"LMHEAD_BYTES={V * (H * w_elem + scale)}")
print(f"NORM_ROW_BYTES={H * 4 + H * w_elem + scale}")
print(f"KV_LAYER_BYTES={kv_layer} KV_POS_BYTES={L * kv_layer}")
PY
)" || { echo "bench/serve.sh: cannot read $MODEL/config.json" >&2; exit 1; }

# kv_mib PP: the KV budget of a piece (kv_cache_mib is per piece) at PP
# stages: KV_SEQS sequences of KV_POSITIONS positions of its largest stage's layers.
kv_mib() {
    local layers=$(((L + $1 - 1) / $1))
    echo $(((KV_SEQS * KV_POSITIONS * layers * KV_LAYER_BYTES + 1048575) / 1048576))
}

# The read-bandwidth buffer: 1 GiB, or 4 times the last-level cache when
# that is larger (a VM may report hundreds of MiB of L3).
LLC_KIB=$(awk '{ v = $1; u = substr(v, length(v)); n = v + 0; if (u == "M") n *= 1024; print n }' \
          /sys/devices/system/cpu/cpu0/cache/index3/size 2> /dev/null || echo 0)
[ -n "$LLC_KIB" ] || LLC_KIB=0
BW_MIB=$((LLC_KIB * 4 / 1024)); [ "$BW_MIB" -lt 1024 ] && BW_MIB=1024

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# write_yaml FILE TP PP WORKERS_PORT CONTROL_PORT WITH_KEYS
write_yaml() {
    cat > "$1" <<YAML
version: 1
coordinator: {workers_endpoint: "tcp://127.0.0.1:$4", control_endpoint: "tcp://127.0.0.1:$5", security: none}
deployments:
  - name: m
    model: $PWD/$MODEL
    parallel: {tensor: $2, pipeline: $3, replicas: 1}
    max_seq_len: $MAX_SEQ
YAML
    if [ "$6" = 1 ]; then
        cat >> "$1" <<YAML
    max_batch: 32
    prefill_chunk: 128
    kv_cache_mib: $(kv_mib "$3")
    max_queue: 256
YAML
        if [ "$KV_DTYPE" != f32 ]; then echo "    kv_dtype: $KV_DTYPE" >> "$1"; fi
        if [ "$MM_DTYPE" = bf16 ]; then echo "    matmul_dtype: bf16" >> "$1"; fi
        if [ "$WT_DTYPE" = int8 ]; then echo "    weights_dtype: int8" >> "$1"; fi
    fi
}

# Are the batching keys known to this build's parser?
write_yaml "$T/probe.yaml" 1 1 1 2 0
if ! "$BIN/tessera" plan "$T/probe.yaml" > /dev/null 2> "$T/probe.err"; then
    echo "bench/serve.sh: tessera plan refuses the plain deployment:" >&2; cat "$T/probe.err" >&2; exit 1
fi
write_yaml "$T/probe.yaml" 1 1 1 2 1
if "$BIN/tessera" plan "$T/probe.yaml" > /dev/null 2> "$T/probe.err"; then
    KEYS=1 KEYS_TEXT="max_batch 32, prefill_chunk 128, max_queue 256, kv_cache_mib $(kv_mib 1) at pp=1
  and $(kv_mib 2) at pp=2 (per piece: $KV_SEQS sequences of $KV_POSITIONS positions of its layers, $KV_DTYPE)$(
    [ "$MM_DTYPE" = bf16 ] && echo ", matmul_dtype bf16")$([ "$WT_DTYPE" = int8 ] && echo ", weights_dtype int8")"
else
    if [ "$KV_DTYPE" != f32 ] || [ "$MM_DTYPE" = bf16 ] || [ "$WT_DTYPE" = int8 ]; then
        echo "bench/serve.sh: --kv-dtype bf16|int8, --matmul-dtype bf16 and --weights-dtype int8 need the batching keys, and this build's parser" \
             "refuses them: $(head -1 "$T/probe.err")" >&2
        exit 1
    fi
    KEYS=0 KEYS_TEXT="none: this build's parser refuses them ($(head -1 "$T/probe.err"))"
fi

echo "== serving benchmark$([ "$QUICK" = 1 ] && echo ' (--quick)')"
echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $NPROC cores," \
     "$(awk '/MemTotal/ {printf "%.1f GiB", $2 / 1048576}' /proc/meminfo)," \
     "load average $(cut -d' ' -f1-3 /proc/loadavg) at the start (other work on the host skews the figures)"
echo "model: $MODEL, $(awk -v p="$PARAMS" 'BEGIN {printf "%.1fM", p / 1e6}') parameters, f32 (held as $HELD):" \
     "hidden $H, intermediate $I, $L layers, $NH heads / $KVH kv heads (head_dim $HD), vocab $V"
echo "deployment: max_seq_len $MAX_SEQ; batching keys: $KEYS_TEXT"
echo "requests: prompts of $MIN_PROMPT-$MAX_PROMPT random ids (seeded), $MAX_TOKENS tokens each, greedy;" \
     "max($TOTAL, $PER_STREAM x C) requests per level, C streams each sending its next when the last finished"
echo "threads: each worker gets nproc / workers (TSR_THREADS)"
echo
printf "%-24s %5s %9s %9s %8s %10s %10s %9s %9s\n" "layout" "conc" "requests" "tok/s" "speed-up" \
       "TTFT p50" "TTFT p99" "ITL p50" "ITL p99"

# json_get FILE KEY...: the values, space-separated ("-" for null).
json_get() {
    python3 - "$@" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(" ".join("-" if d.get(k) is None else str(d[k]) for k in sys.argv[2:]))
PY
}

# run_layout LABEL TP PP WORKERS DECODE_TOO
run_layout() {
    local label=$1 tp=$2 pp=$3 nw=$4 decode=$5
    local threads=$((NPROC / nw)); [ "$threads" -lt 1 ] && threads=1
    local wp cp; wp=$(free_port); cp=$(free_port)
    write_yaml "$T/d.yaml" "$tp" "$pp" "$wp" "$cp" "$KEYS"
    "$BIN/tessera-coordinator" --adopt-grace-ms 0 "$T/d.yaml" 2> "$T/c.log" & PIDS+=($!)
    local wpids=() i
    for i in $(seq 0 $((nw - 1))); do
        TSR_THREADS=$threads "$BIN/tessera-worker" \
            --coordinator "tcp://127.0.0.1:$wp" --name "s$i" 2> "$T/w$i.log" & PIDS+=($!); wpids+=($!)
    done
    local C="$BIN/tessera --coordinator tcp://127.0.0.1:$cp"
    # A request waits at most 120 s for its acceptance and for each token,
    # queueing included (32 requests served one at a time take about 60 s).
    local S="$BUILD/bench/serve --coordinator tcp://127.0.0.1:$cp --deployment m --vocab $V --json --timeout 120000"
    if ! $C status --wait-ready 120 > /dev/null; then
        echo "$label: not ready after 120 s"; $C status; tail -5 "$T"/w*.log; RC=1; stop_layout; return
    fi
    # The CPU engine's build of its kernels, as the first layout's worker logged it.
    [ -n "$KERNELS" ] || KERNELS=$(grep -m1 -o 'cpu engine: .*' "$T/w0.log" | sed 's/^cpu engine: //')
    # One short request first: page faults and first-call costs stay out of the figures.
    $S --requests-per-stream 1 --max-tokens 8 > /dev/null 2>&1
    local base="" c
    for c in $CONCS; do
        local n=$(((TOTAL + c - 1) / c)); [ "$n" -lt "$PER_STREAM" ] && n=$PER_STREAM
        if ! $S --concurrency "$c" --requests-per-stream "$n" --max-tokens "$MAX_TOKENS" \
                --min-prompt "$MIN_PROMPT" --max-prompt "$MAX_PROMPT" \
                > "$T/r.json" 2> "$T/r.err"; then
            RC=1
            echo "$label, concurrency $c: requests failed:"; sed 's/^/  /' "$T/r.err"
            [ -s "$T/r.json" ] || break
        fi
        local ndone failed tps t50 t99 i50 i99
        read -r ndone failed tps t50 t99 i50 i99 <<< "$(json_get "$T/r.json" done failed tok_per_s \
            ttft_p50_ms ttft_p99_ms itl_p50_ms itl_p99_ms)"
        [ -z "$base" ] && base=$tps
        awk -v l="$label" -v c="$c" -v d="$ndone" -v f="$failed" -v tps="$tps" -v b="$base" \
            -v t50="$t50" -v t99="$t99" -v i50="$i50" -v i99="$i99" 'BEGIN {
            req = d (f > 0 ? "/" f "F" : "")
            printf "%-24s %5d %9s %9.1f %7.2fx %8.0fms %8.0fms %7.2fms %7.2fms\n",
                   l, c, req, tps, (b > 0 ? tps / b : 0), t50, t99, i50, i99 }'
        awk -v tps="$tps" -v b="$base" -v c="$c" -v pp="$pp" \
            'BEGIN { printf "%d %d %.2f\n", pp, c, (b > 0 ? tps / b : 0) }' >> "$T/speedups"
        if [ "$ndone" = 0 ]; then
            echo "$label: no request finished at concurrency $c; skipping the rest of this layout"
            break
        fi
    done
    if [ "$decode" = 1 ]; then
        # The bandwidth before each decode request and after the last: it
        # drifts on a shared host (19-28 GB/s between runs on the 2-core VM),
        # so the bound takes the largest, which can only lower the share.
        local bws=()
        for i in $(seq 1 "$DEC_REQUESTS"); do
            bws+=("$("$BUILD/bench/stream" --read --threads "$NPROC" --mib "$BW_MIB" | awk '{print $2}')")
            $S --requests-per-stream 1 --min-prompt "$DEC_PROMPT" --max-prompt "$DEC_PROMPT" \
                --max-tokens "$DEC_TOKENS" > "$T/decode.$i.json" 2> "$T/decode.err" ||
                { RC=1; cat "$T/decode.err"; }
        done
        bws+=("$("$BUILD/bench/stream" --read --threads "$NPROC" --mib "$BW_MIB" | awk '{print $2}')")
        echo "tp=$tp pp=$pp, $nw worker(s) with $threads thread(s) each" > "$T/decode.label"
        BW=$(printf '%s\n' "${bws[@]}" | sort -g | tail -1)
        echo "measured before each request and after the last: ${bws[*]} GB/s; the largest" > "$T/bw.text"
        # One document for the rounds: the mean and the best request's rate,
        # the tokens and the requests done.
        python3 - "$T"/decode.*.json > "$T/decode.json" <<'PY'
import json, sys
docs = [json.load(open(f)) for f in sys.argv[1:]]
rates = [d["decode_tok_per_s"] for d in docs if d.get("decode_tok_per_s") is not None]
print(json.dumps({"decode_tok_per_s": sum(rates) / len(rates) if rates else None,
                  "decode_best_tok_per_s": max(rates) if rates else None,
                  "tokens": sum(d["tokens"] for d in docs), "done": sum(d["done"] for d in docs)}))
PY
    fi
    # Peak resident memory of each worker holding a piece, against its weights
    # plus KV budget as the worker reports them.
    $C status --json > "$T/status.json"
    for i in $(seq 0 $((nw - 1))); do
        local pid=${wpids[$i]} hwm share
        hwm=$(awk '/VmHWM/ {print $2}' "/proc/$pid/status")
        share=$(python3 -c "import json,sys; d=json.load(open('$T/status.json')); w=[w for w in d['workers'] if w['pid']==$pid][0]; print(w['weight_bytes'], w['kv_bytes'])")
        awk -v l="$label" -v i="$i" -v h="$hwm" -v s="$share" 'BEGIN {
            split(s, a, " "); t = a[1] + a[2]
            printf "  %-24s worker s%d: peak RSS %6.1f MB, weights %6.1f MB + KV %6.1f MB = %6.1f MB: %.2fx\n",
                   l, i, h * 1024 / 1e6, a[1] / 1e6, a[2] / 1e6, t / 1e6, (t > 0 ? h * 1024 / t : 0) }' >> "$T/memory"
    done
    stop_layout
}

stop_layout() {
    local p
    for p in "${PIDS[@]:1}"; do kill "$p" 2>/dev/null; done
    kill "${PIDS[0]}" 2>/dev/null
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null; done
    PIDS=()
}

run_layout "tp=1 pp=1 (1 worker)" 1 1 1 1
run_layout "tp=1 pp=2 (2 workers)" 1 2 2 0

echo
echo "peak RSS (VmHWM) against weights + KV budget (tessera status --json):"
cat "$T/memory" 2> /dev/null

echo
echo "single-stream decode against the memory-bandwidth bound:"
if [ -s "$T/decode.json" ]; then
    read -r dec best tokens ndone <<< "$(json_get "$T/decode.json" decode_tok_per_s decode_best_tok_per_s tokens done)"
    awk -v lb="$LAYER_BYTES" -v hb="$LMHEAD_BYTES" -v nb="$NORM_ROW_BYTES" -v kvp="$KV_POS_BYTES" \
        -v bw="$BW" -v n="$NPROC" -v dec="$dec" -v best="$best" -v nr="$DEC_REQUESTS" -v tok="$tokens" -v d="$ndone" -v p="$DEC_PROMPT" \
        -v label="$(cat "$T/decode.label")" -v want="$DEC_TOKENS" -v bwt="$(cat "$T/bw.text")" \
        -v mib="$BW_MIB" -v llc="$LLC_KIB" 'BEGIN {
        g = d > 0 ? tok / d : want            # tokens per request (fewer when eos came first)
        pos = p + g / 2                        # average position a decode step attends to
        kv = kvp * pos; total = lb + hb + nb + kv
        bound = bw * 1e9 / total
        printf "  bytes per step: layers %.1f MB + LM head %.1f MB + final norm and 1 embedding row %.1f KB\n", lb / 1e6, hb / 1e6, nb / 1e3
        printf "                  + KV cache at average position %.0f %.1f MB = %.1f MB\n", pos, kv / 1e6, total / 1e6
        printf "  read bandwidth: %.2f GB/s (%d threads, %d MiB buffer, bench/stream --read;\n", bw, n, mib
        printf "                  %s)\n", bwt
        printf "  bound: %.1f tok/s; measured %s, %d-token prompt, %.0f tokens, %d requests one after\n",
               bound, label, p, g, nr
        printf "  the other: best request %.1f tok/s = %.0f%% of the bound (mean of the requests %.1f = %.0f%%)\n",
               best, 100 * best / bound, dec, 100 * dec / bound
        if (llc > 0 && total < llc * 1024)
            printf "  note: a step reads %.1f MB and the last-level cache holds %.1f MB: the weights can stay\n  in that cache, so this bound (DRAM read bandwidth) is not what limits this decode here\n", total / 1e6, llc * 1024 / 1e6
        printf "%.1f\n", 100 * best / bound > "/dev/stderr" }' 2> "$T/decode.pct"
else
    echo "  no decode measurement (the tp=1 pp=1 layout did not run)"
fi
echo
echo "tp=1 pp=1 worker's CPU engine (its log): ${KERNELS:-not logged by this build}"
# The issue's targets, from the figures above.
echo
echo "targets:"
speedup() { awk -v pp="$1" -v c="$2" '$1 == pp && $2 == c { print $3 }' "$T/speedups" 2> /dev/null; }
target() {   # LABEL VALUE OP LIMIT UNIT
    if [ -z "$2" ]; then printf "  %-58s not measured\n" "$1"; return; fi
    awk -v l="$1" -v v="$2" -v op="$3" -v lim="$4" -v u="$5" 'BEGIN {
        met = (op == ">=") ? v >= lim : v <= lim
        printf "  %-58s %7.2f%s (target %s %s%s): %s\n", l, v, u, op, lim, u, met ? "met" : "MISSED" }'
}
target "one replica, 8 streams over 1 (tp=1 pp=1)" "$(speedup 1 8)" ">=" 4 x
target "one replica, 32 streams over 1 (tp=1 pp=1)" "$(speedup 1 32)" ">=" 6 x
target "pipeline overlap, 8 streams over 1 (tp=1 pp=2)" "$(speedup 2 8)" ">=" 1.6 x
target "single-stream decode, share of the memory bound" "$(cat "$T/decode.pct" 2> /dev/null)" ">=" 90 %
target "peak RSS over weights + KV budget, worst worker" \
    "$(awk '{ v = $NF; sub(/x$/, "", v); if (v > m) m = v } END { if (NR) print m }' "$T/memory" 2> /dev/null)" "<=" 1.15 x

echo
echo "total time: $(($(date +%s) - START)) s; load average $(cut -d' ' -f1-3 /proc/loadavg) at the end"
exit $RC
