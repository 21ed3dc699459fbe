# NVLink topology from the workers to the plan, through real daemons on a machine without a
# GPU: four fake-NCCL workers on stand-in GPUs whose NVLink peers are given
# (TSR_TEST_FAKE_CUDA_NVLINK, as NVML would report them): GPUs 0 and 3 are linked, and 1
# and 2, so taking the workers in the order of their names, their bus ids or their
# registrations (0, 1, 2, 3) would put each TP group across the two domains.  The coordinator must find the two domains, show
# them (`tessera workers --json`), and place each replica of a cuda tp=2 deployment inside
# one; both replicas form their TP group over NCCL and give a cpu deployment's tokens.
source "$(dirname "$0")/lib.sh"
{ coordinator_yaml; echo "deployments:"
  nccl_test_deployment linked cuda 2 1 | sed 's/replicas: 1/replicas: 2/'
  nccl_test_deployment plain cpu 2 1; } > "$T/d.yaml"
start_coord "$T/d.yaml"
start_worker c0 --device cpu
start_worker c1 --device cpu
use_fake_nccl_worker
export TSR_TEST_FAKE_NCCL=tcp
bus() { printf '00000000:%02X:00.0' "$1"; }
registered() { [ "$(status_json | jget "len([w for w in d['workers'] if w['name'] == '$1'])")" = 1 ]; }
for i in 0 1 2 3; do
    TSR_TEST_FAKE_CUDA_NVLINK=$(bus $((3 - i))) start_worker "g$i" --device cuda --device-index "$i"
    wait_until 15 registered "g$i" || fail "g$i did not register"
done
wait_until 30 all_ready || fail "not ready: $(tsr status 2>&1)"
domain() { worker_field "$1" nvlink_domain; }
d0=$(domain g0) d1=$(domain g1) d2=$(domain g2) d3=$(domain g3)
[ -n "$d0" ] && [ "$d0" != None ] && [ "$d0" != null ] || fail "g0 has no NVLink domain: $(domain g0)"
[ "$d0" = "$d3" ] && [ "$d1" = "$d2" ] && [ "$d0" != "$d1" ] ||
    fail "domains: g0 $d0, g1 $d1, g2 $d2, g3 $d3 (want g0 = g3, g1 = g2, two domains)"
[ "$(worker_field c0 nvlink_domain)" = "" ] || fail "a cpu worker has an NVLink domain"
ok "the coordinator found two NVLink domains from the workers' reports: $d0 and $d1"
holder() { status_json | jget "d['deployments'][0]['replica_list'][$1]['stages'][0]['ranks'][$2]['worker']"; }
for r in 0 1; do
    a=$(holder "$r" 0) b=$(holder "$r" 1)
    [ "$(domain "$a")" = "$(domain "$b")" ] ||
        fail "replica $r's TP group spans two NVLink domains: $a ($(domain "$a")), $b ($(domain "$b"))"
    grep -q "(rank 0 of 2, epoch [0-9]*): NCCL$" "$T/$a.log" || fail "$a did not form its TP group over NCCL"
done
ref=$(tsr generate plain --prompt-ids 1,2,3 --max-tokens 24 --ids) || fail "the cpu run failed"
for i in 1 2 3 4; do
    got=$(tsr generate linked --prompt-ids 1,2,3 --max-tokens 24 --ids) || fail "generate $i failed"
    [ "$got" = "$ref" ] || fail "linked: $got; cpu tp=2: $ref"
done
ok "each tp=2 replica is placed inside one NVLink domain ($(holder 0 0)+$(holder 0 1), $(holder 1 0)+$(holder 1 1)) and serves the cpu deployment's tokens"
