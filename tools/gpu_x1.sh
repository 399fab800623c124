#!/usr/bin/env bash
# The GPU test suites on a one-GPU machine, in two device calls of under 600 s each: ranks of the
# multi-rank tests share the GPU (COMMKIT_TEST_SHARE_GPU=1, correctness only; see tests/conftest.py).
#
#   COMMKIT_GIT_REV=<hash> bash tools/gpu_x1.sh OUT_DIR a    # build; fp8_layerwise and ipc_all2all GPU tests
#   COMMKIT_GIT_REV=<hash> bash tools/gpu_x1.sh OUT_DIR b    # elastic_ep GPU tests (reuses part a's build;
#       BUILD=1 builds first, BENCH=1 adds the benchmark with --quick, ~20 s)
#   COMMKIT_GIT_REV=<hash> bash tools/gpu_x1.sh OUT_DIR waits  # build; the tests of the device-side waits:
#       the whole ipc_all2all suite and elastic_ep's timeout, late-peer and IPC-window soak tests (~540 s)
#   COMMKIT_GIT_REV=<hash> bash tools/gpu_x1.sh OUT_DIR smoke  # build; a short check of every package (~180 s):
#       fp8_layerwise's GPU tests, ipc_all2all's reference, validation and torch.compile tests, elastic_ep's
#       EP 1 mode matrices and bad-input test
#   COMMKIT_GIT_REV=<hash> bash tools/gpu_x1.sh OUT_DIR ep     # build; elastic_ep's kernel-path tests (EP 1
#       matrices, the EP 2 low-level matrix on the IPC window, CUDA graph, timeout, refused ids) and the
#       benchmark with --quick (~480 s)
#
# Part a (limits in seconds): build ~40, fp8_layerwise 120, ipc_all2all 400.  Part b: elastic_ep 560.
# Part b must start while the machine from part a is still held (its packages are installed there);
# if the machine was released in between, pass BUILD=1 to rebuild first (~40 s more).
# On the device:  timeout 590 bash tools/gpu_x1.sh /tmp/r a; tar czf $OUT/r.tgz -C /tmp/r .
set -u
OUT=${1:?usage: bash tools/gpu_x1.sh OUT_DIR a|b|waits|smoke|ep}
PART=${2:?usage: bash tools/gpu_x1.sh OUT_DIR a|b|waits|smoke|ep}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export COMMKIT_TEST_SHARE_GPU=1
source "$ROOT/tools/_gpu_steps.sh"
case "$PART" in
  a)
    build_all
    step tests_fp8 120 "${PYTEST[@]}" --junitxml="$OUT/junit_fp8.xml" "$ROOT/tests/fp8_layerwise"
    step tests_ipc 400 "${PYTEST[@]}" --junitxml="$OUT/junit_ipc.xml" "$ROOT/tests/ipc_all2all"
    ;;
  b)
    [ "${BUILD:-0}" = 1 ] && build_all
    step tests_elastic 560 "${PYTEST[@]}" --junitxml="$OUT/junit_elastic.xml" "$ROOT/tests/elastic_ep"
    [ "${BENCH:-0}" = 1 ] && step bench_elastic 60 $PY "$ROOT/tools/bench_elastic_ep.py" --out "$OUT/bench_ep" --quick \
      --overlap-push-blocks none
    ;;
  waits)
    build_all
    step tests_ipc 320 "${PYTEST[@]}" --junitxml="$OUT/junit_ipc.xml" "$ROOT/tests/ipc_all2all"
    step tests_elastic_waits 230 "${PYTEST[@]}" --junitxml="$OUT/junit_elastic_waits.xml" \
      -k "timeout or late_peer or soak_ipc_window" "$ROOT/tests/elastic_ep"
    ;;
  smoke)
    build_all
    step tests_fp8 70 "${PYTEST[@]}" --junitxml="$OUT/junit_fp8.xml" "$ROOT/tests/fp8_layerwise"
    step tests_ipc_smoke 80 "${PYTEST[@]}" --junitxml="$OUT/junit_ipc_smoke.xml" \
      -k "torch_compile or matches_torch_nccl_path or validation_before_launch" "$ROOT/tests/ipc_all2all"
    step tests_elastic_smoke 60 "${PYTEST[@]}" --junitxml="$OUT/junit_elastic_smoke.xml" \
      -k "(native_ep1_matrix and not overlapped) or bad_inputs_native_ep1 or (lowlevel_ep1_modes and not overlapped and not notify)" \
      "$ROOT/tests/elastic_ep"
    ;;
  ep)
    build_all
    step tests_elastic_ep 260 "${PYTEST[@]}" --junitxml="$OUT/junit_elastic_ep.xml" \
      -k "native_ep1_matrix or lowlevel_ep1_modes or lowlevel_ep2_ipc_window or ep1_cuda_graph or timeout_ipc_window or bad_ids_refused" \
      "$ROOT/tests/elastic_ep"
    step bench_elastic 180 $PY "$ROOT/tools/bench_elastic_ep.py" --out "$OUT/bench_ep" --quick
    ;;
  *) echo "unknown part $PART (a, b, waits, smoke or ep)" >&2; exit 2 ;;
esac
echo "gpu_x1.sh $PART done $(date -u +%T)"
