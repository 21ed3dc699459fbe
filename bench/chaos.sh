#!/bin/bash
# The chaos test's long version: tests/chaos/chaos.sh for SECONDS (default
# 600); with --netns (root), the network-namespace variant that cuts and
# restores links instead of killing processes.  Prints the requests sent,
# completed, failed, lost, duplicated and skipped, and the recovery time after
# a fault at p50 and p99.
#   bench/chaos.sh [--netns] [SECONDS]
cd "$(dirname "$0")/.." || exit 1
net=()
[ "${1:-}" = --netns ] && { net=(--netns); shift; }
exec bash tests/chaos/chaos.sh "${net[@]}" "${1:-600}"
