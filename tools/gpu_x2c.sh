#!/usr/bin/env bash
# The third 2-GPU call, after tools/gpu_x2.sh and tools/gpu_x2b.sh: the full-size fp8_layerwise
# benchmark (48 experts, 3 layers) with both GPUs copying, in one device call.
#
#   COMMKIT_GIT_REV=<hash> bash tools/gpu_x2c.sh OUT_DIR
#
# Steps (seconds are the limits):
#   1. build the three packages (tools/gpu.sh --no-tests --no-bench)                               ~40
#   2. fp8_layerwise GPU tests (TP 2 on 2 GPUs)                                                     90
#   3. fp8_layerwise benchmark, full size, both GPUs copying                                       300
# On the device:  timeout 590 bash tools/gpu_x2c.sh /tmp/r; tar czf $OUT/r.tgz -C /tmp/r .
set -u
OUT=${1:?usage: bash tools/gpu_x2c.sh OUT_DIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/tools/_gpu_steps.sh"
build_all
step tests_fp8 90 "${PYTEST[@]}" --junitxml="$OUT/junit_fp8.xml" "$ROOT/tests/fp8_layerwise"
step bench_fp8 300 $PY "$ROOT/tools/bench_fp8_layerwise.py" --out "$OUT/fp8"
echo "gpu_x2c.sh done $(date -u +%T)"
