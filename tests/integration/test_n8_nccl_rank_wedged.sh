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

# wedge RANK: a 200-token request, the worker of TP rank RANK wedged after
# its first token; the other rank must name it at the deadline, the wedged
# worker report itself stuck (the reason that declared it dead: its
# heartbeats went on until it exited) and exit 75, the piece move, the
# request resume with the reference's tokens, and the other rank live on.
# Sets took: ms from the wedge to the request's end.
wedge() {
    local rank=$1 other=$(( 1 - $1 ))
    local victim peer before wedged rc
    victim=$(piece_holder 0 0 "$rank") peer=$(piece_holder 0 0 "$other")
    before=$(replayed)
    tsr generate duo --prompt-ids 1,2,3 --max-tokens 200 --ids --token-timeout 60000 > "$T/out" 2> "$T/err" &
    GEN=$!
    first_token_arrived
    kill -USR1 "${WPID[$victim]}"
    wedged=$(now_ms)
    wait "$GEN" || fail "the request failed with rank $rank wedged: $(cat "$T/err")"
    took=$(( $(now_ms) - wedged ))
    [ "$(cat "$T/out")" = "$ref" ] || fail "resumed tokens differ: $(cat "$T/out") vs $ref"
    [ "$(replayed)" -gt "$before" ] || fail "the request was not resumed: it ended before rank $rank was wedged"
    grep -q "this all-reduce is stuck for good" "$T/$victim.log" || fail "$victim was not wedged"
    grep -q "did not complete within 1000 ms: rank $rank is dead or stalled" "$T/$peer.log" ||
        fail "$peer did not name rank $rank: $(grep -h 'failed' "$T/$peer.log" | head -2)"
    exited() { ! kill -0 "${WPID[$victim]}" 2> /dev/null; }
    wait_until 10 exited || fail "$victim (rank $rank, wedged) is still running"
    wait "${WPID[$victim]}"; rc=$?
    [ "$rc" = 75 ] || fail "$victim exited with $rc, not 75"
    case "$(worker_field "$victim" reason)" in
        *"data-plane thread is stuck"*"limit 2000 ms, from collective_timeout_ms"*) ;;
        *) fail "$victim's reason: $(worker_field "$victim" reason)" ;;
    esac
    [ "$(piece_holder 0 0 "$rank")" != "$victim" ] || fail "rank $rank is still on $victim"
    kill -0 "${WPID[$peer]}" || fail "$peer, the surviving rank, exited"
    WEDGED=$victim
}

wedge 1
msg1="rank 1 ($WEDGED) wedged: named at the 1000 ms deadline, reported itself stuck, exited 75, replaced; the request ended $took ms later with the undisturbed tokens"
# The leader (it holds the request), wedged the same way, with a new spare.
start_worker g3 --device cuda --device-index 3
spare_idle() { [ "$(worker_field g3 state 2> /dev/null)" = idle ]; }
wait_until 30 all_ready || fail "not ready again"
wait_until 10 spare_idle || fail "the new spare did not register"
wedge 0
ok "$msg1; then the leader ($WEDGED) the same way, the request ending $took ms after the wedge"
