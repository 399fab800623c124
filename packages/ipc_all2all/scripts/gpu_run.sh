#!/usr/bin/env bash
# One GPU-machine session for ipc_all2all within a fixed time budget: build + benchmark first (via
# tools/gpu.sh), then the GPU test suite under the remaining time, so a slow or hanging test cannot
# cost the benchmark figures.
#   bash packages/ipc_all2all/scripts/gpu_run.sh OUT_DIR [BUILD_BENCH_S] [TEST_S] [-- pytest args]
set -u
OUT=${1:?OUT_DIR}; BB=${2:-140}; TS=${3:-140}; shift 3 2>/dev/null || shift $#
[ "${1:-}" = "--" ] && shift
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout "$BB" bash "$ROOT/tools/gpu.sh" "$OUT" --only ipc_all2all --no-tests ${QUICK:+--quick}; echo "build+bench rc=$?"
cd /tmp
timeout "$TS" python3 -m pytest "$ROOT/tests/ipc_all2all" -c "$ROOT/pytest.ini" --rootdir "$ROOT" -q -rA \
  --junitxml="$OUT/junit_ipc_all2all.xml" "$@" 2>&1 | tee "$OUT/tests_ipc_all2all.log" | tail -60
echo "tests rc=${PIPESTATUS[0]}"
