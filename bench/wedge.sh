#!/bin/bash
# Wedged-rank benchmark: how long a cuda tp=2 replica takes to get rid of a
# rank whose thread is stuck for good inside a collective while its process
# still heartbeats, with the deployment's collective_timeout_ms left to its
# default and with the values given, and whether a request in flight
# survives it under the default replay_wait_ms (30 s).  Runs on the CPU:
# fake-NCCL workers (the CPU engine behind the cuda row, groups spanning
# processes over loopback, make all-tests builds them) on stand-in GPUs, the
# wedge being the fake's stand-in for a driver call that never returns
# (SIGUSR1 makes the next all-reduce sleep for good).  For each setting: a
# 200-token request, rank 1 wedged after its first token; the times from the
# wedge to the request's interruption, the rewire (the replica's new
# epoch), the wedged worker's
# watchdog report (it is declared dead and its piece moves to the spare),
# and the request's end, with its outcome.
#   bench/wedge.sh [MS...]    default: the deployment default, then 30000
#   (about 20 s for the default, 45 s for 30000, on 2 cores)
set -u
cd "$(dirname "$0")/.."
settings=("$@")
[ ${#settings[@]} -gt 0 ] || settings=(default 30000)
for s in "${settings[@]}"; do
    case "$s" in default | [0-9]*) ;; *) echo "bench/wedge.sh: '$s' is not a number of ms" >&2; exit 2 ;; esac
done

echo "== Wedged-rank benchmark"
echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores"
echo "cluster: a cuda tp=2 replica and a spare, fake-NCCL workers (no GPU), hidden 64, 8 layers;"
echo "coordinator defaults for canary_interval_ms (5000), canary_timeout_ms (2000), replay_wait_ms (30000)"
printf '%-22s %10s %8s %9s %8s  %s\n' collective_timeout_ms interrupt rewire watchdog end outcome

# run SETTING: one cluster, one wedge; prints a row.
run() (
    source tests/integration/lib.sh
    local kv=()
    [ "$1" = default ] || kv=("collective_timeout_ms: $1")
    { coordinator_yaml; echo "deployments:"; duo_deployment "${kv[@]}"; } > "$T/d.yaml"
    start_coord "$T/d.yaml"
    start_fake_nccl_gpus 3
    wait_until 30 all_ready || fail "not ready"
    local limit
    limit=$(tsr status --json | jget "d['deployments'][0]['collective_timeout_ms']")
    local victim
    victim=$(piece_holder 0 0 1)
    tsr generate duo --prompt-ids 1,2,3 --max-tokens 200 --ids --token-timeout 120000 \
        > "$T/out" 2> "$T/err" &
    local gen=$! rc
    first_token_arrived
    local wedged
    wedged=$(date -u '+%H:%M:%S.%3N')   # the daemons log in UTC
    kill -USR1 "${WPID[$victim]}"
    wait "$gen"; rc=$?
    local ended
    ended=$(date -u '+%H:%M:%S.%3N')
    local outcome="resumed, 200 tokens"
    # the watchdog may come after a failed request's end
    exited() { ! kill -0 "${WPID[$victim]}" 2> /dev/null; }
    wait_until $(( limit / 1000 + 20 )) exited || echo "bench/wedge.sh: $victim never exited" >&2
    [ "$rc" = 0 ] || outcome="failed: $(tail -1 "$T/err" | sed 's/ after: .*//')"
    python3 - "$T/coordinator.log" "$wedged" "$ended" "$victim" "$1 ($limit)" "$outcome" <<'PY'
import re, sys
log, wedged, ended, victim, setting, outcome = sys.argv[1:]
def ms(t):
    h, m, s = t.split(":")
    return (int(h) * 3600 + int(m) * 60) * 1000 + round(float(s) * 1000)
t0 = ms(wedged)
def since(t):
    return "%.1f s" % (((ms(t) - t0) % 86400000) / 1000)
first = {}
for line in open(log):
    m = re.match(r"(\d\d:\d\d:\d\d\.\d\d\d) ", line)
    if not m or ms(m.group(1)) < t0 and (t0 - ms(m.group(1))) < 43200000:
        continue
    for key, pat in (("interrupt", " interrupted after "), ("rewire", "INFO coordinator: rewire "),
                     ("watchdog", "worker %s is dead" % victim)):
        if key not in first and pat in line:
            first[key] = since(m.group(1))
print("%-22s %10s %8s %9s %8s  %s" % (setting, first.get("interrupt", "-"),
      first.get("rewire", "-"), first.get("watchdog", "-"), since(ended), outcome))
PY
)

for s in "${settings[@]}"; do run "$s" || exit 1; done
echo "(times from the wedge; watchdog: the wedged worker reports itself stuck and is declared dead;"
echo " end: the request's last token, or its failure)"
