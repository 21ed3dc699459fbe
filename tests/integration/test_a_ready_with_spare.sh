# (a) A coordinator and 5 workers: a tp=2 pp=2 deployment becomes ready with
# every piece on its own worker and one worker left idle.
source "$(dirname "$0")/lib.sh"
write_yaml "$T/d.yaml" 2 2 1
start_coord "$T/d.yaml"
for i in 0 1 2 3 4; do start_worker "w$i"; done
wait_until 10 all_ready || fail "deployment not ready within 10 s: $(tsr status 2>&1)"
doc=$(status_json)
holders=$(echo "$doc" | jget "sorted(r['worker'] for rep in d['deployments'][0]['replica_list'] for s in rep['stages'] for r in s['ranks'])")
echo "holders: $holders"
[ "$(echo "$doc" | jget "len(set(r['worker'] for rep in d['deployments'][0]['replica_list'] for s in rep['stages'] for r in s['ranks'] if r['worker']))")" = 4 ] \
    || fail "expected 4 distinct holders, got $holders"
[ "$(echo "$doc" | jget "len(d['idle'])")" = 1 ] || fail "expected one idle worker: $(echo "$doc" | jget "d['idle']")"
[ "$(echo "$doc" | jget "[s['layers'] for s in d['deployments'][0]['replica_list'][0]['stages']]")" = "[[0, 4], [4, 8]]" ] \
    || fail "layer split is not [0,4) [4,8)"
[ "$(echo "$doc" | jget "d['deployments'][0]['state']")" = ready ] || fail "state not ready"
# The table shows the same facts.
tsr status > "$T/table.txt" || fail "status table failed"
grep -q "deployment tiny  ready" "$T/table.txt" || fail "table lacks the ready deployment: $(cat "$T/table.txt")"
grep -q "idle workers" "$T/table.txt" || fail "table lacks idle workers"
ok "tp=2 pp=2 ready on 4 workers, 1 idle"
