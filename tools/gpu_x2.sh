#!/usr/bin/env bash
# The prioritised 2-GPU call: what every open issue still needs from a machine with two NVLinked GPUs,
# in one device call of at most 10 minutes, most important first, each step under its own limit.
#
#   COMMKIT_GIT_REV=<hash> bash tools/gpu_x2.sh OUT_DIR
#
# Steps (seconds are the limits; a step that runs out is cut and the next one starts):
#   1. build elastic_ep, ipc_all2all and fp8_layerwise (tools/gpu.sh --no-tests --no-bench)       ~40
#   2. elastic_ep benchmark, aligned starts, every case sequential and overlapped (49 / 66 push
#      blocks), every dispatch with the push beside notify (PDL) and after it: the issue-5 table,
#      whether the overlapped modes pay, what PDL gains at EP 2                                   150
#   3. ipc_all2all benchmark with 264 blocks (two per SM): does it reach 330 GB/s at 64 MiB       60
#   4. elastic_ep low-level EP 2 tests on the NCCL window, sequential and overlapped (the
#      push-after-notify fallback only on the IPC window, which the one-GPU runs cover)           160
#   5. elastic_ep high-level EP 2 tests added since the last 2-GPU run (overlapped, refusal)       90
#   6. fp8_layerwise GPU tests, one rank per GPU (the scales now batched by default)               60
# Everything lands under OUT_DIR (logs, JSON, plots, junit XML). On the device:
#   timeout 570 bash tools/gpu_x2.sh /tmp/r; tar czf $OUT/r.tgz -C /tmp/r .
# so that what ran comes back even if the call's limit cuts the last step.
set -u
OUT=${1:?usage: bash tools/gpu_x2.sh OUT_DIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/tools/_gpu_steps.sh"
build_all
step bench_elastic_ep 150 $PY "$ROOT/tools/bench_elastic_ep.py" --out "$OUT/ep" --overlap-push-blocks default,66
step bench_ipc_264 60 $PY "$ROOT/tools/bench_ipc_all2all.py" --out "$OUT/ipc264" --num-blocks 264
step tests_ep_lowlevel 160 "${PYTEST[@]}" --junitxml="$OUT/junit_lowlevel.xml" -k "not push_after_notify" \
  "$ROOT/tests/elastic_ep/test_lowlevel_gpu.py"
step tests_ep_new 90 "${PYTEST[@]}" --junitxml="$OUT/junit_new.xml" "$ROOT/tests/elastic_ep/test_gpu.py" \
  -k "overlapped or refused"
step tests_fp8 60 "${PYTEST[@]}" --junitxml="$OUT/junit_fp8.xml" "$ROOT/tests/fp8_layerwise"
echo "gpu_x2.sh done $(date -u +%T)"
