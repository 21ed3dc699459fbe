#!/bin/bash
# Chaos: a local cluster of 2 replicas of tp=2 pp=2 plus a spare, several
# clients streaming greedy requests, and for a bounded time random faults:
# workers killed (-9) and restarted, workers stopped (SIGSTOP, then SIGCONT
# after up to 2 s), the coordinator killed and restarted, and the YAML edited
# between two layouts (then `tessera reload`).  Every request is checked
# against the NumPy reference.  Prints what was sent, completed, failed with a
# clear error, lost, duplicated or skipped, and the recovery time after each
# fault (p50, p99); exits non-zero when a request is lost, duplicated,
# skipped, wrong, or (with a spare and a second replica, as here) failed.
#
# With --netns (root) each worker runs in its own network namespace behind a
# bridge (tests/chaos/netns.sh), and the faults are network ones instead:
# one worker's link cut for up to 3 s, two workers' links cut at once, the
# coordinator's link cut for up to 2 s, and a link flapping; no process is
# killed or stopped, and the YAML is not edited.
#
#   tests/chaos/chaos.sh [--netns] [SECONDS]   (default $CHAOS_SECONDS, else 60)
#   CHAOS_CLIENTS (3), CHAOS_SEED (random; printed, to rerun a sequence)
NETNS=0
[ "${1:-}" = --netns ] && { NETNS=1; shift; }
source "$(dirname "$0")/../integration/lib.sh"
SECS=${1:-${CHAOS_SECONDS:-60}}
CLIENTS=${CHAOS_CLIENTS:-3}
SEED=${CHAOS_SEED:-$(( $(date +%s) % 32768 ))}
RANDOM=$SEED
MAXT=32
NWORK=9

layout=0
write_layout() {  # 0: tp 2 x pp 2 x 2 replicas; 1: tp 1 x pp 2 x 2 replicas
    if [ "$1" = 0 ]; then write_yaml "$T/next.yaml" 2 2 2; else write_yaml "$T/next.yaml" 1 2 2; fi
    mv "$T/next.yaml" "$T/d.yaml"
}
if [ $NETNS = 1 ]; then
    source "$(dirname "$0")/netns.sh"
    # The namespaces go before lib.sh's cleanup, which keeps the exit status.
    trap 'rc=$?; net_down; (exit $rc); cleanup' EXIT
    net_up $NWORK
    WEP="tcp://$NET_COORD:$WPORT"
fi
write_layout 0
start_coord "$T/d.yaml"
for i in $(seq 0 $((NWORK - 1))); do
    if [ $NETNS = 1 ]; then start_worker_ns "$i" "w$i"; else start_worker "w$i"; fi
done
wait_until 30 all_ready || fail "not ready (netns $NETNS)"

PROMPTS=("1,2,3" "7,40,9,11" "100,5" "3,14,15,92,65")
REFS=()
for p in "${PROMPTS[@]}"; do
    REFS+=("$(python3 "$ROOT/tests/reference/llama_ref.py" "$MODEL" --prompt-ids "$p" --max-tokens $MAXT)") \
        || fail "reference failed"
done

