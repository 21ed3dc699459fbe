#!/bin/bash
# Device check: a CUDA worker probes the real GPU through NVML, registers with
# its device memory, takes a cuda piece and reports ready; a worker for a GPU
# that does not exist fails with a clear message.
set -u
cd "$(dirname "$0")/.."
# When the binaries were built elsewhere, their libraries can travel in a
# folder named by TSR_LIBS.
[ -n "${TSR_LIBS:-}" ] && export LD_LIBRARY_PATH="$TSR_LIBS"
B="${TSR_BIN:-bin}"
T=$(mktemp -d)
nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
cat > $T/d.yaml <<YAML
version: 1
coordinator:
  workers_endpoint: tcp://127.0.0.1:7500
  control_endpoint: tcp://127.0.0.1:7501
  security: none
deployments:
  - name: tiny-gpu
    model: $PWD/configs/models/tiny
    device: cuda
    parallel: {tensor: 1, pipeline: 1, replicas: 1}
YAML
$B/tessera-coordinator --adopt-grace-ms 200 $T/d.yaml 2> $T/c.log &
$B/tessera-worker --coordinator tcp://127.0.0.1:7500 --device cuda --device-index 0 --name gpu0 2> $T/w0.log &
$B/tessera-worker --coordinator tcp://127.0.0.1:7500 --device cuda --device-index 7 --name gpu7 2> $T/w7.log; echo "gpu7 worker exit status: $?"
$B/tessera --coordinator tcp://127.0.0.1:7501 status --wait-ready 10; echo "wait-ready exit: $?"
$B/tessera --coordinator tcp://127.0.0.1:7501 workers --json
echo "--- coordinator log"; cat $T/c.log
echo "--- gpu0 log"; cat $T/w0.log
echo "--- gpu7 log"; cat $T/w7.log
kill %1 %2 2>/dev/null; wait
