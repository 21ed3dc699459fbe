# A registered worker that holds no piece stays small: the CUDA engine's
# libraries are opened when a cuda piece loads, not at start.  (Linking
# cuBLAS once made every worker of a CUDA build start with ~150 MB
# resident, GPU or not, which broke the serving benchmark's memory target:
# resident memory within 1.15x of weights plus KV budget.)
source "$(dirname "$0")/lib.sh"
write_yaml "$T/d.yaml" 1 1 1 tiny "$MODEL"
start_coord "$T/d.yaml"
start_worker w0 --memory-mib 1
registered() { [ "$(worker_field w0 state 2>/dev/null)" != "" ]; }
wait_until 10 registered || fail "w0 did not register"
rss_kb=$(awk '/^VmRSS:/ {print $2}' "/proc/${WPID[w0]}/status")
[ -n "$rss_kb" ] || fail "no VmRSS for w0 (pid ${WPID[w0]})"
echo "w0 ($(worker_field w0 state)) resident: $((rss_kb / 1024)) MiB"
[ "$rss_kb" -lt $((100 * 1024)) ] || fail "an idle worker is $((rss_kb / 1024)) MiB resident (limit 100 MiB)"
ok "an idle worker is $((rss_kb / 1024)) MiB resident"
