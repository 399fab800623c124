#!/usr/bin/env bash
# GPU-machine diagnosis of "a C++ exception reaching Python kills the process" (see tools/probe_exceptions.py).
#   bash tools/diag/exceptions.sh OUT_DIR
set -u
OUT=${1:?OUT}; mkdir -p "$OUT"; ROOT=$(cd "$(dirname "$0")/../.." && pwd)
export COMMKIT_BUILD_CUDA=ON CUDAARCHS=90a CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
gcc -shared -fPIC -o /tmp/segv.so "$ROOT/tools/diag/segv_backtrace.c"
python3 -m pip install --no-build-isolation --no-deps "$ROOT/packages/fp8_layerwise" > "$OUT/build_base.log" 2>&1
{
  echo "--- torch's bundled pybind11"
  T=$(python3 -c "import torch,os;print(os.path.dirname(torch.__file__))")
  grep -h "define PYBIND11_VERSION_M\|define PYBIND11_INTERNALS_VERSION" "$T"/include/pybind11/detail/common.h "$T"/include/pybind11/detail/internals.h
  python3 -c "import pybind11; print('pybind11 pkg', pybind11.__version__)"
  SO=$(python3 -c "import importlib.util as u;print(u.find_spec('fp8_layerwise').submodule_search_locations[0])")/$(cd "$(python3 -c "import importlib.util as u;print(u.find_spec('fp8_layerwise').submodule_search_locations[0])")" && ls _C*.so)
  echo "--- so: $SO"
  cd /tmp
  THROW="try:\n m.ShmSegment.attach('/nonexistent-commkit')\nexcept Exception as e: print('caught', type(e).__name__, e)"
  echo "--- 1. no torch: load the .so alone"
  python3 -c "import importlib.util as u,sys;s=u.spec_from_file_location('_C','$SO');m=u.module_from_spec(s);s.loader.exec_module(m);exec(\"$THROW\")"; echo "rc=$?"
  echo "--- 2. torch first, then the .so alone"
  python3 -c "import torch,importlib.util as u;s=u.spec_from_file_location('_C','$SO');m=u.module_from_spec(s);s.loader.exec_module(m);exec(\"$THROW\")"; echo "rc=$?"
  echo "--- 3. backtrace of the crash (torch first)"
  LD_PRELOAD=/tmp/segv.so python3 -c "import torch,importlib.util as u;s=u.spec_from_file_location('_C','$SO');m=u.module_from_spec(s);s.loader.exec_module(m);exec(\"$THROW\")" 2> /tmp/bt.txt; echo "rc=$?"
  cat /tmp/bt.txt | head -40
  echo "--- addr2line"
  while read -r line; do
    f=$(echo "$line" | sed -n 's/^\([^()]*\)(\(.*\)+\(0x[0-9a-f]*\)).*/\1 \3/p'); [ -n "$f" ] || continue
    set -- $f; case "$1" in *.so*) echo "$line => $(addr2line -f -C -e "$1" "$2" 2>/dev/null | tr '\n' ' ')";; esac
  done < /tmp/bt.txt | head -30
} > "$OUT/diag.txt" 2>&1
cat "$OUT/diag.txt"
