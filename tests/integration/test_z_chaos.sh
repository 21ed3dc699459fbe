# The chaos test (tests/chaos/chaos.sh) in its short version: 60 s of random
# worker kills and stops, coordinator restarts and reshards under 3 streaming
# clients (30 s under the sanitizers).  No request may be lost, duplicated,
# skipped, wrong, or failed.  bench/chaos.sh runs the long version.
secs=60
[ "${TSR_SLOW:-0}" = 1 ] && secs=30
exec bash "$(dirname "$0")/../chaos/chaos.sh" "$secs"
