#!/usr/bin/env bash
# The one command for the GPU machine: build the packages, run their GPU test suites and
# benchmarks, and leave logs, JSON and plots in an output folder.
#
#   bash tools/gpu.sh OUT_DIR [--only pkg[,pkg..]] [--no-build] [--no-tests] [--no-bench] [--quick] [-- PYTEST_ARGS..]
#
# * builds the chosen packages (default: all three) with pip --no-build-isolation, in parallel,
#   kernels for sm_90a only, against the machine's torch and NCCL;
# * runs `pytest tests/<pkg>` for each (GPU tests included; PYTEST_ARGS are passed on);
# * runs `python tools/bench_<pkg>.py --out OUT_DIR [--quick]` for each, unless --no-bench;
# * exits non-zero if a build or a test suite failed (benchmarks still run).
# --no-build reuses what an earlier call in the same machine session installed.
# COMMKIT_TEST_SHARE_GPU=1 lets tests marked multigpu(n, shared_ok=True) run with ranks sharing a GPU
# (correctness only; see tests/conftest.py).
# COMMKIT_REQUIRE_GPU=1 is exported (unless set otherwise): a machine where CUDA is unusable fails the test
# suites at start-up instead of skipping every GPU test, and a GPU test that skips for any reason but
# needing more GPUs than there are (e.g. a package built without CUDA) fails (see tests/conftest.py).
# Each suite runs under `timeout $TEST_TIMEOUT_S` (default 300) and each benchmark under
# `timeout $BENCH_TIMEOUT_S` (default 240), so one hang cannot eat the whole device session.
# The device's copy of the tree has no .git: pass COMMKIT_GIT_REV=<short hash> so the results record
# the revision they were measured at.
# Wheels carried in .whl/ (e.g. a newer scikit-build-core) are installed to a private path first.
set -u
OUT=${1:?usage: bash tools/gpu.sh OUT_DIR [--only pkgs] [--no-tests] [--no-bench] [--quick] [-- pytest args]}
shift
PKGS="fp8_layerwise ipc_all2all elastic_ep"
TESTS=1 BENCH=1 BUILD=1 QUICK=""
PYTEST_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --only) PKGS=$(echo "$2" | tr ',' ' '); shift 2 ;;
    --no-build) BUILD=0; shift ;;
    --no-tests) TESTS=0; shift ;;
    --no-bench) BENCH=0; shift ;;
    --quick) QUICK="--quick"; shift ;;
    --) shift; PYTEST_ARGS=("$@"); break ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export COMMKIT_REQUIRE_GPU=${COMMKIT_REQUIRE_GPU:-1}
export COMMKIT_GIT_REV=${COMMKIT_GIT_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export PYTHONUNBUFFERED=1 COMMKIT_BUILD_CUDA=${COMMKIT_BUILD_CUDA:-ON} CUDAARCHS=90a
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/commkit-site .whl/*.whl \
    && export PYTHONPATH=/tmp/commkit-site${PYTHONPATH:+:$PYTHONPATH}
fi
{
  date -u; hostname; echo "git $COMMKIT_GIT_REV"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
  $PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
  $PY -c "import scikit_build_core, pybind11; print('scikit-build-core', scikit_build_core.__version__, 'pybind11', pybind11.__version__)"
} 2>&1 | tee "$OUT/env.txt"

rc=0
t0=$(date +%s)
pids=()
for p in $PKGS; do
  [ "$BUILD" = 1 ] || continue
  ( $PY -m pip install --no-build-isolation --no-deps -v "packages/$p" > "$OUT/build_$p.log" 2>&1 \
      && echo "built $p" || { echo "BUILD FAILED: $p"; tail -40 "$OUT/build_$p.log"; exit 1; } ) &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
echo "build took $(( $(date +%s) - t0 )) s"

cd /tmp  # import the installed packages, not the source folders
for p in $PKGS; do
  if [ "$TESTS" = 1 ] && [ -d "$ROOT/tests/$p" ]; then
    echo "=== tests: $p ==="
    timeout "${TEST_TIMEOUT_S:-300}" $PY -m pytest "$ROOT/tests/$p" -c "$ROOT/pytest.ini" --rootdir "$ROOT" -q -rfE --junitxml="$OUT/junit_$p.xml" "${PYTEST_ARGS[@]}" 2>&1 | tee "$OUT/tests_$p.log"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  fi
done
for p in $PKGS; do
  if [ "$BENCH" = 1 ] && [ -f "$ROOT/tools/bench_$p.py" ]; then
    echo "=== benchmark: $p ==="
    timeout "${BENCH_TIMEOUT_S:-240}" $PY "$ROOT/tools/bench_$p.py" --out "$OUT" $QUICK 2>&1 | tee "$OUT/bench_$p.log"
  fi
done
echo "gpu.sh done rc=$rc"
exit $rc
