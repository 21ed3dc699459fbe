#!/bin/bash
# Weight types on the CPU engine alone (bench/engine_step, no daemons): one
# decode step of a Llama shape whose LM head is a small share of its
# weights (hidden 2048, intermediate 5632, 12 layers, 16 heads over 8 KV
# heads, vocabulary 32,000: 0.70B parameters, made by `tessera model-init`
# in bf16), with its weights in f32 (the default), in int8 (weights_dtype
# int8) and, where the CPU multiplies bf16 in hardware (AMX or
# AVX512-BF16), in bf16 (matmul_dtype bf16; elsewhere its portable build
# would be measured, which is not what bf16 costs).  For 1 and 32
# sequences (contexts of 16, an f32 KV cache) it prints the best and the
# median step, tokens/s, the bytes one step reads (every layer's matrices
# and scales, the LM head, the KV cache) and, for 1 sequence, that over the
# read bandwidth of nproc threads (bench/stream --read over 1 GiB, the best
# of three runs before and after) as a percentage of the bound; then each
# type's tokens/s against f32's (and against bf16's where measured), and
# what int8 does to the numbers (bench/quant.py on a small random model:
# greedy agreement and mean absolute logit error against unquantized).
#
#   bench/weights.sh          about a minute on 2 cores (50 s in a run of 2026-12-07)
# Needs build/bench/engine_step and build/bench/stream (make bench builds them).
set -u
cd "$(dirname "$0")/.."
source bench/lib.sh
bench_no_args bench/weights.sh "$@"
bench_setup bench/weights.sh "$BIN/tessera" "$BUILD/bench/engine_step" "$BUILD/bench/stream"
MODEL="$BUILD/models/w700m"
if [ ! -f "$MODEL/config.json" ]; then
    "$BIN/tessera" model-init "$MODEL" --hidden 2048 --intermediate 5632 --layers 12 --heads 16 \
        --kv-heads 8 --vocab 32000 --max-pos 1024 --dtype bf16 --seed 5 --force > /dev/null 2>&1 ||
        { echo "bench/weights.sh: model-init failed" >&2; exit 1; }
fi
bw() { "$BUILD/bench/stream" --read --mib 1024 | sed -n 's/^read_bandwidth_gbs \([0-9.]*\).*/\1/p'; }
best_bw() { local a b c; a=$(bw); b=$(bw); c=$(bw); printf '%s\n%s\n%s\n' "$a" "$b" "$c" | sort -g | tail -1; }
types="f32 int8"
grep -qwE 'amx_bf16|avx512_bf16' /proc/cpuinfo && types="f32 bf16 int8"
echo "== weight types (bench/weights.sh)"
echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores," \
     "load average $(cut -d' ' -f1-3 /proc/loadavg) at the start"
[ "$types" = "f32 int8" ] && echo "bf16: not measured (no AMX or AVX512-BF16 here: matmul_dtype bf16 would run its portable build)"
BW0=$(best_bw)
declare -A TOKS
for t in $types; do
    case $t in f32) flags="" ;; bf16) flags="--matmul-dtype bf16" ;; int8) flags="--weights-dtype int8" ;; esac
    for s in 1 32; do
        out=$("$BUILD/bench/engine_step" "$MODEL" --seqs $s --contexts 16 --steps $((s == 1 ? 16 : 6)) \
              --kv-dtype f32 $flags 2> /dev/null) || { echo "bench/weights.sh: engine_step $t failed" >&2; exit 1; }
        line=$(echo "$out" | grep "kv f32")
        best=$(echo "$line" | sed -n 's/.*step best *\([0-9.]*\) ms.*/\1/p')
        med=$(echo "$line" | sed -n 's/.*median *\([0-9.]*\) ms.*/\1/p')
        [ -n "$best" ] || { echo "bench/weights.sh: no step time from engine_step: $out" >&2; exit 1; }
        TOKS[$t.$s]=$(awk -v b="$best" -v s=$s 'BEGIN {printf "%.1f", s * 1000 / b}')
        echo "$t weights, $s sequence(s): step best $best ms, median $med ms, ${TOKS[$t.$s]} tokens/s"
        [ $s = 1 ] && eval "BEST_$t=$best"
    done
done
BW1=$(best_bw)
BW=$(printf '%s\n%s\n' "$BW0" "$BW1" | sort -g | tail -1)
# bytes of one decode step of one sequence, per type (common/budget.c's rule; norms f32)
python3 - "$MODEL/config.json" "$BW" "$types" "${BEST_f32:-0}" "${BEST_bf16:-0}" "${BEST_int8:-0}" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
bw, types = float(sys.argv[2]), sys.argv[3].split()
best = {"f32": float(sys.argv[4]), "bf16": float(sys.argv[5]), "int8": float(sys.argv[6])}
H, I, L, NH, KV, V = (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"],
                      c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"])
HD = c.get("head_dim") or H // NH
mats = H * NH * HD + 2 * H * KV * HD + NH * HD * H + 3 * H * I
rows = NH * HD + 2 * KV * HD + H + 2 * I + H
kv = 24 * L * 2 * KV * HD * 4          # f32 KV of the steps' middle position (16 + 8)
print(f"read bandwidth: {bw:.1f} GB/s (bench/stream --read, {__import__('os').cpu_count()} threads, best of 6)")
for t in types:
    e, sc = {"f32": (4, 0), "bf16": (2, 0), "int8": (1, 4)}[t]
    step = L * (mats * e + rows * sc + 2 * H * 4) + V * (H * e + sc) + H * 4 + kv
    bound = step / (bw * 1e9) * 1e3
    print(f"{t}: one step reads {step / 1e6:.0f} MB: bound {bound:.2f} ms; measured {best[t]:.2f} ms "
          f"= {100 * bound / best[t]:.0f} % of the bound")
PY
# what int8 does to the numbers (the NumPy reference, which the engine matches; a small model)
QMODEL="$BUILD/models/quant-check"
[ -f "$QMODEL/config.json" ] || "$BIN/tessera" model-init "$QMODEL" --hidden 256 --intermediate 688 \
    --layers 4 --heads 4 --kv-heads 2 --vocab 1024 --max-pos 256 --seed 5 --force > /dev/null 2>&1
python3 bench/quant.py "$QMODEL" || echo "bench/weights.sh: bench/quant.py failed" >&2
for s in 1 32; do
    r="int8 against f32 at $s sequence(s): $(awk -v a="${TOKS[int8.$s]}" -v b="${TOKS[f32.$s]}" 'BEGIN {printf "%.2fx", a / b}')"
    [ -n "${TOKS[bf16.$s]:-}" ] && r="$r, against bf16: $(awk -v a="${TOKS[int8.$s]}" -v b="${TOKS[bf16.$s]}" 'BEGIN {printf "%.2fx", a / b}')"
    echo "$r"
done
