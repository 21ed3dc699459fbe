# (b) kill -9 an assigned worker: status shows it dead within
# worker_timeout_ms + one heartbeat, and the spare takes over its piece.
source "$(dirname "$0")/lib.sh"
write_yaml "$T/d.yaml" 2 2 1
start_coord "$T/d.yaml"
for i in 0 1 2 3 4; do start_worker "w$i"; done
wait_until 10 all_ready || fail "not ready"
victim=$(piece_holder 0 1 0)
spare=$(status_json | jget "d['idle'][0]")
echo "victim $victim, spare $spare"
kill -9 "${WPID[$victim]}"; t0=$(now_ms)
is_dead() { [ "$(worker_field "$victim" state)" = dead ]; }
wait_until 5 is_dead || fail "$victim not dead after 5 s"
# Time from the kill to the coordinator declaring it dead: subtract how long
# it has been dead at the moment we looked.
# When the coordinator declared it dead, on the wall clock, against the kill.
detect=$(( $(worker_field "$victim" dead_at_ms) - t0 ))
echo "declared dead $detect ms after kill -9 (limit 1100)"
[ "$detect" -le 1100 ] || fail "detection took $detect ms > worker_timeout_ms + 1 heartbeat"
[ "$detect" -ge 900 ] || fail "declared dead after only $detect ms: timeout not honoured"
takes_over() { [ "$(piece_holder 0 1 0)" = "$spare" ] && all_ready; }
wait_until 3 takes_over || fail "spare $spare did not take the piece: holder $(piece_holder 0 1 0)"
ok "dead in $detect ms; $spare took over and the deployment is ready"
