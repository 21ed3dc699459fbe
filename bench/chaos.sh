#!/bin/bash
# The chaos test's long version: tests/chaos/chaos.sh for $1 seconds
# (default 600).  Prints the requests sent, completed, failed, lost,
# duplicated and skipped, and the recovery time after a fault at p50 and p99.
cd "$(dirname "$0")/.." || exit 1
exec bash tests/chaos/chaos.sh "${1:-600}"
