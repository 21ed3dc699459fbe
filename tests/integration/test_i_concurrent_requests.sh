# 8 concurrent generate requests on 2 replicas (tp=1 pp=2 each) all complete
# with the reference's tokens, and both replicas serve.
source "$(dirname "$0")/lib.sh"
write_yaml "$T/d.yaml" 1 2 2
start_coord "$T/d.yaml"
for i in 0 1 2 3; do start_worker "w$i"; done
wait_until 15 all_ready || fail "not ready: $(tsr status 2>&1)"
pids=()
for k in 0 1 2 3 4 5 6 7; do
    tsr generate tiny --prompt-ids "$((k + 1)),$((k * 7 + 2)),9" --max-tokens 24 --ids > "$T/out.$k" 2> "$T/err.$k" &
    pids+=($!)
done
for k in 0 1 2 3 4 5 6 7; do wait "${pids[$k]}" || fail "request $k failed: $(cat "$T/err.$k")"; done
for k in 0 1 2 3 4 5 6 7; do
    ref=$(python3 "$ROOT/tests/reference/llama_ref.py" "$MODEL" --prompt-ids "$((k + 1)),$((k * 7 + 2)),9" --max-tokens 24)
    [ "$(tr ' ' ',' < "$T/out.$k")" = "$ref" ] || fail "request $k: $(cat "$T/out.$k") != $ref"
done
for r in 0 1; do
    n=$(status_json | jget "d['deployments'][0]['replica_list'][$r]['requests_completed']")
    [ "$n" -ge 1 ] || fail "replica $r completed no request ($n)"
done
[ "$(status_json | jget "d['coordinator']['stats']['requests']")" = 8 ] || fail "request count"
ok "8 concurrent requests on 2 replicas returned the reference's tokens"
