# (a2) parallel: auto with real daemons: on cpu workers the model fits one, so
# every worker serves a whole replica (tp 1 x pp 1); a fourth worker that joins
# becomes a fourth replica; the tokens are the reference's.  A worker given its rates
# registers them; one given none measured them at start.
source "$(dirname "$0")/lib.sh"
write_yaml "$T/d.yaml" auto auto auto
start_coord "$T/d.yaml"
for i in 0 1 2; do start_worker "w$i"; done
replicas() { status_json | jget "d['deployments'][0]['replicas']"; }
three_ready() { [ "$(replicas)" = 3 ] && all_ready; }
wait_until 15 three_ready || fail "not 3 ready replicas within 15 s: $(tsr status 2>&1)"
doc=$(status_json)
[ "$(echo "$doc" | jget "d['deployments'][0]['layout_chosen']")" = true ] || fail "layout not chosen"
[ "$(echo "$doc" | jget "[d['deployments'][0]['tensor'], d['deployments'][0]['pipeline']]")" = "[1, 1]" ] ||
    fail "not tp 1 x pp 1: $(echo "$doc" | jget "d['deployments'][0]['layout_reason']")"
echo "$doc" | jget "d['deployments'][0]['layout_reason']" | grep -q "fewest devices a replica fits on (1)" ||
    fail "no reason: $(echo "$doc" | jget "d['deployments'][0]['layout_reason']")"
tsr status | grep -q "layout auto: chosen over" || fail "tessera status shows no choice: $(tsr status)"
grep -q "parallel auto: chosen over" "$T/coordinator.log" || fail "the choice is not logged"
expect_reference_tokens
TESSERA_MEM_GBS=50 start_worker w3 --gflops 300
four_ready() { [ "$(replicas)" = 4 ] && all_ready; }
wait_until 15 four_ready || fail "the fourth worker is not a fourth replica: $(tsr status 2>&1)"
[ "$(status_json | jget "len(d['idle'])")" = 0 ] || fail "a worker left idle: $(tsr status)"
[ "$(status_json | jget "[(w['mem_gbs'], w['gflops']) for w in d['workers'] if w['name'] == 'w3'][0]")" = "[50, 300]" ] ||
    fail "w3's rates: $(status_json | jget "[w for w in d['workers'] if w['name'] == 'w3']")"
# a cpu worker given no rate measured both at start
[ "$(status_json | jget "[(w['mem_gbs'] > 0.1, w['gflops'] > 0.1) for w in d['workers'] if w['name'] == 'w0'][0]")" = "[true, true]" ] ||
    fail "w0's measured rate: $(status_json | jget "[w for w in d['workers'] if w['name'] == 'w0']")"
expect_reference_tokens
ok "parallel: auto on cpu: tp 1 x pp 1, a replica per worker (3, then 4), reference tokens"
