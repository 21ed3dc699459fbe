#!/bin/sh
# Makes build/pyenv, a Python virtual environment with the test-only packages of
# tests/requirements.txt (the reference tokenizer, the OpenAI client), and prints its
# python's path.  Idempotent: nothing is installed when the environment already holds
# this version of the requirements.  The system's python3 and python3-venv come from
# scripts/install-deps.sh; the packages come from the Python package index.
set -eu
cd "$(dirname "$0")/.."
env=build/pyenv
req=tests/requirements.txt
stamp="$env/.requirements"
if [ -x "$env/bin/python" ] && cmp -s "$req" "$stamp"; then
    echo "$env/bin/python"
    exit 0
fi
rm -rf "$env"
# --system-site-packages: the Debian packages (python3-prometheus-client, numpy) too.
/usr/bin/python3 -m venv --system-site-packages "$env" >&2
"$env/bin/pip" install --quiet --disable-pip-version-check -r "$req" >&2
cp "$req" "$stamp"
echo "$env/bin/python"
