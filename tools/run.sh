#!/usr/bin/env bash
# Sets up the machine (tools/setup_env.sh: which Python environment and torch, and what it installs
# when something is missing) and runs the main job, saving what it prints under out/:
#  * with a GPU: the benchmark suite of the three packages against their baselines
#    (`tools/gpu.sh OUT bench`, which builds the packages for sm_90a first): every benchmark writes its
#    table (.md), JSON and PNG plot, and gpu.sh its logs, into out/bench-<UTC time>/;
#  * without a GPU: fp8_layerwise streams synthetic MoE layers between several processes through its
#    CPU backend, checks every byte, and prints each rank's steady-state throughput and where the
#    time went, then runs its prefill loop at tiny sizes (tools/block_fp8_layerwise.py); the output,
#    the tables (demo.md, prefill.md) and figures (demo.json, prefill.json, prefill.png) go to
#    out/demo-<UTC time>/.
# It ends with the list of files written.
#   bash tools/run.sh [extra args for the fp8_layerwise streaming run]
# OUT_DIR=DIR writes there instead (made absolute). COMMKIT_GPU=0 forces the CPU demo.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
gpu=${COMMKIT_GPU:-auto}
if [ "$gpu" = auto ]; then
  gpu=0
  { [ -e /dev/nvidia0 ] || nvidia-smi -L >/dev/null 2>&1; } && gpu=1
fi
if [ "$gpu" = 1 ]; then
  export COMMKIT_SKIP_BUILD=${COMMKIT_SKIP_BUILD:-1}  # tools/gpu.sh builds, with a GPU machine's settings
fi
# shellcheck source=tools/setup_env.sh
source "$ROOT/tools/setup_env.sh"
cd "$COMMKIT_ROOT"
stamp=$(date -u +%Y%m%d-%H%M%S)
if [ "$gpu" = 1 ] && ! "$COMMKIT_PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() and torch.cuda.device_count() > 0 else 1)"; then
  echo "[run] an NVIDIA device is visible but torch cannot use it (above): running the CPU demo" >&2
  gpu=0
fi
t0=$(date +%s)
set +e
if [ "$gpu" = 1 ]; then
  out=${OUT_DIR:-$COMMKIT_ROOT/out/bench-$stamp}
  mkdir -p "$out" && out=$(cd "$out" && pwd)
  echo "[run] GPU found: benchmark suite -> $out"
  bash "$COMMKIT_ROOT/tools/gpu.sh" "$out" bench 2>&1 | tee "$out/run.log"
  rc=${PIPESTATUS[0]}
else
  out=${OUT_DIR:-$COMMKIT_ROOT/out/demo-$stamp}
  mkdir -p "$out" && out=$(cd "$out" && pwd)
  echo "[run] no GPU: fp8_layerwise CPU-backend streaming demo -> $out"
  "$COMMKIT_PYTHON" "$COMMKIT_ROOT/tools/block_fp8_layerwise.py" --out "$out" "$@" 2>&1 | tee "$out/run.log"
  rc=${PIPESTATUS[0]}
fi
set -e
echo "[run] main job exit status $rc after $(( $(date +%s) - t0 )) s; files written under $out:"
(cd "$out" && find . -type f -printf '%P\t%s\n' | sort | awk -F'\t' '{printf "  %s (%d bytes)\n", $1, $2}')
exit "$rc"
