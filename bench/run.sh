#!/bin/bash
# Control-plane benchmark: runs bench_control at 1,000 and 10,000 simulated
# workers and prints its figures.  Builds nothing (`make bench` builds first);
# each run takes under 60 s and cleans up after itself.
#   bench/run.sh [extra bench_control options, e.g. --seconds 5]
#
# The target is "10,000 workers at 100 ms heartbeats on one core", so when
# taskset exists and there is a core to spare, the coordinator is pinned to the
# last cpu (bench_control --coordinator-cpu: sched_setaffinity before exec) and
# the simulator keeps off it.
#
# Connections (C) per run:
#   N=1,000  C=1,000   one connection per worker, as real tessera-worker
#                      processes have: the per-connection cost is part of
#                      what is measured.
#   N=10,000 C=1,250   one connection per 8-worker node (the protocol names
#                      workers per message, so a node agent could multiplex its
#                      workers this way).  This is also about the most one
#                      simulator core can drive at 100,000 heartbeats/s on a
#                      small host.
#   N=10,000 C=10,000  one connection per worker again (capped a little by
#                      RLIMIT_NOFILE: 2 fds each in the simulator).  On a
#                      2-core host the simulator cannot keep up here; the
#                      output says so rather than hiding it.
set -u
cd "$(dirname "$0")/.."
BUILD="${TSR_BUILD:-build}" BIN="${TSR_BIN:-bin}"
bench="$BUILD/bench/bench_control"
for f in "$bench" "$BIN/tessera-coordinator" "$BIN/tessera" "$BIN/tessera-worker" "$BUILD/bench/serve"; do
    if [ ! -x "$f" ]; then
        echo "bench/run.sh: $f is missing; run 'make bench' (or make && make $bench)" >&2
        exit 1
    fi
done

pin=()
ncpu=$(nproc 2>/dev/null || echo 1)
if command -v taskset >/dev/null 2>&1 && [ "$ncpu" -ge 2 ]; then
    pin=(--coordinator-cpu $((ncpu - 1)))
fi

rc=0
run() {
    echo
    "$bench" --coordinator-bin "$BIN/tessera-coordinator" --cli-bin "$BIN/tessera" \
        "${pin[@]}" "$@" || rc=1
}
run --workers 1000 --connections 1000 "$@"
run --workers 10000 --connections 1250 "$@"
run --workers 10000 --connections 10000 "$@"
# The same 1,000 workers while 100 HTTP streams generate through the coordinator (a
# deployment of a small model on one real worker; the simulated workers are spares):
# the heartbeat figures should not move.
model="$BUILD/models/http-bench"
if [ ! -f "$model/tokenizer.json" ]; then
    "$BIN/tessera" model-init "$model" --hidden 256 --intermediate 688 --layers 4 --heads 8 \
        --kv-heads 4 --vocab 1024 --max-pos 512 --seed 3 --force > /dev/null || exit 1
fi
run --workers 1000 --connections 1000 --http-streams 100 --model "$PWD/$model" \
    --worker-bin "$BIN/tessera-worker" --serve-bin "$BUILD/bench/serve" "$@"
exit $rc
