# (a5) a new cut built beside the running one, with real daemons whose every weight load
# takes 1.5 s more (TSR_TEST_LOAD_HOLD_MS, as a large model's would).  Six workers serve
# tp 1 x 2 replicas while clients stream; the file goes to tp 2 x 2 replicas, which the
# four idle workers can hold: they load it while the old replicas serve, and the switch
# is a rewire, so no token waits anywhere near a load (the longest gap stays under
# 1000 ms).  Then to tp 1 x 4, which the two idle workers cannot hold beside it: it
# applies at once, and status says why.  No request fails; tokens are the reference's.
source "$(dirname "$0")/lib.sh"
HOLD=1500
yaml() { { coordinator_yaml; cat <<YAML
deployments:
  - name: tiny
    model: $MODEL
    parallel: {tensor: $1, pipeline: 1, replicas: $2}
    max_seq_len: 256
YAML
} > "$T/d.yaml"; }
yaml 1 2
start_coord "$T/d.yaml"
for i in 0 1 2 3 4 5; do TSR_TEST_LOAD_HOLD_MS=$HOLD start_worker "w$i"; done
layout() { status_json | jget "[d['deployments'][0][k] for k in ('tensor', 'pipeline', 'replicas')]"; }
serving() { [ "$(layout)" = "$1" ] && all_ready; }
wait_until 20 serving "[1, 1, 2]" || fail "not ready: $(tsr status 2>&1)"

# client K: requests one after the other until $T/stop exists (bounded: 60 s); the
# longest gap between two tokens of one request goes to $T/gap.K, the last stream to
# $T/cK.out, failures to $T/failed
cat > "$T/client.py" <<'PY'
import os, subprocess, sys, time
cli, cep, k, tdir = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
worst, end = 0.0, time.time() + 60
while not os.path.exists(tdir + "/stop") and time.time() < end:
    p = subprocess.Popen([cli, "--coordinator", cep, "generate", "tiny", "--prompt-ids",
                          "1,2," + k, "--max-tokens", "200", "--ids", "--token-timeout", "30000"],
                         stdout=subprocess.PIPE, stderr=open(tdir + "/c" + k + ".err", "ab"))
    out, last = b"", None
    while True:
        b = os.read(p.stdout.fileno(), 1)
        if not b:
            break
        out += b
        if b in b" \n":
            now = time.time()
            if last is not None and now - last > worst:
                worst = now - last
            last = now
    if p.wait() != 0:
        open(tdir + "/failed", "a").write("client " + k + "\n")
    open(tdir + "/c" + k + ".out", "wb").write(out)
    open(tdir + "/gap." + k, "w").write("%d\n" % (worst * 1000))
    done = int(open(tdir + "/n." + k).read()) + 1 if os.path.exists(tdir + "/n." + k) else 1
    open(tdir + "/n." + k, "w").write("%d\n" % done)
PY
CLIENTS=()
for k in 3 4; do python3 "$T/client.py" "$BIN/tessera" "$CEP" "$k" "$T" & CLIENTS+=("$!"); PIDS+=("$!"); done
have_gaps() { [ -s "$T/gap.3" ] && [ -s "$T/gap.4" ]; }
wait_until 10 have_gaps || fail "the clients do not stream"

yaml 2 2
tsr reload > "$T/reload.txt" || fail "reload to tp 2 refused"
grep -q "tiny: tp 2 x pp 1 x 2 is built on 4 idle worker(s) while tp 1 x pp 1 x 2 serves" "$T/reload.txt" ||
    fail "the reload's answer: $(cat "$T/reload.txt")"
status_json | jget "d['deployments'][0]['reshard']['doing']" | grep -q "tp 2 x pp 1 x 2 loads on 4 idle worker(s) while tp 1 x pp 1 x 2 serves" ||
    fail "not built beside: $(status_json | jget "d['deployments'][0].get('reshard')")"
wait_until 20 serving "[2, 1, 2]" || fail "tp 2 not serving: $(tsr status 2>&1)"
status_json | jget "d['deployments'][0]['reshard']['last']" | grep -q "after its pieces loaded beside it" ||
    fail "reshard: $(status_json | jget "d['deployments'][0].get('reshard')")"
# two more requests of each client after the switch: the gaps include it
n3=$(cat "$T/n.3"); n4=$(cat "$T/n.4")
more() { [ "$(cat "$T/n.3")" -ge $((n3 + 2)) ] && [ "$(cat "$T/n.4")" -ge $((n4 + 2)) ]; }
wait_until 20 more || fail "the clients stopped streaming after the switch"
gap=$(cat "$T/gap.3" "$T/gap.4" | sort -n | tail -1)
echo "longest token gap while tp 1 -> tp 2 was built beside: $gap ms (each load takes $HOLD ms more)"
[ "$gap" -lt 1000 ] || fail "a token waited $gap ms: the switch waited for a load"

yaml 1 4
tsr reload > "$T/reload.txt" || fail "reload to 4 replicas refused"
grep -q "tiny: .* at once, rebuilt while it loads: building the new one beside it needs more idle workers (4, 2 idle)" "$T/reload.txt" ||
    fail "the reload's answer: $(cat "$T/reload.txt")"
status_json | jget "d['deployments'][0]['reshard']['last']" | grep -q "at once.*needs more idle workers (4, 2 idle)" ||
    fail "no reason given: $(status_json | jget "d['deployments'][0].get('reshard')")"
wait_until 20 serving "[1, 1, 4]" || fail "tp 1 x 4 not serving: $(tsr status 2>&1)"
clients_done_with_reference 200 3 4
ok "tp 1 -> 2 built beside the running replicas (longest token gap $gap ms, loads $HOLD ms), then tp 1 x 4 at once for want of idle workers; nothing failed"
