# Sourced by tools/run.sh and tools/test.sh: idempotent set-up of a fresh machine.
#  * a virtual environment in .venv (sees the system's packages, so an installed torch is reused);
#  * torch (TORCH_SPEC, default torch==2.14.1: the CUDA 13 build that brings NCCL with the device-API
#    headers) if none is importable, and the build/test dependencies;
#  * the three packages, built with --no-build-isolation against that torch; CUDA sources are
#    compiled for sm_90a whenever nvcc is found (COMMKIT_BUILD_CUDA=ON makes nvcc mandatory).
# Environment: PYTHON (interpreter for the venv), COMMKIT_VENV (default .venv), COMMKIT_PACKAGES,
# COMMKIT_SKIP_BUILD=1 (reuse what is installed).
set -euo pipefail
COMMKIT_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$COMMKIT_ROOT"
source "$COMMKIT_ROOT/tools/env.sh"  # the one place of the environment settings (NVLink multicast off)
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
if [ -z "${CUDACXX:-}" ] && ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
VENV=${COMMKIT_VENV:-$COMMKIT_ROOT/.venv}
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "${PYTHON:-python3}" -m venv --system-site-packages "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
if ! python -c "import torch" >/dev/null 2>&1; then
  echo "[setup] installing ${TORCH_SPEC:-torch==2.14.1}"
  python -m pip install -q "${TORCH_SPEC:-torch==2.14.1}"
fi
python -m pip install -q -r requirements-dev.txt
python - <<'PY'
import torch
print(f"[setup] python {__import__('sys').version.split()[0]}, torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}, GPUs {torch.cuda.device_count() if torch.cuda.is_available() else 0}")
PY
if [ "${COMMKIT_SKIP_BUILD:-0}" != 1 ]; then
  for pkg in ${COMMKIT_PACKAGES:-fp8_layerwise ipc_all2all elastic_ep}; do
    echo "[setup] building $pkg"
    t0=$(date +%s)
    log="$COMMKIT_ROOT/build/logs/build_$pkg.log"
    mkdir -p "$(dirname "$log")"
    if ! python -m pip install --no-build-isolation --no-deps -v "packages/$pkg" >"$log" 2>&1; then
      tail -60 "$log"
      echo "[setup] building $pkg FAILED (full log: $log)" >&2
      exit 1
    fi
    grep -E "commkit: (CUDA|NCCL|no nvcc)" "$log" | sed 's/^ *-- /[setup]   /' || true
    echo "[setup] built $pkg in $(( $(date +%s) - t0 )) s"
  done
fi
