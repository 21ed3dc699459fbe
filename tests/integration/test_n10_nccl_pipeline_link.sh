# A pipeline link over NCCL, through real daemons on a machine without a GPU: fake-NCCL
# workers (tessera-worker-fake-nccl) with TSR_TEST_FAKE_NCCL=tcp, whose groups span
# processes, on distinct stand-in GPUs, so the link between the two stages of a cuda tp=1
# pp=2 replica is an NCCL pair (grouped send and receive), its blob made by stage 0 and
# relayed by the coordinator.  The tokens equal a cpu deployment's with the same dtypes.
# Stage 1's worker is killed (kill -9) mid-request: stage 0's link is aborted, the spare
# takes the piece, the link forms again over NCCL in a later epoch, and the request
# resumes and ends with the tokens of an undisturbed run.  Stage 0's worker lives on.
source "$(dirname "$0")/lib.sh"
{ coordinator_yaml; echo "deployments:"; nccl_test_deployment piped cuda 1 2
  nccl_test_deployment plain cpu 1 1; } > "$T/d.yaml"
start_coord "$T/d.yaml"
start_worker c0 --device cpu
start_fake_nccl_gpus 3
wait_until 30 all_ready || fail "not ready: $(tsr status 2>&1)"
s0=$(piece_holder 0 0 0) s1=$(piece_holder 0 1 0)
linked() { grep -c "(rank $2 of 2, epoch [0-9]*): NCCL$" "$T/$1.log"; }
[ "$(linked "$s0" 0)" -ge 1 ] || fail "stage 0 ($s0) did not form its link over NCCL: $(grep -h group "$T/$s0.log")"
[ "$(linked "$s1" 1)" -ge 1 ] || fail "stage 1 ($s1) did not form its link over NCCL: $(grep -h group "$T/$s1.log")"
relayed() { status_json | jget "d['coordinator']['stats']['rendezvous_relayed']"; }
[ "$(relayed)" -ge 1 ] || fail "no blob was relayed"
ref=$(tsr generate piped --prompt-ids 1,2,3 --max-tokens 200 --ids) || fail "the reference run failed"
cpu=$(tsr generate plain --prompt-ids 1,2,3 --max-tokens 200 --ids) || fail "the cpu run failed"
[ "$(echo "$ref" | wc -w)" = 200 ] || fail "expected 200 tokens: $ref"
[ "$ref" = "$cpu" ] || fail "pp=2 over an NCCL link: $ref; cpu: $cpu"
ok "a cuda tp=1 pp=2 replica whose stage link is an NCCL pair gives a cpu deployment's 200 tokens"
replayed() { status_json | jget "d['coordinator']['stats']['requests_replayed']"; }
before=$(replayed)
tsr generate piped --prompt-ids 1,2,3 --max-tokens 200 --ids --token-timeout 60000 > "$T/out" 2> "$T/err" &
GEN=$!
first_token_arrived
kill -9 "${WPID[$s1]}"
killed=$(now_ms)
wait "$GEN" || fail "the request failed: $(cat "$T/err")"
took=$(( $(now_ms) - killed ))
[ "$(cat "$T/out")" = "$ref" ] || fail "resumed tokens differ: $(cat "$T/out") vs $ref"
[ "$(replayed)" -gt "$before" ] || fail "the request was not resumed: it ended before stage 1 died"
n1=$(piece_holder 0 1 0)
[ "$n1" != "$s1" ] && [ "$n1" != - ] || fail "stage 1 is on '$n1'"
kill -0 "${WPID[$s0]}" || fail "$s0, stage 0's worker, exited"
grep -q "(rank 0 of 2, epoch [0-9]*): nccl collectives aborted" "$T/$s0.log" ||
    fail "$s0 did not abort its NCCL link: $(grep -h 'abort' "$T/$s0.log" | head -3)"
[ "$(linked "$s0" 0)" -ge 2 ] || fail "$s0 did not form its link again over NCCL"
[ "$(linked "$n1" 1)" -ge 1 ] || fail "the spare $n1 did not form the link over NCCL"
ok "stage 1 ($s1) killed mid-request: $s0 aborted its NCCL link, the spare $n1 formed it again, the request ended $took ms later with the undisturbed run's tokens"
