# Stress: 64 concurrent clients on 2 replicas (tp=1 pp=2 each), two rounds.
# Every request completes with the NumPy reference's tokens, no worker's
# resident memory grows from round to round, and every KV pool is empty
# afterwards.
source "$(dirname "$0")/lib.sh"
write_yaml "$T/d.yaml" 1 2 2
sed -i 's/    max_seq_len: 256/    max_seq_len: 256\n    max_batch: 16\n    max_queue: 64/' "$T/d.yaml"
start_coord "$T/d.yaml"
for i in 0 1 2 3; do start_worker "w$i"; done
wait_until 15 all_ready || fail "not ready: $(tsr status 2>&1)"

# Eight prompts, each asked by eight clients; the reference for each once.
prompt() { local k=$1; echo "$((k + 1)),$((k * 7 + 2)),9,$((k * 13 % 200 + 3)),$((k * 29 % 250 + 1))"; }
for k in 0 1 2 3 4 5 6 7; do
    python3 "$ROOT/tests/reference/llama_ref.py" "$MODEL" --prompt-ids "$(prompt $k)" --max-tokens 16 \
        > "$T/ref.$k" || fail "reference $k failed"
done

rss_kb() { awk '/^VmRSS/ {print $2}' "/proc/$1/status"; }
round() {
    local r=$1 pids=()
    for c in $(seq 0 63); do
        tsr generate tiny --prompt-ids "$(prompt $((c % 8)))" --max-tokens 16 --ids \
            > "$T/out.$r.$c" 2> "$T/err.$r.$c" &
        pids+=($!)
    done
    for c in $(seq 0 63); do
        wait "${pids[$c]}" || fail "round $r client $c failed: $(cat "$T/err.$r.$c")"
    done
    for c in $(seq 0 63); do
        [ "$(tr ' ' ',' < "$T/out.$r.$c")" = "$(cat "$T/ref.$((c % 8))")" ] ||
            fail "round $r client $c: $(cat "$T/out.$r.$c") != $(cat "$T/ref.$((c % 8))")"
    done
}
round 1
declare -A rss1
for i in 0 1 2 3; do rss1[$i]=$(rss_kb "${WPID[w$i]}"); done
round 2
for i in 0 1 2 3; do
    rss2=$(rss_kb "${WPID[w$i]}")
    echo "w$i: RSS ${rss1[$i]} kB after round 1, $rss2 kB after round 2"
    [ "$rss2" -le $(( rss1[$i] + rss1[$i] / 20 + 1024 )) ] || fail "w$i grew from ${rss1[$i]} to $rss2 kB"
done
[ "$(status_json | jget "d['coordinator']['stats']['requests']")" = 128 ] || fail "request count"
# Every pool is empty again.
empty() { [ "$(status_json | jget "sum(w.get('kv_blocks_used', 0) for w in d['workers'])")" = 0 ]; }
wait_until 5 empty || fail "KV blocks still held: $(status_json | jget "[(w['name'], w.get('kv_blocks_used')) for w in d['workers']]")"
ok "128 requests from 64 concurrent clients on 2 replicas returned the reference's tokens; RSS flat"
