#!/usr/bin/env bash
# The second 2-GPU call, after tools/gpu_x2.sh: what still needs two NVLinked GPUs, in one device call
# of at most 10 minutes, each step under its own limit.
#
#   COMMKIT_GIT_REV=<hash> bash tools/gpu_x2b.sh OUT_DIR
#
# Steps (seconds are the limits):
#   1. build the three packages (tools/gpu.sh --no-tests --no-bench)                               ~40
#   2. ipc_all2all GPU suite on 2 GPUs (issue 4's "passes on 2 GPUs"; fp8 on the wire over NVLink) 200
#      (15 two-rank tests, ~12 s each on one shared GPU; the 3- and 4-rank ones skip on 2 GPUs)
#   3. elastic_ep 1000-iteration soak and the IPC-window soaks, one GPU per rank, every iteration
#      checked against the oracle too                                                            300
# The full-size fp8_layerwise benchmark with both GPUs copying is tools/gpu_x2c.sh.
# On the device:  timeout 590 bash tools/gpu_x2b.sh /tmp/r; tar czf $OUT/r.tgz -C /tmp/r .
set -u
OUT=${1:?usage: bash tools/gpu_x2b.sh OUT_DIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/tools/_gpu_steps.sh"
build_all
step tests_ipc 200 "${PYTEST[@]}" --junitxml="$OUT/junit_ipc.xml" "$ROOT/tests/ipc_all2all"
step tests_ep_soak 300 "${PYTEST[@]}" --junitxml="$OUT/junit_soak.xml" "$ROOT/tests/elastic_ep/test_gpu.py" -k soak
echo "gpu_x2b.sh done $(date -u +%T)"
