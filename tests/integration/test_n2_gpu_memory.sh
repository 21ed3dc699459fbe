# The coordinator knows each GPU's memory: a cuda piece whose weights, KV
# pool and reserve do not fit on any registered GPU is not placed, and
# status says why with the numbers; a worker with room takes it.  The GPUs
# are stand-ins (TSR_TEST_FAKE_CUDA_MIB); the model is Llama 3.1 8B's
# config.json, which is all the coordinator reads.
source "$(dirname "$0")/lib.sh"
write_yaml "$T/d.yaml" 1 1 1 big "$ROOT/configs/models/llama-3.1-8b" cuda
start_coord "$T/d.yaml"
TSR_TEST_FAKE_CUDA_MIB=16384 start_worker g16 --device cuda
says() {
    status_json | jget "d['deployments'][0]['state'] + ': ' + d['deployments'][0]['message']" |
        grep -q "^waiting: needs 1 more cuda worker: stage 0 needs [0-9.]* GiB per cuda worker; the largest, g16, has 16.0 GiB"
}
wait_until 10 says || fail "status: $(status_json | jget "d['deployments'][0]")"
echo "status: $(status_json | jget "d['deployments'][0]['message']")"
need=$(status_json | jget "d['deployments'][0]['needs']['memory_bytes']")
[ "$need" -gt $((16 << 30)) ] || fail "needs.memory_bytes: $need"
[ "$(worker_field g16 state)" = idle ] || fail "the 16 GiB worker was given the piece"
# A GPU with room: the piece goes there, not to the small one.
TSR_TEST_FAKE_CUDA_MIB=81920 start_worker g80 --device cuda
# (The stand-in cannot load it: the piece then shows failed, on g80.)
on_g80() { [ "$(piece_holder 0 0 0)" = g80 ]; }
wait_until 10 on_g80 || fail "not placed on the 80 GiB worker: $(status_json | jget "d['deployments'][0]")"
[ "$(worker_field g16 state)" = idle ] || fail "the 16 GiB worker holds a piece"
ok "a cuda piece that fits no GPU waits with the numbers; a GPU with room takes it"
