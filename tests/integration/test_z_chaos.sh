# The chaos test (tests/chaos/chaos.sh) in its short version: 60 s of random
# worker kills and stops, coordinator restarts and reshards under 3 streaming
# clients (30 s under the sanitizers; TSR_CHAOS_SECONDS sets it, as CI's CPU-only
# pass does).  No request may be lost, duplicated, skipped, wrong, or failed.
# bench/chaos.sh runs the long version.
secs=60
[ "${TSR_SLOW:-0}" = 1 ] && secs=30
secs=${TSR_CHAOS_SECONDS:-$secs}
exec bash "$(dirname "$0")/../chaos/chaos.sh" "$secs"
