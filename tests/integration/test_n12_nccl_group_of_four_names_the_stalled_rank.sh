# A tensor-parallel group of four over NCCL whose rank 2 is wedged inside an
# all-reduce while its process still heartbeats.  The other ranks' operations
# end at the deadline, and none of them can say whom it waited for (NCCL
# gives "one of the other 3 ranks"); each reports that the operation passed
# its deadline, and the coordinator marks the member that reported nothing,
# rank 2, as the one the group waited for (status --json: its rank's
# waited_for; the deployment's message names its worker; `tessera status`
# marks its line) until the rewire.  The wedged
# worker's watchdog then reports it stuck, the spare takes its piece, and
# the request in flight ends with the tokens of an undisturbed run.
# Fake-NCCL workers with TSR_TEST_FAKE_NCCL=tcp on distinct stand-in GPUs;
# SIGUSR1 wedges a worker's next all-reduce.
source "$(dirname "$0")/lib.sh"
{ coordinator_yaml; echo "deployments:"
  nccl_test_deployment quad cuda 4 1 "collective_timeout_ms: 1000"; } > "$T/d.yaml"
start_coord "$T/d.yaml"
start_fake_nccl_gpus 5
wait_until 40 all_ready || fail "not ready"
for t in 0 1 2 3; do rank[$t]=$(piece_holder 0 0 "$t"); done
grep -q "(rank 0 of 4, epoch [0-9]*): NCCL$" "$T/${rank[0]}.log" ||
    fail "${rank[0]} did not form the TP group over NCCL"
ref=$(tsr generate quad --prompt-ids 1,2,3 --max-tokens 200 --ids) || fail "the reference run failed"
[ "$(echo "$ref" | wc -w)" = 200 ] || fail "expected 200 tokens: $ref"

# marks: each rank's waited_for (1 or 0), space-separated, and the message.
marks() {
    status_json | jget "' '.join(str(int(bool(r.get('waited_for')))) for r in d['deployments'][0]['replica_list'][0]['stages'][0]['ranks']) + '|' + d['deployments'][0]['message']"
}
# marked: the JSON marks rank 2 alone, and `tessera status` shows it on rank 2's line.
marked() {
    MARKS=$(marks)
    [ "${MARKS%%|*}" = "0 0 1 0" ] &&
        tsr status | grep -E "^ +0 +0 +[0-9-]+ +2 +$victim .*\(its group waited for it past the deadline\)" > /dev/null
}

victim=${rank[2]}
tsr generate quad --prompt-ids 1,2,3 --max-tokens 200 --ids --token-timeout 60000 > "$T/out" 2> "$T/err" &
GEN=$!
first_token_arrived
kill -USR1 "${WPID[$victim]}"
poll_until 10 0.02 marked || fail "rank 2 ($victim) was not marked as waited for: ${MARKS:-nothing}"
case "${MARKS#*|}" in
    *"its tensor-parallel group waited for $victim (stage 0 tp 2), which reported no failure"*) ;;
    *) fail "the message does not name $victim: ${MARKS#*|}" ;;
esac
for t in 0 1 3; do
    grep -q "did not complete within 1000 ms: one of the other 3 ranks is dead or stalled" \
        "$T/${rank[$t]}.log" || fail "rank $t (${rank[$t]}) did not fail at its deadline"
done
grep -q "this all-reduce is stuck for good" "$T/$victim.log" || fail "$victim was not wedged"
wait "$GEN" || fail "the request failed with rank 2 wedged: $(cat "$T/err")"
[ "$(cat "$T/out")" = "$ref" ] || fail "resumed tokens differ: $(cat "$T/out") vs $ref"
exited() { ! kill -0 "${WPID[$victim]}" 2> /dev/null; }
wait_until 10 exited || fail "$victim (rank 2, wedged) is still running"
[ "$(piece_holder 0 0 2)" != "$victim" ] || fail "rank 2 is still on $victim"
ok "rank 2 ($victim) of four wedged: the three others failed at the deadline naming no one, the coordinator marked $victim as the one they waited for, it was replaced, and the request ended with the undisturbed tokens"
