# `tessera local` whose coordinator dies (here: its ports are taken by another
# cluster) stops its workers and exits 1, instead of leaving them headless.
source "$(dirname "$0")/lib.sh"
write_yaml "$T/d.yaml" 1 1 1
"$BIN/tessera" local "$T/d.yaml" --workers 1 --log-dir "$T/a" > "$T/a.out" 2>&1 &
A=$!; PIDS+=("$A")
wait_until 10 all_ready || fail "first cluster not ready"
"$BIN/tessera" local "$T/d.yaml" --workers 2 --log-dir "$T/b" > "$T/b.out" 2>&1 &
B=$!; PIDS+=("$B")
bkids=""
for i in $(seq 1 20); do bkids=$(pgrep -P "$B" | tr '\n' ' '); [ -n "$bkids" ] && break; sleep 0.05; done
[ -n "$bkids" ] || fail "the second local started no children to check"
gone() { ! kill -0 "$B" 2>/dev/null; }
wait_until 10 gone || fail "second local kept running without its coordinator"
wait "$B"; rc=$?
[ "$rc" = 1 ] || fail "second local exited $rc, expected 1"
grep -q "the coordinator (pid [0-9]*) exited with status 1; stopping the workers" "$T/b.out" || fail "$(cat "$T/b.out")"
grep -q "cannot bind" "$T/b/coordinator.log" || fail "coordinator log: $(cat "$T/b/coordinator.log")"
for k in $bkids; do kill -0 "$k" 2>/dev/null && fail "child $k of the second local still runs"; done
all_ready || fail "the first cluster was disturbed"
ok "a local cluster whose coordinator dies stops its workers and exits 1"
