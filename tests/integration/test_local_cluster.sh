# `tessera local`: starts a coordinator and N workers, reports a child that
# dies and keeps running, and stops them all on SIGTERM.
source "$(dirname "$0")/lib.sh"
write_yaml "$T/d.yaml" 1 2 1
"$BIN/tessera" local "$T/d.yaml" --workers 3 --log-dir "$T" > "$T/local.out" 2>&1 &
LPID=$!; PIDS+=("$LPID")
wait_until 10 all_ready || fail "local cluster not ready: $(cat "$T/local.out")"
three_workers() { [ "$(status_json | jget "len(d['workers'])")" = 3 ]; }
wait_until 10 three_workers || fail "expected 3 workers"
victim_pid=$(status_json | jget "[w['pid'] for w in d['workers'] if w['name']=='local-1'][0]")
kill -9 "$victim_pid"
reported() { grep -q "worker local-1 (pid $victim_pid) was killed by signal 9" "$T/local.out"; }
wait_until 3 reported || fail "death not reported: $(cat "$T/local.out")"
kill -0 "$LPID" || fail "tessera local exited after a child died"
wait_until 5 all_ready || fail "not ready again after losing a worker (2 pieces, 2 workers left)"
children=$(pgrep -P "$LPID" | wc -l)
[ "$children" = 3 ] || fail "expected 3 live children, found $children"
kids=$(pgrep -P "$LPID" | tr '\n' ' ')
kill -TERM "$LPID"
gone() { ! kill -0 "$LPID" 2>/dev/null; }
wait_until 7 gone || fail "tessera local did not exit on SIGTERM"
for k in $kids; do kill -0 "$k" 2>/dev/null && fail "child $k still running"; done
grep -q "stopping" "$T/local.out" || fail "no stop message"
ok "local: death reported, kept serving, SIGTERM stopped all children"

# Killed outright (kill -9, a closed terminal), it takes its children with it.
"$BIN/tessera" local "$T/d.yaml" --workers 2 --log-dir "$T/logs2" > "$T/local2.out" 2>&1 &
LPID=$!; PIDS+=("$LPID")
wait_until 10 all_ready || fail "second local cluster not ready: $(cat "$T/local2.out")"
kids=$(pgrep -P "$LPID" | tr '\n' ' ')
[ "$(echo $kids | wc -w)" = 3 ] || fail "expected 3 children, found: $kids"
kill -9 "$LPID"
# (a child that exited but is not reaped yet, a zombie, is gone too)
none_left() {
    local k
    for k in $kids; do
        [ -r "/proc/$k/stat" ] && [ "$(awk '{print $3}' "/proc/$k/stat" 2> /dev/null)" != Z ] && return 1
    done
    return 0
}
wait_until 7 none_left || fail "children left running after tessera local was killed: $kids"
ok "local: killed with SIGKILL, its coordinator and workers stopped too"

# Its output pipe closed (the reader went): nobody dies of SIGPIPE, and the cluster serves.
write_yaml "$T/p.yaml" 1 1 1
{ "$BIN/tessera" local "$T/p.yaml" --workers 2 2>&1 & echo $! > "$T/lp.pid"; wait; } | head -c 1 > /dev/null &
wait_until 10 all_ready || fail "a local cluster whose output pipe closed is not ready: $(tsr status 2>&1)"
two_alive() { [ "$(status_json | jget "len([w for w in d['workers'] if w['state'] != 'dead'])")" = 2 ]; }
wait_until 5 two_alive || fail "a worker died when its output pipe closed: $(tsr workers 2>&1)"
tsr generate tiny --prompt-ids 1,2,3 --max-tokens 4 --ids > /dev/null || fail "no service with the pipe closed"
kill -TERM "$(cat "$T/lp.pid")"
ok "local: its output pipe closed, every process lives and serves"

# The caller's own key name (TESSERA_IDENTITY, as a CLI user sets it) and
# data address are not its workers': each worker gets its own identity.
write_yaml "$T/i.yaml" 1 1 1
TESSERA_IDENTITY=cli TESSERA_DATA_ADDRESS=192.0.2.1 "$BIN/tessera" local "$T/i.yaml" --workers 2 \
    --log-dir "$T/logs-id" > "$T/local-id.out" 2>&1 &
LPID=$!; PIDS+=("$LPID")
wait_until 10 all_ready || fail "with TESSERA_IDENTITY=cli set, the local cluster is not ready:
$(tsr workers 2>&1; tail -3 "$T"/logs-id/local-*.log)"
kill -TERM "$LPID"
gone() { ! kill -0 "$LPID" 2>/dev/null; }
wait_until 7 gone || fail "tessera local did not exit on SIGTERM"
ok "local: the caller's TESSERA_IDENTITY and TESSERA_DATA_ADDRESS do not reach its workers"

# --log-dir that is not a directory is refused, naming it.
touch "$T/not-a-dir"
"$BIN/tessera" local "$T/d.yaml" --log-dir "$T/not-a-dir" > "$T/local3.out" 2>&1
[ $? = 1 ] && grep -q "not-a-dir: not a directory" "$T/local3.out" ||
    fail "--log-dir on a file: $(cat "$T/local3.out")"
ok "local: a --log-dir that is a file is refused"
