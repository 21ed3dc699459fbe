# A fatal device error (on a GPU: an illegal address, ECC) fails the piece
# with the reason, the worker exits with status 75 so that systemd restarts
# it, the spare takes the piece, and the request that was running resumes
# there and completes with the tokens an undisturbed run gives.  No GPU
# here: the CPU engine fails as the CUDA engine does after
# TSR_TEST_DEVICE_FAULT_AFTER steps (the same table entry, `fatal`).
source "$(dirname "$0")/lib.sh"
write_yaml "$T/d.yaml" 1 1 1
start_coord "$T/d.yaml"
TSR_TEST_DEVICE_FAULT_AFTER=6 start_worker w0
wait_until 10 all_ready || fail "not ready"
start_worker w1
spare_idle() { [ "$(worker_field w1 state)" = idle ]; }
wait_until 10 spare_idle || fail "the spare did not register"
[ "$(piece_holder 0 0 0)" = w0 ] || fail "the piece is on $(piece_holder 0 0 0)"
out=$(tsr generate tiny --prompt-ids 1,2,3 --max-tokens 20 --ids 2> "$T/gen.err") ||
    fail "the request failed: $(cat "$T/gen.err")"
wait "${WPID[w0]}"; rc=$?
[ "$rc" = 75 ] || fail "the worker exited with $rc, not 75"
[ "$(piece_holder 0 0 0)" = w1 ] || fail "the piece did not move: $(piece_holder 0 0 0)"
# Declared dead by its fatal failure report, not by its heartbeats stopping.
case "$(worker_field w0 reason)" in
    *"fatal device error"*) ;;
    *) fail "w0's reason: $(worker_field w0 reason)" ;;
esac
# The same request again, undisturbed, on w1: the same tokens.
ref=$(tsr generate tiny --prompt-ids 1,2,3 --max-tokens 20 --ids) || fail "reference run failed"
[ "$out" = "$ref" ] || fail "resumed tokens differ: $out vs $ref"
[ "$(echo "$out" | wc -w)" = 20 ] || fail "expected 20 tokens: $out"
ok "fatal device error: worker exited 75, the spare took the piece, the request resumed with the same tokens"
