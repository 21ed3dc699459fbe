# A tensor-parallel rank wedged inside a collective while its process still
# heartbeats: its thread stuck for good in an all-reduce (as in a driver call
# that never returns), which no deadline, abort or newer epoch reaches.
# Fake-NCCL workers with TSR_TEST_FAKE_NCCL=tcp on distinct stand-in GPUs
# (the cuda tp=2 replica's TP group is NCCL's) and collective_timeout_ms
# 1000; SIGUSR1 wedges the worker's next all-reduce.  Rank 1 is wedged
# mid-request: rank 0's operation fails at its deadline naming rank 1 and
# the replica is rewired; rank 1's worker still heartbeats, but its data
# plane never takes the new epoch, so its watchdog reports the piece failed,
# fatal, after collective_timeout_ms (at least 2 s) and the worker exits 75 (systemd would
# restart it).  The coordinator declares it dead at that report, the spare
# takes the piece, and the request resumes and ends with the tokens of an
# undisturbed run.  Rank 0's worker lives on.  Then the same with the
# replica's leader (rank 0, which holds the request) wedged: rank 1 names
# it, and it is replaced the same way.
source "$(dirname "$0")/lib.sh"
{ coordinator_yaml; echo "deployments:"; duo_deployment "collective_timeout_ms: 1000"; } > "$T/d.yaml"
start_coord "$T/d.yaml"
start_fake_nccl_gpus 3
wait_until 30 all_ready || fail "not ready"
r0=$(piece_holder 0 0 0) r1=$(piece_holder 0 0 1)
grep -q "(rank 0 of 2, epoch [0-9]*): NCCL$" "$T/$r0.log" || fail "$r0 did not form the TP group over NCCL"
ref=$(tsr generate duo --prompt-ids 1,2,3 --max-tokens 200 --ids) || fail "the reference run failed"
[ "$(echo "$ref" | wc -w)" = 200 ] || fail "expected 200 tokens: $ref"
replayed() { status_json | jget "d['coordinator']['stats']['requests_replayed']"; }
before=$(replayed)
tsr generate duo --prompt-ids 1,2,3 --max-tokens 200 --ids --token-timeout 60000 > "$T/out" 2> "$T/err" &
GEN=$!
first_token_arrived
kill -USR1 "${WPID[$r1]}"
wedged=$(now_ms)
wait "$GEN" || fail "the request failed: $(cat "$T/err")"
took=$(( $(now_ms) - wedged ))
[ "$(cat "$T/out")" = "$ref" ] || fail "resumed tokens differ: $(cat "$T/out") vs $ref"
[ "$(replayed)" -gt "$before" ] || fail "the request was not resumed: it ended before rank 1 was wedged"
grep -q "this all-reduce is stuck for good" "$T/$r1.log" || fail "$r1 was not wedged"
# Rank 0 named rank 1 at the operation's deadline.
grep -q "did not complete within 1000 ms: rank 1 is dead or stalled" "$T/$r0.log" ||
    fail "$r0 did not name rank 1: $(grep -h 'failed' "$T/$r0.log" | head -2)"
# The wedged worker reported itself and exited 75, declared dead by that
# report (its heartbeats went on until it exited).
exited() { ! kill -0 "${WPID[$r1]}" 2> /dev/null; }
wait_until 10 exited || fail "$r1 is still running"
wait "${WPID[$r1]}"; rc=$?
[ "$rc" = 75 ] || fail "$r1 exited with $rc, not 75"
case "$(worker_field "$r1" reason)" in
    *"data-plane thread is stuck"*"limit 2000 ms, from collective_timeout_ms"*) ;;
    *) fail "$r1's reason: $(worker_field "$r1" reason)" ;;
esac
[ "$(piece_holder 0 0 1)" != "$r1" ] || fail "rank 1 is still on $r1"
kill -0 "${WPID[$r0]}" || fail "$r0, the surviving rank, exited"
msg1="rank 1 ($r1) wedged: $r0 named it at the 1000 ms deadline, $r1 reported itself stuck and exited 75, the spare took the piece, the request ended $took ms later with the undisturbed tokens"

# The leader, wedged in the same way, with a new spare standing by.
start_worker g3 --device cuda --device-index 3
spare_idle() { [ "$(worker_field g3 state 2> /dev/null)" = idle ]; }
wait_until 30 all_ready || fail "not ready again"
wait_until 10 spare_idle || fail "the new spare did not register"
l0=$(piece_holder 0 0 0) l1=$(piece_holder 0 0 1)
before=$(replayed)
tsr generate duo --prompt-ids 1,2,3 --max-tokens 200 --ids --token-timeout 60000 > "$T/out" 2> "$T/err" &
GEN=$!
first_token_arrived
kill -USR1 "${WPID[$l0]}"
wedged=$(now_ms)
wait "$GEN" || fail "the request failed with the leader wedged: $(cat "$T/err")"
took=$(( $(now_ms) - wedged ))
[ "$(cat "$T/out")" = "$ref" ] || fail "resumed tokens differ: $(cat "$T/out") vs $ref"
[ "$(replayed)" -gt "$before" ] || fail "the request was not resumed: it ended before the leader was wedged"
grep -q "did not complete within 1000 ms: rank 0 is dead or stalled" "$T/$l1.log" ||
    fail "$l1 did not name rank 0"
exited() { ! kill -0 "${WPID[$l0]}" 2> /dev/null; }
wait_until 10 exited || fail "$l0 (the wedged leader) is still running"
wait "${WPID[$l0]}"; rc=$?
[ "$rc" = 75 ] || fail "$l0 exited with $rc, not 75"
[ "$(piece_holder 0 0 0)" != "$l0" ] || fail "the leader's piece is still on $l0"
kill -0 "${WPID[$l1]}" || fail "$l1, the surviving rank, exited"
ok "$msg1; then the leader ($l0) wedged the same way was replaced and the request ended $took ms later with the same tokens"
