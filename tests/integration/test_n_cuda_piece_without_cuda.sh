# A cuda piece on a worker that cannot run it fails with the reason in
# status; it never runs on the CPU engine.  The worker stands in for a GPU
# through TSR_TEST_FAKE_CUDA_MIB (no GPU on this machine).  Built without
# CUDA, the reason is that; built with it (CI compiles the CUDA engine), it
# is the CUDA runtime's answer that there is no device.
source "$(dirname "$0")/lib.sh"
if "$BIN/tessera-worker" --help 2>&1 | grep -q "built with CUDA"; then
    reason="cuda device 0"
else
    reason="built without CUDA"
fi
if [ -e /dev/nvidia0 ]; then echo "skip: this machine has a GPU"; exit 0; fi
write_yaml "$T/d.yaml" 1 1 1 tiny "$MODEL" cuda
start_coord "$T/d.yaml"
TSR_TEST_FAKE_CUDA_MIB=16384 start_worker g0 --device cuda
shows() {
    status_json | jget "d['deployments'][0]['state'] + ': ' + d['deployments'][0]['message']" |
        grep -q "^failed: .*$reason"
}
wait_until 10 shows || fail "status: $(status_json | jget "d['deployments'][0]")"
echo "status: $(status_json | jget "d['deployments'][0]['message']")"
[ "$(worker_field g0 state)" != ready ] || fail "the cuda piece reported ready"
# Nothing was loaded on the CPU: the worker holds no weights.
[ "$(worker_field g0 weight_bytes)" = 0 ] || fail "the worker loaded weights: $(worker_field g0 weight_bytes)"
out=$(tsr generate tiny --prompt-ids 1,2 --max-tokens 2 2>&1) && fail "generate succeeded: $out"
ok "a cuda piece on a worker that cannot run it is failed with the reason ($reason), and serves nothing"
