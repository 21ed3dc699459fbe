# (s1) Hostile inputs the coordinator must bound (issue 7): a deeply nested
# deployment file is refused at once naming the cap; a control request over
# the old 64 KiB limit (a 65,536-id prompt) gets an answer, not silence; a
# second process under a live worker's name is refused and the first keeps
# serving.
source "$(dirname "$0")/lib.sh"

# Attack 13: 100,000 levels of nesting took 24 s to refuse.
python3 -c 'print("version: 1\ndeployments: " + "[" * 100000 + "]" * 100000)' > "$T/deep.yaml"
t0=$(now_ms)
"$BIN/tessera-coordinator" --check "$T/deep.yaml" > "$T/deep.out" 2>&1 && fail "deep file accepted"
took=$(( $(now_ms) - t0 ))
grep -q "deep.yaml:2:.*nested more than 32 levels deep" "$T/deep.out" || fail "no cap named: $(cat "$T/deep.out")"
[ "$took" -lt 2000 ] || fail "deep file took $took ms to refuse"
ok "deep YAML refused in $took ms: $(head -c 120 "$T/deep.out")"

write_yaml "$T/d.yaml" 1 1 1
start_coord "$T/d.yaml"
start_worker a
start_worker b
wait_until 10 all_ready || fail "cluster not ready"

# Attack 11: the CLI allows 65,536 ids; such a request got no answer.
python3 -c 'print(",".join(["1"] * 65536))' > "$T/ids"
tsr --timeout 5000 generate tiny --max-tokens 1 --ids < "$T/ids" > "$T/big.out" 2>&1; rc=$?
[ "$rc" = 3 ] || fail "65,536-id prompt: exit $rc, expected 3: $(cat "$T/big.out")"
grep -q "max_seq_len" "$T/big.out" || fail "no reason: $(cat "$T/big.out")"
ok "65,536-id prompt refused with the reason: $(head -c 120 "$T/big.out")"
long=$(printf 'd%.0s' $(seq 200))
tsr generate "$long" --prompt-ids 1 --max-tokens 1 > "$T/long.out" 2>&1; rc=$?
[ "$rc" = 1 ] && grep -q "limit 128" "$T/long.out" || fail "long name: exit $rc: $(cat "$T/long.out")"
ok "over-long deployment name stopped by the CLI: $(cat "$T/long.out")"

# Attack 6 with real processes: a second worker named "a" is refused (exit
# 2) and the first keeps its piece and keeps serving.
holder=$(piece_holder 0 0 0)
pid_before=$(status_json | jget "[w['pid'] for w in d['workers'] if w['name']=='$holder'][0]")
"$BIN/tessera-worker" --coordinator "$WEP" --name "$holder" > "$T/dup.log" 2>&1 &
dup=$!
PIDS+=("$dup")
wait "$dup"; rc=$?
[ "$rc" = 2 ] || fail "duplicate worker exited $rc, expected 2"
pid_after=$(status_json | jget "[w['pid'] for w in d['workers'] if w['name']=='$holder'][0]")
[ "$pid_before" = "$pid_after" ] || fail "the name moved to pid $pid_after"
out=$(tsr generate tiny --prompt-ids 1,2,3 --max-tokens 4 --ids 2>&1) || fail "generate after the duplicate: $out"
ok "duplicate of $holder refused ($(grep -o 'refused registration.*' "$T/dup.log" | head -c 100)); still serving: $out"
