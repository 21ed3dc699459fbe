# Reload (CLI and SIGHUP) applies a new layout; a bad file is refused with
# its line and column and the running configuration is kept.  Drain moves a
# worker's piece to the spare and keeps the worker idle.
source "$(dirname "$0")/lib.sh"
write_yaml "$T/d.yaml" 2 2 1
start_coord "$T/d.yaml"
for i in 0 1 2 3 4; do start_worker "w$i"; done
wait_until 10 all_ready || fail "not ready"

# drain: the piece moves to the spare, the drained worker stays idle.
victim=$(piece_holder 0 1 1); spare=$(status_json | jget "d['idle'][0]")
out=$(tsr drain "$victim") || fail "drain failed: $out"
echo "$out" | grep -q "moved to $spare" || fail "drain output: $out"
wait_until 3 all_ready || fail "not ready after drain"
[ "$(piece_holder 0 1 1)" = "$spare" ] || fail "piece not on the spare"
[ "$(worker_field "$victim" drained)" = true ] || fail "not marked drained"
[ "$(worker_field "$victim" assignment)" = null ] || fail "drained worker still holds a piece"
tsr drain nosuch 2> "$T/err.txt"; [ $? = 3 ] || fail "drain of unknown worker should exit 3"
grep -q "no live worker named 'nosuch'" "$T/err.txt" || fail "unclear drain error: $(cat "$T/err.txt")"
tsr undrain "$victim" > /dev/null || fail "undrain failed"
[ "$(worker_field "$victim" drained)" = false ] || fail "undrain did not clear the flag"

# reload to tp=1 pp=2 x 2 replicas: still 4 pieces, new layout.
write_yaml "$T/d.yaml" 1 2 2
before=$(status_json | jget "d['coordinator']['epoch']")
tsr reload > "$T/reload.txt" || fail "reload failed: $(cat "$T/reload.txt")"
# the reply names the new plan's epoch, not the one it replaced
told=$(sed -n 's/^reloaded: .*, epoch \([0-9]*\)$/\1/p' "$T/reload.txt")
[ -n "$told" ] && [ "$told" -gt "$before" ] || fail "reload said epoch '$told', the plan before was $before"
relaid() { all_ready && [ "$(status_json | jget "len(d['deployments'][0]['replica_list'])")" = 2 ]; }
wait_until 5 relaid || fail "new layout not ready: $(tsr status)"

# a bad file is refused, with file:line:column, and nothing changes.
cp "$T/d.yaml" "$T/good.yaml"
sed -i 's/tensor: 1/tensor: one/' "$T/d.yaml"
tsr reload 2> "$T/err.txt"; rc=$?
[ "$rc" = 3 ] || fail "bad reload exited $rc"
grep -qE "d.yaml:[0-9]+:[0-9]+: deployments\[0\].parallel.tensor" "$T/err.txt" || fail "bad reload message: $(cat "$T/err.txt")"
grep -q "keeps its running configuration" "$T/err.txt" || fail "a refused reload does not say the running configuration is kept: $(cat "$T/err.txt")"
# The same file named with --config cannot even be read for the endpoint:
# the operator is told nothing was sent and nothing changed.
"$BIN/tessera" --config "$T/d.yaml" reload 2> "$T/err2.txt"; rc=$?
[ "$rc" = 1 ] || fail "reload with a bad --config file exited $rc"
grep -qE "d.yaml:[0-9]+:[0-9]+: deployments\[0\].parallel.tensor" "$T/err2.txt" || fail "bad --config message: $(cat "$T/err2.txt")"
grep -q "keeps its running configuration" "$T/err2.txt" || fail "a reload with a bad --config file does not say the running configuration is kept: $(cat "$T/err2.txt")"
all_ready || fail "a refused reload disturbed the running deployment"
[ "$(status_json | jget "d['deployments'][0]['replicas']")" = 2 ] || fail "old configuration lost"

# SIGHUP rereads the file too: back to one replica of tp=2 pp=2.
write_yaml "$T/d.yaml" 2 2 1
kill -HUP "$COORD_PID"
back() { all_ready && [ "$(status_json | jget "d['deployments'][0]['tensor']")" = 2 ]; }
wait_until 5 back || fail "SIGHUP reload not applied"
kill -0 "$COORD_PID" || fail "coordinator died on SIGHUP"

# SIGTERM stops the coordinator cleanly.
kill -TERM "$COORD_PID"; wait "$COORD_PID"; rc=$?
[ "$rc" = 0 ] || fail "coordinator exited $rc on SIGTERM"
grep -q "shutting down" "$T/coordinator.log" || fail "no clean shutdown message"
ok "drain, undrain, reload, refused reload, SIGHUP and SIGTERM behave"
