# (f2) `tessera plan FILE --diff` against a running cluster: what a reload of FILE
# would do, changing nothing.
source "$(dirname "$0")/lib.sh"
write_yaml "$T/d.yaml" 2 1 1
start_coord "$T/d.yaml"
for i in 0 1 2 3 4; do start_worker "w$i"; done
wait_until 10 all_ready || fail "not ready: $(tsr status 2>&1)"
epoch=$(status_json | jget "d['coordinator']['epoch']")
diff_of() { tsr plan "$1" --diff > "$T/diff.txt" 2>&1 || fail "plan --diff $1: $(cat "$T/diff.txt")"; cat "$T/diff.txt"; }
# the running file: nothing changes
diff_of "$T/d.yaml" | grep -q "nothing changes" || fail "same file: $(cat "$T/diff.txt")"
# a second replica: it is new, the first keeps serving
write_yaml "$T/r2.yaml" 2 1 2
diff_of "$T/r2.yaml" > /dev/null
grep -q "deployment tiny: 1 -> 2 replica(s)" "$T/diff.txt" || fail "replicas: $(cat "$T/diff.txt")"
grep -q "replica tiny/1 is new" "$T/diff.txt" || fail "new replica: $(cat "$T/diff.txt")"
[ "$(grep -c "^  load " "$T/diff.txt")" = 2 ] || fail "two loads expected: $(cat "$T/diff.txt")"
grep -q "no replica that serves now stops serving" "$T/diff.txt" || fail "serving: $(cat "$T/diff.txt")"
# another cut the three idle workers can hold: built beside, nothing stops serving
write_yaml "$T/p2.yaml" 1 2 1
diff_of "$T/p2.yaml" > /dev/null
grep -q "layout tp 2 x pp 1 -> tp 1 x pp 2" "$T/diff.txt" || fail "layout: $(cat "$T/diff.txt")"
grep -q "1 of its 1 replica(s) in the new cut are built beside the running one on 2 worker(s)" \
    "$T/diff.txt" || fail "beside: $(cat "$T/diff.txt")"
grep -q "replica tiny/0 of the new cut is built beside the old one, which serves until" "$T/diff.txt" ||
    fail "serving replica: $(cat "$T/diff.txt")"
grep -q "no replica that serves now stops serving" "$T/diff.txt" || fail "serving: $(cat "$T/diff.txt")"
# idle workers for one replica of the new cut but not two: one built beside, the other
# loads after the switch on the workers the old cut frees
write_yaml "$T/p22.yaml" 1 2 2
diff_of "$T/p22.yaml" > /dev/null
grep -q "1 of its 2 replica(s) in the new cut are built beside .*the others load after the switch" \
    "$T/diff.txt" || fail "one beside: $(cat "$T/diff.txt")"
grep -q "replica tiny/1 of the new cut loads after the switch, while the 1 built beside serve" \
    "$T/diff.txt" || fail "loads after: $(cat "$T/diff.txt")"
grep -q "no replica that serves now stops serving" "$T/diff.txt" || fail "serving: $(cat "$T/diff.txt")"
# a cut whose one replica the idle workers cannot hold, and no other replica to let go:
# the replica is rebuilt and stops serving meanwhile
write_yaml "$T/p4.yaml" 1 4 1
diff_of "$T/p4.yaml" > /dev/null
grep -q "replica tiny/0 is rebuilt in the new cut: it stops serving" "$T/diff.txt" || fail "rebuilt replica: $(cat "$T/diff.txt")"
grep -q "load    w0 .* (held tiny r0 s0 t0)" "$T/diff.txt" || fail "what w0 held: $(cat "$T/diff.txt")"
# max_queue: every replica rewired, keeping its weights; max_batch: its engines are
# built again, so the replica stops serving while they load
sed 's/max_seq_len: 256/max_seq_len: 256\n    max_queue: 8/' "$T/d.yaml" > "$T/q.yaml"
diff_of "$T/q.yaml" > /dev/null
grep -q "model or batching keys change: every replica is rewired" "$T/diff.txt" || fail "keys: $(cat "$T/diff.txt")"
grep -q "replica tiny/0 is rewired (a new epoch; it keeps its weights" "$T/diff.txt" || fail "rewire: $(cat "$T/diff.txt")"
! grep -q "^  load " "$T/diff.txt" || fail "a load for max_queue: $(cat "$T/diff.txt")"
sed 's/max_seq_len: 256/max_seq_len: 256\n    max_batch: 8/' "$T/d.yaml" > "$T/b.yaml"
diff_of "$T/b.yaml" > /dev/null
grep -q "replica tiny/0 stops serving while its pieces load again" "$T/diff.txt" || fail "max_batch: $(cat "$T/diff.txt")"
# nothing was applied by any of the diffs
[ "$(status_json | jget "[d['coordinator']['epoch'], d['deployments'][0]['replicas']]")" = "[$epoch, 1]" ] ||
    fail "a diff changed the cluster: $(tsr status)"
# A running auto deployment: a file that changes its fixed dimension (pipeline 1 -> 2
# under tensor: auto) is a new cut, not the running choice.
auto_yaml() { write_yaml "$1" auto "$2" 2; }
auto_yaml "$T/a1.yaml" 1
cp "$T/a1.yaml" "$T/d.yaml"
tsr reload > /dev/null || fail "reload to auto"
auto_ready() { [ "$(status_json | jget "[d['deployments'][0]['layout_chosen'], d['deployments'][0]['tensor'], d['deployments'][0]['replicas']]")" = "[true, 1, 2]" ] && all_ready; }
wait_until 15 auto_ready || fail "auto not ready: $(tsr status 2>&1)"
diff_of "$T/a1.yaml" | grep -q "nothing changes" || fail "running auto file: $(cat "$T/diff.txt")"
auto_yaml "$T/a2.yaml" 2
diff_of "$T/a2.yaml" > /dev/null
grep -q "layout tp 1 x pp 1 -> tp 1 x pp 2" "$T/diff.txt" || fail "auto fixed pipeline changed: $(cat "$T/diff.txt")"
tsr plan "$T/nope.yaml" --diff > "$T/bad.txt" 2>&1; [ $? = 1 ] || fail "a missing file did not exit 1"
grep -q "nope.yaml" "$T/bad.txt" || fail "the missing file is not named: $(cat "$T/bad.txt")"
# no idle workers for a replica of tp 4 (three idle), two old replicas: one is let go to
# make room (it stops taking requests; the other serves), and one new replica is built
write_yaml "$T/t4.yaml" 4 1 2
diff_of "$T/t4.yaml" > /dev/null
grep -q "1 old replica(s) are let go to make room: they take no new request" "$T/diff.txt" ||
    fail "let go: $(cat "$T/diff.txt")"
grep -q "1 of its 2 replica(s) in the new cut are built beside the running one on 4 worker(s)" \
    "$T/diff.txt" || fail "beside after letting go: $(cat "$T/diff.txt")"
grep -q "^  1 replica(s) that serve now stop taking requests meanwhile" "$T/diff.txt" ||
    fail "stopping: $(cat "$T/diff.txt")"
cat "$T/diff.txt"; ok "plan --diff: nothing for the running file; a new replica; a new cut rebuilds; max_queue rewires, max_batch reloads; nothing applied; a running auto deployment's fixed dimension changed is a new cut; old replicas let go to make room are named"
