# Every rank of an idle replica wedged inside a collective while their
# processes still heartbeat: no peer is left to reach a deadline and report
# it.  Fake-NCCL workers (TSR_TEST_FAKE_NCCL=tcp) on distinct stand-in GPUs,
# a cuda tp=2 replica with collective_timeout_ms 1000 and two spares; both
# ranks get SIGUSR1 (their next all-reduce sleeps for good) while idle.  The
# next canary's all-reduce wedges them: no token within canary_timeout_ms,
# so the replica is marked unhealthy, and the coordinator rewires it after
# the backoff (2 s).  Neither rank's data plane takes the new epoch, so
# each one's watchdog reports it stuck (fatal) and the worker exits 75; the
# spares take both pieces, and a request then gets the tokens the replica
# gave before.
source "$(dirname "$0")/lib.sh"
{ coordinator_yaml "canary_interval_ms: 500" "canary_timeout_ms: 1000"
  echo "deployments:"; duo_deployment "collective_timeout_ms: 1000"; } > "$T/d.yaml"
start_coord "$T/d.yaml"
start_fake_nccl_gpus 4
wait_until 30 all_ready || fail "not ready"
r0=$(piece_holder 0 0 0) r1=$(piece_holder 0 0 1)
ref=$(tsr generate duo --prompt-ids 1,2,3 --max-tokens 50 --ids) || fail "the reference run failed"
kill -USR1 "${WPID[$r0]}" "${WPID[$r1]}"
wedged=$(now_ms)
gone() { ! kill -0 "${WPID[$r0]}" 2> /dev/null && ! kill -0 "${WPID[$r1]}" 2> /dev/null; }
wait_until 30 gone || fail "the wedged workers are still running: $(grep -h 'stuck\|unhealthy' "$T/$r0.log" "$T/$r1.log" "$T/coordinator.log" | head -3)"
for w in "$r0" "$r1"; do
    grep -q "this all-reduce is stuck for good" "$T/$w.log" || fail "$w was not wedged"
    wait "${WPID[$w]}"; rc=$?
    [ "$rc" = 75 ] || fail "$w exited with $rc, not 75"
    case "$(worker_field "$w" reason)" in
        *"data-plane thread is stuck"*) ;;
        *) fail "$w's reason: $(worker_field "$w" reason)" ;;
    esac
done
grep -q "replica 0 is unhealthy: its canary" "$T/coordinator.log" || fail "the canary did not find the replica"
grep -q "replica 0: unhealthy (.*); rewiring in" "$T/coordinator.log" || fail "the unhealthy replica was not rewired"
wait_until 30 all_ready || fail "not ready again"
took=$(( $(now_ms) - wedged ))
[ "$(piece_holder 0 0 0)" != "$r0" ] && [ "$(piece_holder 0 0 1)" != "$r1" ] || fail "a piece did not move"
out=$(tsr generate duo --prompt-ids 1,2,3 --max-tokens 50 --ids) || fail "the request after recovery failed"
[ "$out" = "$ref" ] || fail "tokens differ after recovery: $out vs $ref"
ok "both ranks of an idle replica wedged: the canary found it unhealthy, the rewire made both watchdogs report stuck, both exited 75, the spares served it again $took ms after the wedge with the same tokens"
