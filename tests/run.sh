#!/bin/bash
# Runs the unit tests (CMocka binaries) and the integration tests (scripts
# that start real processes on loopback), then prints one closing line
# "N passed, N failed".  Exits non-zero when anything failed.
#   tests/run.sh [unit|integration] [NAME-FILTER]
#   tests/run.sh only NAME...      just these (unit binaries or integration scripts)
# TSR_INTEGRATION_ONLY="NAME..." limits the integration tests of a whole run to
# those (make cpu-only: the CUDA=0 build differs from the CUDA one only in the
# worker's backend table and --help, so it runs every unit test and the
# integration tests that meet that difference).
set -u
cd "$(dirname "$0")/.."
# The test build (make test makes it); the release build for the test that compares.
export TSR_BIN="${TSR_BIN:-build/test/bin}" TSR_BUILD="${TSR_BUILD:-build/test}"
export TSR_RELEASE_BIN="${TSR_RELEASE_BIN:-bin}"
what="${1:-all}" filter="${2:-}"
passed=0 failed=0 failures=()

# run_cmocka NAME CMD...: runs a CMocka binary, adds its counts.
run_cmocka() {
    local name=$1 out rc p f
    shift
    # bounded: a test that hangs (a read that blocks for ever) fails instead of
    # holding the run
    out=$(timeout 600 "$@" 2>&1); rc=$?
    [ $rc = 124 ] && out="$out
$name: stopped after 600 s"
    echo "$out"
    p=$(echo "$out" | sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' | tail -1)
    f=$(echo "$out" | sed -n 's/^\[  FAILED  \] \([0-9]*\) test.*/\1/p' | tail -1)
    passed=$((passed + ${p:-0})); failed=$((failed + ${f:-0}))
    if [ $rc -ne 0 ]; then
        [ -z "$f" ] && failed=$((failed + 1))
        failures+=("$name")
    fi
}

if [ "$what" = all ] || [ "$what" = unit ]; then
    for t in "$TSR_BUILD"/tests/test_*; do
        [ -x "$t" ] || continue
        case "$t" in *"$filter"*) ;; *) continue ;; esac
        run_cmocka "$(basename "$t")" "$t"
    done
    # A machine runs the best build of the CPU kernels it has (AMX,
    # AVX-512 with AVX512-BF16 where it has that, AVX2+FMA, portable): the
    # products' and the engine's tests once more on each lesser build, so
    # the ones a CPU without AMX, without AVX-512, or without AVX2 and FMA
    # would pick are checked here too.
    kernels=plain
    grep -qw avx512f /proc/cpuinfo 2> /dev/null && kernels="avx2 plain"
    grep -qw amx_tile /proc/cpuinfo 2> /dev/null && kernels="avx512 avx2 plain"
    for k in $kernels; do
        for t in test_cpu_pool test_matmul_bf16 test_matmul_i8 test_engine_cpu test_batching; do
            case "$t ($k kernels)" in *"$filter"*) ;; *) continue ;; esac
            [ -x "$TSR_BUILD/tests/$t" ] || continue
            echo "== $t with TSR_CPU_KERNELS=$k"
            run_cmocka "$t ($k kernels)" env TSR_CPU_KERNELS=$k "$TSR_BUILD/tests/$t"
        done
    done
    # The NumPy reference the engines are checked against checks itself.
    case selftest in *"$filter"*)
        py=python3
        python3 -c 'import numpy' 2> /dev/null || py=/usr/bin/python3
        out=$("$py" tests/reference/selftest.py 2>&1); rc=$?
        echo "$out"
        p=$(echo "$out" | sed -n 's/^\([0-9]*\) passed, [0-9]* failed$/\1/p' | tail -1)
        f=$(echo "$out" | sed -n 's/^[0-9]* passed, \([0-9]*\) failed$/\1/p' | tail -1)
        passed=$((passed + ${p:-0})); failed=$((failed + ${f:-0}))
        if [ $rc -ne 0 ]; then
            [ -z "$f" ] || [ "$f" -eq 0 ] && failed=$((failed + 1))
            failures+=(reference-selftest)
        fi ;;
    esac
fi

# run_script NAME: runs tests/integration/NAME.sh (bounded), adds its count.
run_script() {
    local name=$1 start rc secs
    start=$(date +%s.%N)
    timeout 300 bash "tests/integration/$name.sh" > "/tmp/tsr-$name.log" 2>&1; rc=$?
    secs=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN{print b - a}')
    if [ $rc -eq 0 ]; then
        passed=$((passed + 1)); printf '[ PASS ] %s (%.1fs)\n' "$name" "$secs"
    else
        failed=$((failed + 1)); failures+=("$name")
        printf '[ FAIL ] %s (rc %d)\n' "$name" "$rc"
        sed 's/^/    | /' "/tmp/tsr-$name.log" | tail -60
    fi
}

if [ "$what" = all ] || [ "$what" = integration ]; then
    for t in tests/integration/test_*.sh; do
        case "$t" in *"$filter"*) ;; *) continue ;; esac
        if [ -n "${TSR_INTEGRATION_ONLY:-}" ]; then
            case " $TSR_INTEGRATION_ONLY " in *" $(basename "$t" .sh) "*) ;; *) continue ;; esac
        fi
        run_script "$(basename "$t" .sh)"
    done
fi

if [ "$what" = only ]; then
    shift
    for name in "$@"; do
        if [ -x "$TSR_BUILD/tests/$name" ]; then run_cmocka "$name" "$TSR_BUILD/tests/$name"
        elif [ -f "tests/integration/$name.sh" ]; then run_script "$name"
        else failed=$((failed + 1)); failures+=("$name"); echo "[ FAIL ] $name: no such test built"
        fi
    done
fi

[ ${#failures[@]} -gt 0 ] && echo "failed: ${failures[*]}"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
