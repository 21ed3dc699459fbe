# (c) SIGSTOP a worker: declared dead like a crash, the spare takes over; after
# SIGCONT it comes back idle and does not take its old piece back.
source "$(dirname "$0")/lib.sh"
write_yaml "$T/d.yaml" 2 2 1
start_coord "$T/d.yaml"
for i in 0 1 2 3 4; do start_worker "w$i"; done
wait_until 10 all_ready || fail "not ready"
victim=$(piece_holder 0 0 1)
spare=$(status_json | jget "d['idle'][0]")
kill -STOP "${WPID[$victim]}"; t0=$(now_ms)
is_dead() { [ "$(worker_field "$victim" state)" = dead ]; }
wait_until 5 is_dead || fail "$victim not dead after 5 s"
# When the coordinator declared it dead, on the wall clock, against the kill.
detect=$(( $(worker_field "$victim" dead_at_ms) - t0 ))
echo "stopped worker declared dead after $detect ms (limit 1100)"
[ "$detect" -le 1100 ] || fail "detection took $detect ms"
takes_over() { [ "$(piece_holder 0 0 1)" = "$spare" ] && all_ready; }
wait_until 3 takes_over || fail "spare did not take over"
plans() { status_json | jget "d['coordinator']['stats']['plans']"; }
p0=$(plans)
kill -CONT "${WPID[$victim]}"
back_idle() { [ "$(worker_field "$victim" state)" = idle ]; }
wait_until 5 back_idle || fail "$victim did not come back idle: $(worker_field "$victim" state)"
# Its return is an event the planner sees; after that plan the piece stays.
replanned() { [ "$(plans)" -gt "$p0" ]; }
wait_until 5 replanned || fail "no plan after $victim came back"
[ "$(piece_holder 0 0 1)" = "$spare" ] || fail "piece moved back to $(piece_holder 0 0 1)"
[ "$(worker_field "$victim" assignment)" = null ] || fail "$victim still holds $(worker_field "$victim" assignment)"
all_ready || fail "deployment not ready after SIGCONT"
grep -q "dropping piece" "$T/$victim.log" || fail "worker log does not say it dropped its old piece"
ok "SIGSTOP detected in $detect ms; after SIGCONT $victim is idle and $spare keeps the piece"
