# A tensor-parallel peer stalls in the middle of a request while its group
# runs over NCCL, through real daemons on a machine without a GPU: fake-NCCL
# workers (tessera-worker-fake-nccl) with TSR_TEST_FAKE_NCCL=tcp, whose
# groups span processes, on distinct stand-in GPUs, so the cuda tp=2
# replica's TP group is NCCL's.  Its tokens equal a cpu tp=2 deployment's
# with the same dtypes (both add the ranks' parts in rank order).  Rank 1
# is stopped (SIGSTOP) mid-request: rank 0's all-reduce never completes
# (nothing else of rank 1's is on rank 0's path: the leader only sends it
# step headers), the coordinator declares the silent worker dead and starts
# a new epoch, which ends rank 0's wait and aborts its communicator well
# before the operation's own deadline; the spare takes the piece, the group
# forms again, and the request resumes and ends with the tokens of an
# undisturbed run.  The rank 0 worker process lives on.
source "$(dirname "$0")/lib.sh"
{ coordinator_yaml; echo "deployments:"; duo_deployment; nccl_test_deployment plain cpu 2 1
} > "$T/d.yaml"
start_coord "$T/d.yaml"
start_worker c0 --device cpu
start_worker c1 --device cpu
start_fake_nccl_gpus 3
wait_until 30 all_ready || fail "not ready"
relayed() { status_json | jget "d['coordinator']['stats']['rendezvous_relayed']"; }
[ "$(relayed)" -ge 1 ] || fail "no NCCL blob was relayed: the TP group is not NCCL's"
r0=$(piece_holder 0 0 0) r1=$(piece_holder 0 0 1)
grep -q "(rank 0 of 2, epoch [0-9]*): NCCL$" "$T/$r0.log" || fail "$r0 did not form the TP group over NCCL"
ref=$(tsr generate duo --prompt-ids 1,2,3 --max-tokens 200 --ids) || fail "the reference run failed"
cpu=$(tsr generate plain --prompt-ids 1,2,3 --max-tokens 200 --ids) || fail "the cpu run failed"
[ "$(echo "$ref" | wc -w)" = 200 ] || fail "expected 200 tokens: $ref"
[ "$ref" = "$cpu" ] || fail "tp=2 over NCCL: $ref; cpu tp=2: $cpu"
# Rank 1 stalls once the request's first token is out.
replayed() { status_json | jget "d['coordinator']['stats']['requests_replayed']"; }
before=$(replayed)
t0=$(now_ms)
tsr generate duo --prompt-ids 1,2,3 --max-tokens 200 --ids > /dev/null
echo "(an undisturbed 200-token request takes $(( $(now_ms) - t0 )) ms)"
tsr generate duo --prompt-ids 1,2,3 --max-tokens 200 --ids --token-timeout 60000 > "$T/out" 2> "$T/err" &
GEN=$!
first_token_arrived
kill -STOP "${WPID[$r1]}"
killed=$(now_ms)
wait "$GEN" || fail "the request failed: $(cat "$T/err")"
took=$(( $(now_ms) - killed ))
kill -9 "${WPID[$r1]}"
# What ended rank 0's wait: the new epoch, once the coordinator declared
# rank 1 dead (worker_timeout_ms 1000), not the operation's own 10 s deadline.
grep -q "(rank 0 of 2, epoch [0-9]*): nccl collectives aborted: NCCL [a-z-]* (rank 0 of 2, epoch [0-9]*) was abandoned: a newer epoch" "$T/$r0.log" ||
    fail "$r0's NCCL wait was not ended by the new epoch: $(grep -h 'aborted' "$T/$r0.log" | head -2)"
! grep -q "did not complete within" "$T/$r0.log" || fail "$r0 waited for the operation's deadline"
[ "$(cat "$T/out")" = "$ref" ] || fail "resumed tokens differ: $(cat "$T/out") vs $ref"
[ "$(replayed)" -gt "$before" ] || fail "the request was not resumed: it ended before rank 1 stalled"
[ "$(piece_holder 0 0 1)" != "$r1" ] || fail "rank 1 is still on $r1"
kill -0 "${WPID[$r0]}" || fail "$r0, the surviving rank, exited"
[ "$(grep -c "(rank 0 of 2, epoch [0-9]*): NCCL$" "$T/$r0.log")" -ge 2 ] ||
    fail "$r0 did not form the TP group again"
ok "rank 1 ($r1) stalled mid-request over NCCL: the new epoch ended $r0's wait and aborted it, the group formed again with the spare, the request ended $took ms later with the undisturbed run's 200 tokens"
