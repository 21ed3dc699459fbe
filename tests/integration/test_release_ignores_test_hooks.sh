# The test settings are compiled into the test builds only: a release build (make,
# what make install installs) ignores every TSR_TEST_* variable.  The same settings
# are shown to work in the test build first, so the test would fail if the release
# build honoured them.  TSR_RELEASE_BIN: the release build's binaries (make test
# sets it; bin/ by default).
source "$(dirname "$0")/lib.sh"
REL="${TSR_RELEASE_BIN:-bin}"
case "$REL" in /*) ;; *) REL="$ROOT/$REL" ;; esac
for b in tessera-coordinator tessera-worker; do
    [ -x "$REL/$b" ] || fail "no release build at $REL/$b (make builds it)"
done
[ "$REL" != "$BIN" ] || fail "TSR_RELEASE_BIN is the test build's own folder"
"$BIN/tessera-worker" --help | grep -q "This is a test build" || fail "the tests run a build without the test settings"
# The TCP group with the fixed, published secret is in test builds only.
nm "$BIN/tessera-worker" | grep -qw tsr_tcp_comm_new || fail "the test build's worker has no tsr_tcp_comm_new: the check below would prove nothing"
! nm "$REL/tessera-worker" | grep -qw tsr_tcp_comm_new || fail "the release worker has the fixed-secret tsr_tcp_comm_new"
# No release binary so much as names a test setting (each is read under TSR_TESTING).
for b in tessera-coordinator tessera-worker tessera; do
    grep -c "TSR_TEST_\|TSR_CUDA_DUMMY_WEIGHTS" "$BIN/$b" > /dev/null || [ "$b" = tessera ] ||
        fail "the test build's $b names no test setting: the check below would prove nothing"
    ! grep -a -o "TSR_TEST_[A-Z_]*\|TSR_CUDA_DUMMY_WEIGHTS" "$REL/$b" | sort -u | grep . ||
        fail "the release $b reads the test settings above"
done
! "$REL/tessera-worker" --help | grep -q "TSR_TEST_\|protocol-version" || fail "the release worker's help offers test settings"
"$BIN/tessera-worker" --help | grep -q -- "--protocol-version" || fail "the test build offers no --protocol-version"
! "$REL/tessera-worker" --protocol-version 99 --help > /dev/null 2>&1 || fail "the release worker takes --protocol-version"

write_yaml "$T/d.yaml" 1 1 1
start_coord "$T/d.yaml"

# A stand-in GPU (TSR_TEST_FAKE_CUDA_MIB): the test build's worker registers one of
# 16 GiB; the release worker looks for a real one (NVML) and reports no stand-in.
TSR_TEST_FAKE_CUDA_MIB=16384 start_worker tgpu --device cuda
registered() { [ "$(worker_field tgpu memory 2>/dev/null)" = $((16384 << 20)) ]; }
wait_until 10 registered || fail "the test build ignored TSR_TEST_FAKE_CUDA_MIB"
TSR_TEST_FAKE_CUDA_MIB=16384 WORKER_BIN="$REL/tessera-worker" start_worker rgpu --device cuda
# It either exits (no GPU here) or registers its real GPU; never the stand-in.
settled() {
    ! kill -0 "${WPID[rgpu]}" 2> /dev/null ||
        [ -n "$(worker_field rgpu memory 2> /dev/null)" ]
}
wait_until 20 settled || fail "the release worker neither exited nor registered"
[ "$(worker_field rgpu memory 2> /dev/null)" != $((16384 << 20)) ] ||
    fail "the release worker took TSR_TEST_FAKE_CUDA_MIB"
grep -q "test stand-in" "$T/rgpu.log" && fail "the release worker made a stand-in GPU"
echo "release worker: $(tail -1 "$T/rgpu.log")"

# TSR_TEST_RELOAD_HOLD_MS holds a reload 10 s in the test build's coordinator; the
# release coordinator answers at once.
reload_ms() {
    local t0; t0=$(now_ms)
    tsr --timeout 20000 reload > /dev/null 2>&1 || fail "reload failed: $(tail -3 "$T/coordinator.log")"
    echo $(( $(now_ms) - t0 ))
}
stop_coord() { kill -TERM "$COORD_PID"; wait "$COORD_PID" 2> /dev/null; }
up() { status_json > /dev/null; }
stop_coord
TSR_TEST_RELOAD_HOLD_MS=10000 start_coord "$T/d.yaml"
wait_until 10 up || fail "test coordinator did not start"
held=$(reload_ms)
[ "$held" -ge 9000 ] || fail "the test build's reload was not held ($held ms)"
stop_coord
TSR_TEST_RELOAD_HOLD_MS=10000 "$REL/tessera-coordinator" "$T/d.yaml" >> "$T/coordinator.log" 2>&1 &
COORD_PID=$!; PIDS+=("$COORD_PID")
wait_until 10 up || fail "release coordinator did not start"
quick=$(reload_ms)
[ "$quick" -lt 5000 ] || fail "the release coordinator held its reload $quick ms"
ok "release build ignores TSR_TEST_* (stand-in GPU, reload hold); the test build honours them (reload $held ms vs $quick ms)"
