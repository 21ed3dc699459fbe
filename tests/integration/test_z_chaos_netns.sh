# The chaos test's network-namespace variant (tests/chaos/chaos.sh --netns) in
# its short version: 45 s of links cut and restored (one worker, two workers,
# the coordinator, a flapping link) under 3 streaming clients, every worker in
# its own namespace (20 s under the sanitizers; TSR_CHAOS_SECONDS sets it).  Needs
# root, as CI has.  No request may be lost, duplicated, skipped, wrong, or failed.
secs=45
[ "${TSR_SLOW:-0}" = 1 ] && secs=20
secs=${TSR_CHAOS_SECONDS:-$secs}
exec bash "$(dirname "$0")/../chaos/chaos.sh" --netns "$secs"
