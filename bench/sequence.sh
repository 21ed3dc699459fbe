#!/bin/bash
# The sequence split (parallel.sequence) on the CPU engine alone
# (build/bench/seq_split, no daemons: the deployment key and the replica's
# wiring are not built yet): one long prompt's time to first token and the
# decode speed after it, at split 1 and 2, each rank one thread pinned to a
# core of its own, the two ranks talking over loopback TCP as a replica's
# pieces do.  A model of hidden 256, intermediate 688, 4 layers, 4 heads
# over 2 KV heads of 64, vocabulary 1,000 (3.4M parameters, f32; made by
# `tessera model-init`), so attention, which the split shares, is most of
# a long prompt's work.  Prompts of 2k, 8k and 16k tokens, prefill chunks of
# 128, 16 decode steps; then the issue's targets: time to first token at 8k
# and 16k with split 2 at most 0.6x split 1's, decode tokens/s at 16k with
# split 2 at least split 1's.
#
#   bench/sequence.sh          about 40 s on 2 cores (2026-12-07)
# Needs build/bench/seq_split (make bench builds it) and a machine with 2 CPUs.
set -u
cd "$(dirname "$0")/.."
source bench/lib.sh
bench_no_args bench/sequence.sh "$@"
bench_setup bench/sequence.sh "$BIN/tessera" "$BUILD/bench/seq_split"
[ "$(nproc)" -ge 2 ] || { echo "bench/sequence.sh: needs 2 CPUs, this process may use $(nproc)" >&2; exit 1; }
MODEL="$BUILD/models/seq256"
if [ ! -f "$MODEL/config.json" ]; then
    "$BIN/tessera" model-init "$MODEL" --hidden 256 --intermediate 688 --layers 4 --heads 4 \
        --kv-heads 2 --vocab 1000 --max-pos 16400 --seed 3 --force > /dev/null 2>&1 ||
        { echo "bench/sequence.sh: model-init failed" >&2; exit 1; }
fi
echo "== the sequence split (bench/sequence.sh)"
echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores," \
     "load average $(cut -d' ' -f1-3 /proc/loadavg) at the start"
out=$("$BUILD/bench/seq_split" "$MODEL" --prompts 2048,8192,16384 2> /dev/null) ||
    { echo "bench/sequence.sh: seq_split failed" >&2; "$BUILD/bench/seq_split" "$MODEL" --prompts 2048 >&2; exit 1; }
echo "$out"
ratio() { echo "$out" | sed -n "s/^prompt *$1: split 2 against 1: time to first token \([0-9.]*\)x, decode \([0-9.]*\)x/\\$2/p"; }
t8=$(ratio 8192 1) t16=$(ratio 16384 1) d16=$(ratio 16384 2)
[ -n "$t8" ] && [ -n "$t16" ] && [ -n "$d16" ] || { echo "bench/sequence.sh: no ratios in the output" >&2; exit 1; }
verdict() { awk -v x="$1" -v t="$2" -v op="$3" 'BEGIN { ok = op == "le" ? x <= t : x >= t; print ok ? "met" : "MISSED" }'; }
echo "targets:"
echo "  time to first token at 8k, split 2 over 1    ${t8}x (target <= 0.6x): $(verdict "$t8" 0.6 le)"
echo "  time to first token at 16k, split 2 over 1   ${t16}x (target <= 0.6x): $(verdict "$t16" 0.6 le)"
echo "  decode tokens/s at 16k, split 2 over 1       ${d16}x (target >= 1x): $(verdict "$d16" 1 ge)"