# One client: requests back to back until $T/stop exists; one result line
# per request in $T/results.C.
client() {
    local c=$1 k=0
    while [ ! -e "$T/stop" ]; do
        local p=$(( (c + k) % ${#PROMPTS[@]} )); k=$((k + 1))
        local out="$T/c$c.out" err="$T/c$c.err"
        tsr --timeout 5000 generate tiny --prompt-ids "${PROMPTS[$p]}" --max-tokens $MAXT --ids \
            --token-timeout 20000 > "$out" 2> "$err"
        local rc=$? got r
        got=$(tr -s ' \n' ',' < "$out" | sed 's/^,//; s/,$//')
        if [ $rc = 0 ] && [ "$got" = "${REFS[$p]}" ]; then r=completed
        elif [ $rc = 0 ]; then r=wrong
        elif grep -q "arrived twice" "$err"; then r=duplicated
        elif grep -q "never arrived" "$err"; then r=skipped
        elif grep -qE "no token from|no answer from|did not take the request back" "$err"; then r=lost
        else r=failed
        fi
        echo "$r $(tr '\n' ' ' < "$err" | cut -c1-300)" >> "$T/results.$c"
    done
}
CPIDS=()
for c in $(seq 1 "$CLIENTS"); do client "$c" & CPIDS+=("$!"); done

kills=0 stops=0 restarts=0 reshards=0 unrecovered=0 cuts=0 cuts2=0 ccuts=0 flaps=0
# net_fault: one network fault (the --netns variant); sets `what`.
# Recovery is timed from the moment the network is whole again.
net_fault() {
    local a=$(( RANDOM % 10 )) x y
    if [ $a -le 4 ]; then
        x="w$(( RANDOM % NWORK ))"
        net_cut "$x"; sleep "$(( RANDOM % 3 )).$(( RANDOM % 10 ))"; net_restore "$x"
        t0=$(now_ms)
        cuts=$((cuts + 1)); what="link of $x cut"
    elif [ $a -le 6 ]; then
        x=$(( RANDOM % NWORK )); y=$(( (x + 1 + RANDOM % (NWORK - 1)) % NWORK ))
        net_cut "w$x"; net_cut "w$y"; sleep "$(( RANDOM % 2 )).$(( RANDOM % 10 ))"
        net_restore "w$x"; net_restore "w$y"
        t0=$(now_ms)
        cuts2=$((cuts2 + 1)); what="links of w$x and w$y cut"
    elif [ $a -le 8 ]; then
        net_cut c; sleep "$(( RANDOM % 2 )).$(( RANDOM % 10 ))"; net_restore c
        t0=$(now_ms)
        ccuts=$((ccuts + 1)); what="coordinator's link cut"
    else
        x="w$(( RANDOM % NWORK ))"
        for y in 1 2 3 4; do net_cut "$x"; sleep 0.1; net_restore "$x"; sleep 0.2; done
        t0=$(now_ms)
        flaps=$((flaps + 1)); what="link of $x flapping"
    fi
}
RECOVERY=()
end=$(( $(date +%s) + SECS ))
while [ "$(date +%s)" -lt "$end" ]; do
    sleep "0.$(( RANDOM % 5 + 3 ))"
    a=$(( RANDOM % 10 ))
    t0=$(now_ms)
    if [ $NETNS = 1 ]; then
        net_fault
    elif [ $a -le 3 ]; then
        v="w$(( RANDOM % NWORK ))"
        kill -9 "${WPID[$v]}" 2>/dev/null; wait "${WPID[$v]}" 2>/dev/null
        sleep 0.5
        start_worker "$v"
        kills=$((kills + 1)); what="kill -9 $v"
    elif [ $a -le 5 ]; then
        v="w$(( RANDOM % NWORK ))"
        kill -STOP "${WPID[$v]}"; sleep "$(( RANDOM % 2 )).$(( RANDOM % 10 ))"; kill -CONT "${WPID[$v]}"
        stops=$((stops + 1)); what="SIGSTOP $v"
    elif [ $a -le 6 ]; then
        kill -9 "$COORD_PID"; wait "$COORD_PID" 2>/dev/null
        sleep 0.3
        start_coord "$T/d.yaml"
        restarts=$((restarts + 1)); what="coordinator restart"
    else
        layout=$(( 1 - layout )); write_layout $layout
        tsr reload > /dev/null 2>&1 || tsr reload > /dev/null 2>&1
        reshards=$((reshards + 1)); what="reshard to layout $layout"
    fi
    if wait_until 30 all_ready; then
        RECOVERY+=($(( $(now_ms) - t0 )))
    else
        unrecovered=$((unrecovered + 1))
        echo "chaos: not ready 30 s after $what"
    fi
done
touch "$T/stop"
for p in "${CPIDS[@]}"; do wait "$p"; done

cat "$T"/results.* > "$T/results"
count() { grep -c "^$1 " "$T/results"; }
sent=$(wc -l < "$T/results")
completed=$(count completed) failed=$(count failed) lost=$(count lost)
dup=$(count duplicated) skipped=$(count skipped) wrong=$(count wrong)
pct() {  # pct P: the P-th percentile of RECOVERY (ms)
    printf '%s\n' "${RECOVERY[@]}" | sort -n | awk -v p="$1" '{a[NR]=$1} END {
        if (!NR) { print "-"; exit } i = int((NR * p + 99) / 100); if (i < 1) i = 1; print a[i] }'
}
replayed=$(status_json | jget "d['coordinator']['stats']['requests_replayed']" 2>/dev/null)
if [ $NETNS = 1 ]; then
    echo "chaos (network namespaces): $SECS s, seed $SEED, $NWORK workers each in its own" \
         "namespace (2 replicas of tp=2 pp=2 plus a spare), $CLIENTS clients, $MAXT greedy" \
         "tokens per request, $(nproc) CPU(s)"
    echo "faults: $cuts one link cut, $cuts2 two links cut, $ccuts coordinator link cut," \
         "$flaps link flapping; $unrecovered not ready within 30 s"
else
    echo "chaos: $SECS s, seed $SEED, $NWORK workers (2 replicas of tp=2 pp=2, or tp=1 pp=2 after a" \
         "reshard, plus spares), $CLIENTS clients, $MAXT greedy tokens per request, $(nproc) CPU(s)"
    echo "faults: $kills kill -9, $stops SIGSTOP, $restarts coordinator restarts, $reshards reshards;" \
         "$unrecovered not ready within 30 s"
fi
echo "requests: sent $sent, completed $completed, failed with a clear error $failed, lost $lost," \
     "duplicated $dup, skipped $skipped, wrong tokens $wrong (replayed by the last coordinator: ${replayed:-?})"
echo "recovery to all-ready after a fault: p50 $(pct 50) ms, p99 $(pct 99) ms (${#RECOVERY[@]} faults)"
grep -v "^completed " "$T/results" | sort | uniq -c | sort -rn | head -5
[ "$sent" -gt 0 ] || fail "no request was sent"
[ "$lost" = 0 ] && [ "$dup" = 0 ] && [ "$skipped" = 0 ] && [ "$wrong" = 0 ] \
    || fail "lost $lost, duplicated $dup, skipped $skipped, wrong $wrong"
[ "$failed" = 0 ] || fail "$failed request(s) failed although a spare and a second replica exist"
[ "$unrecovered" = 0 ] || fail "$unrecovered fault(s) left the deployment not ready for 30 s"
ok "chaos: $completed of $sent requests completed with the reference's tokens"
