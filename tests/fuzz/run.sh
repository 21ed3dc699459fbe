#!/bin/bash
# Runs each libFuzzer target named on the command line (all of them when none)
# for FUZZ_SECONDS from its seed corpus, tests/fuzz/corpus/<target>/.  New
# inputs go to $FUZZ_BUILD/corpus/<target>/ (the seeds stay as committed); a
# crash, leak, timeout or UBSan report leaves the input in
# $FUZZ_BUILD/findings/ and makes the run fail.  `make fuzz` calls this after
# building the targets.
set -u
cd "$(dirname "$0")/../.."
B=${FUZZ_BUILD:-build/fuzz}
S=${FUZZ_SECONDS:-60}
[ $# -gt 0 ] || set -- $(cd tests/fuzz && ls fuzz_*.c | sed 's/\.c$//')
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
# The targets silence the daemons' logs; TESSERA_LOG_LEVEL=debug when replaying
# an input shows them.
unset TESSERA_LOG_LEVEL
mkdir -p "$B/findings"
failed=""
for t in "$@"; do
    bin="$B/bin/$t"
    [ -x "$bin" ] || { echo "fuzz: $bin is missing (make fuzz-build)" >&2; exit 2; }
    mkdir -p "$B/corpus/$t"
    echo "fuzz: $t for ${S}s"
    # -timeout: one input taking over 10 s is a finding (a hostile YAML file
    # once took 24 s); -rss_limit_mb: so is memory beyond 2 GiB.
    if "$bin" -max_total_time="$S" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
            -artifact_prefix="$B/findings/$t-" "$B/corpus/$t" "tests/fuzz/corpus/$t" \
            > "$B/$t.log" 2>&1; then
        grep -E '^stat::number_of_executed_units|^#[0-9]+.*DONE' "$B/$t.log" | tail -2 | sed 's/^/  /'
    else
        failed="$failed $t"
        echo "fuzz: $t FOUND A PROBLEM (log $B/$t.log):" >&2
        grep -E 'ERROR|runtime error|Test unit written|SUMMARY' "$B/$t.log" | head -20 >&2
    fi
done
if [ -n "$failed" ]; then
    echo "fuzz: findings in:$failed (inputs in $B/findings/)" >&2
    exit 1
fi
echo "fuzz: $# target(s), ${S}s each, no findings"
