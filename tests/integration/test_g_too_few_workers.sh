# With too few workers a deployment waits, holding no workers, and its status
# says how many more of which kind it needs; when they arrive it is placed.
# Losing a worker with no spare leaves it degraded, needing one more.
source "$(dirname "$0")/lib.sh"
write_yaml "$T/d.yaml" 2 2 1
start_coord "$T/d.yaml"
for i in 0 1 2; do start_worker "w$i"; done
waiting() { [ "$(status_json | jget "d['deployments'][0]['state'] + '|' + d['deployments'][0]['message']")" = "waiting|needs 1 more cpu worker (0 of 4 pieces placed)" ]; }
wait_until 5 waiting || fail "not waiting for 1 more: $(status_json | jget "d['deployments'][0]['message']")"
[ "$(status_json | jget "d['deployments'][0]['needs']")" = '{"workers": 1, "device": "cpu"}' ] || fail "needs field"
[ "$(status_json | jget "len(d['idle'])")" = 3 ] || fail "a waiting deployment should hold no workers"
tsr status | grep -q "needs 1 more cpu worker" || fail "table lacks the shortage"
start_worker w3
wait_until 5 all_ready || fail "not ready once the 4th worker came"
kill -9 "${WPID[w1]}"
degraded() { [ "$(status_json | jget "d['deployments'][0]['state'] + '|' + d['deployments'][0]['message']")" = "degraded|needs 1 more cpu worker (3 of 4 pieces placed)" ]; }
wait_until 5 degraded || fail "not degraded: $(status_json | jget "d['deployments'][0]['message']")"
start_worker w4
wait_until 5 all_ready || fail "not ready again once a replacement came"
ok "waiting / degraded with 'needs 1 more cpu worker', placed when workers arrive"
