#!/usr/bin/env bash
# Sets up a fresh machine (tools/setup_env.sh) and runs the main job:
#  * with a GPU: the benchmark suite of the three packages against their baselines
#    (tools/gpu.sh: build, GPU tests skipped, benchmarks; results under out/);
#  * without a GPU: fp8_layerwise streams a synthetic MoE layer between several processes through
#    its CPU backend, checks every byte, and prints what it moved and how fast.
#   bash tools/run.sh [extra args for the fp8_layerwise demo]
set -euo pipefail
source "$(dirname "$0")/setup_env.sh"
cd "$COMMKIT_ROOT"
if python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() and torch.cuda.device_count() > 0 else 1)"; then
  out="out/bench-$(date -u +%Y%m%d-%H%M%S)"
  echo "[run] GPU found: benchmark suite -> $out"
  exec bash tools/gpu.sh "$out" --no-tests
else
  echo "[run] no GPU: fp8_layerwise CPU-backend streaming demo"
  exec python -m fp8_layerwise.demo "$@"
fi
