#!/bin/sh
# Installs the Debian packages Tessera builds and tests with.  Idempotent:
# does nothing when every package is already present.  Needs root (or sudo).
set -eu

PKGS="build-essential pkg-config libzmq3-dev libczmq-dev libyaml-dev \
libprotobuf-c-dev protobuf-c-compiler libssl-dev libjansson-dev libpcre2-dev libmicrohttpd-dev \
libopenblas-dev libsystemd-dev libcmocka-dev python3 python3-numpy python3-venv python3-prometheus-client procps iproute2 \
clang libclang-rt-14-dev"
# clang and libclang-rt-14-dev (libFuzzer and the sanitizer runtimes, only
# recommended by clang, so --no-install-recommends would skip them): make fuzz.

missing=""
for p in $PKGS; do
    dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"
done
[ -z "$missing" ] && exit 0

echo "install-deps: installing:$missing"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# shellcheck disable=SC2086
$SUDO apt-get install -y -qq --no-install-recommends $missing
