# An NCCL communicator that reports an asynchronous error in the middle of a
# request, through real daemons on a machine without a GPU: the fake-NCCL
# worker (tessera-worker-fake-nccl) serves a cuda tp=1 piece whose stage
# forms a group of one (TSR_TEST_NCCL_SOLO=1), and its group fails at the
# 60th all-reduce (TSR_TEST_FAKE_NCCL_ERROR_AFTER), a few steps into the
# request.  The rank aborts the communicator and reports the failure, the
# worker process survives, the replica is rewired (a new communicator in
# the next epoch), and the request resumes and ends with the tokens of an
# undisturbed run.
source "$(dirname "$0")/lib.sh"
{ coordinator_yaml; cat <<YAML
deployments:
  - name: tiny
    model: $MODEL
    device: cuda
    parallel: {tensor: 1, pipeline: 1, replicas: 1}
    max_seq_len: 256
    kv_cache_mib: 8
YAML
} > "$T/d.yaml"
start_coord "$T/d.yaml"
use_fake_nccl_worker
export TSR_TEST_NCCL_SOLO=1
TSR_TEST_FAKE_NCCL_ERROR_AFTER=60 start_worker w0 --device cuda
wait_until 30 all_ready || fail "not ready"
start_worker w1 --device cuda
spare_idle() { [ "$(worker_field w1 state)" = idle ]; }
wait_until 10 spare_idle || fail "the spare did not register"
replayed() { status_json | jget "d['coordinator']['stats']['requests_replayed']"; }
before=$(replayed)
out=$(tsr generate tiny --prompt-ids 1,2,3 --max-tokens 20 --ids 2> "$T/gen.err") ||
    fail "the request failed: $(cat "$T/gen.err")"
[ "$(echo "$out" | wc -w)" = 20 ] || fail "expected 20 tokens: $out"
[ "$(replayed)" -gt "$before" ] || fail "the request was not resumed: the error did not reach it"
kill -0 "${WPID[w0]}" || fail "the worker whose group failed exited"
grep -q "NCCL reported an error during all-reduce" "$T/w0.log" || fail "w0 did not report NCCL's error"
wait_until 10 all_ready || fail "not ready again"
ref=$(tsr generate tiny --prompt-ids 1,2,3 --max-tokens 20 --ids) || fail "the reference run failed"
[ "$out" = "$ref" ] || fail "resumed tokens differ: $out vs $ref"
ok "an asynchronous NCCL error mid-request: the rank aborted and reported it, the worker lives, the request resumed with the same 20 tokens"
