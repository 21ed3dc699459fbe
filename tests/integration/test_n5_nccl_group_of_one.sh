# NCCL through the coordinator, on a machine without a GPU: workers whose
# cuda row is the CPU engine over the fake NCCL (tessera-worker-fake-nccl)
# run with TSR_TEST_NCCL_SOLO=1, so each stage of a cuda tp=1 pp=2 replica
# forms its TP group as a group of one, as scripts/gpu-check.sh does with
# the real library on one GPU: rank 0's blob goes to the coordinator and
# back, the group forms from that copy, and the stage's sums run through it
# (the stages share a stand-in GPU, so their link takes the TCP fallback).
# The tokens equal a cpu deployment's with the same dtypes.  The stage-1
# worker is killed: the spare takes its piece, both stages form their
# groups again in the next epoch (stage 0's first communicator aborted),
# the tokens are the same, and the killed worker started again registers.
source "$(dirname "$0")/lib.sh"
{ coordinator_yaml; echo "deployments:"; nccl_test_deployment solo cuda 1 2
  nccl_test_deployment plain cpu 1 1; } > "$T/d.yaml"
start_coord "$T/d.yaml"
start_worker c0 --device cpu
use_fake_nccl_worker
export TSR_TEST_FAKE_CUDA_BUS=00000000:01:00.0 TSR_TEST_NCCL_SOLO=1
for w in g0 g1 g2; do start_worker $w --device cuda; done
wait_until 30 all_ready || fail "not ready"
relayed() { status_json | jget "d['coordinator']['stats']['rendezvous_relayed']"; }
r1=$(relayed)
[ "$r1" -ge 2 ] || fail "the coordinator relayed $r1 blobs, expected one per stage at least"
formed() { grep -c "(rank 0 of 1, epoch [0-9]*): NCCL$" "$T/$1.log"; }
s0=$(piece_holder 0 0 0) s1=$(piece_holder 0 1 0)
[ "$(formed "$s0")" -ge 1 ] && [ "$(formed "$s1")" -ge 1 ] ||
    fail "the stages ($s0, $s1) did not form their groups of one over NCCL"
out=$(tsr generate solo --prompt-ids 1,2,3 --max-tokens 16 --ids) || fail "solo generate failed"
ref=$(tsr generate plain --prompt-ids 1,2,3 --max-tokens 16 --ids) || fail "plain generate failed"
[ "$(echo "$out" | wc -w)" = 16 ] || fail "expected 16 tokens: $out"
[ "$out" = "$ref" ] || fail "groups of one: $out; cpu deployment: $ref"
# The stage-1 worker dies: the spare takes its piece and both stages form again.
kill -9 "${WPID[$s1]}"
s1_gone() { [ "$(piece_holder 0 1 0)" != "$s1" ] && all_ready; }
wait_until 30 s1_gone || fail "stage 1 did not move off $s1"
formed_again() { [ "$(relayed)" -ge $((r1 + 2)) ]; }
wait_until 10 formed_again || fail "the stages' groups were not relayed again ($(relayed) after $r1)"
grep -q "(rank 0 of 1, epoch [0-9]*): nccl collectives aborted" "$T/$s0.log" ||
    fail "$s0 did not abort its communicator"
[ "$(formed "$s0")" -ge 2 ] || fail "$s0 did not form its group of one again"
again=$(tsr generate solo --prompt-ids 1,2,3 --max-tokens 16 --ids) || fail "generate after the kill failed"
[ "$again" = "$out" ] || fail "after the failover: $again, before: $out"
# Started again under its name, the killed worker registers as a spare.
start_worker "$s1" --device cuda
back() { [ "$(worker_field "$s1" state)" = idle ]; }
wait_until 20 back || fail "$s1, started again, is $(worker_field "$s1" state)"
ok "groups of one formed through the coordinator ($r1 blobs relayed, then $(relayed)); $s1 killed: $s0 aborted and formed again, the same 16 tokens; $s1 back as a spare"
