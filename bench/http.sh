#!/bin/bash
# HTTP overhead benchmark: the same requests through the coordinator's control socket
# (what `tessera generate` uses) and through its OpenAI-compatible HTTP API
# (POST /v1/completions, streamed), sent by one program (build/bench/serve, with and
# without --http) against one coordinator and one CPU worker on loopback.  Prints, for
# 1 and 8 concurrent streams, TTFT and ITL p50/p99 and aggregate tokens/s for both
# paths, and the TTFT difference at p50 against the target (HTTP within 2 ms of the CLI
# path).  The modes alternate (control, HTTP, control, HTTP) and each figure is the
# second run of its mode, so drift of the shared machine hits both alike.
#   bench/http.sh          about 1-2 minutes on 2 cores
# Needs `make` plus build/bench/serve (make bench builds it).
set -u
cd "$(dirname "$0")/.."
source bench/lib.sh
bench_setup bench/http.sh "$BIN/tessera" "$BIN/tessera-coordinator" "$BIN/tessera-worker" \
    "$BUILD/bench/serve"
bench_small_model
WP=$(free_port) CP=$(free_port) HP=$(free_port)
cat > "$T/d.yaml" <<YAML
version: 1
coordinator: {workers_endpoint: "tcp://127.0.0.1:$WP", control_endpoint: "tcp://127.0.0.1:$CP",
              http_endpoint: "127.0.0.1:$HP", security: none}
deployments:
  - name: m
    model: $PWD/$MODEL
    max_seq_len: 512
YAML
bench_one_worker bench/http.sh

echo "== HTTP overhead benchmark"
echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores," \
     "load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "model: $MODEL (hidden 256, 4 layers, vocabulary 1,024, f32), 1 worker; prompts of 8-64" \
     "random ids, 32 tokens each, greedy"
echo
printf '%-8s %-8s %10s %22s %22s\n' streams path "tok/s" "TTFT p50 / p99 ms" "ITL p50 / p99 ms"
RC=0
for C in 1 8; do
    N=$((C == 1 ? 40 : 8))
    for round in 1 2; do
        for mode in control http; do
            extra=()
            [ "$mode" = http ] && extra=(--http "127.0.0.1:$HP")
            "$BUILD/bench/serve" --coordinator "tcp://127.0.0.1:$CP" "${extra[@]}" --deployment m \
                --vocab 1024 --concurrency "$C" --requests-per-stream "$N" --min-prompt 8 \
                --max-prompt 64 --max-tokens 32 --seed "$round" --json > "$T/$mode-$C.json" ||
                { echo "bench/http.sh: the $mode run failed"; RC=1; }
        done
    done
    for mode in control http; do
        python3 - "$T/$mode-$C.json" "$C" "$mode" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
f = lambda k: "%.2f" % d[k] if d.get(k) is not None else "-"
print("%-8s %-8s %10.1f %22s %22s" % (sys.argv[2], sys.argv[3], d["tok_per_s"],
      f("ttft_p50_ms") + " / " + f("ttft_p99_ms"), f("itl_p50_ms") + " / " + f("itl_p99_ms")))
PY
    done
    python3 - "$T/control-$C.json" "$T/http-$C.json" "$C" <<'PY'
import json, sys
a, b = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
d = b["ttft_p50_ms"] - a["ttft_p50_ms"]
print("         TTFT p50 through HTTP minus the control socket, %s stream(s): %+.2f ms "
      "(target: within 2 ms)%s" % (sys.argv[3], d, "" if sys.argv[3] != "1" else
      (": met" if d <= 2 else ": MISSED")))
PY
done
exit $RC
