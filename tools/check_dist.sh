#!/usr/bin/env bash
# Release check of the three distributions, each on its own:
#   sdist from packages/<pkg> (must carry common/) -> wheel built FROM that sdist -> installed ALONE
#   into a fresh virtual environment (torch only besides it) -> imported, and its _C loaded.
#   bash tools/check_dist.sh [OUT_DIR] [pkg ...]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$ROOT/build/dist-check}; shift || true
PKGS=${*:-fp8_layerwise ipc_all2all elastic_ep}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
$PY -m pip install -q build
VENV="$OUT/venv"
rm -rf "$VENV"
$PY -m venv "$VENV"
"$VENV/bin/python" -m pip install -q "${TORCH_SPEC:-torch==2.14.1}"
for pkg in $PKGS; do
  echo "== $pkg =="
  rm -rf "$OUT/$pkg"; mkdir -p "$OUT/$pkg"
  $PY -m build --sdist --no-isolation --outdir "$OUT/$pkg" "$ROOT/packages/$pkg" >"$OUT/$pkg/sdist.log" 2>&1 \
    || { tail -30 "$OUT/$pkg/sdist.log"; exit 1; }
  sdist=$(ls "$OUT/$pkg"/*.tar.gz)
  tar tzf "$sdist" | grep -q "/common/include/commkit/check.hpp" || { echo "sdist lacks common/"; exit 1; }
  echo "sdist: $(basename "$sdist") ($(tar tzf "$sdist" | wc -l) files, common/ included)"
  # Build the wheel from the unpacked sdist, far from the checkout, so ../../common cannot be used.
  mkdir -p "$OUT/$pkg/unpacked"; tar xzf "$sdist" -C "$OUT/$pkg/unpacked"
  src=$(ls -d "$OUT/$pkg/unpacked"/*/)
  $PY -m pip wheel -q --no-build-isolation --no-deps -w "$OUT/$pkg" "$src" >"$OUT/$pkg/wheel.log" 2>&1 \
    || { tail -30 "$OUT/$pkg/wheel.log"; exit 1; }
  whl=$(ls "$OUT/$pkg"/*.whl)
  echo "wheel: $(basename "$whl")"
  "$VENV/bin/python" -m pip install -q --no-deps "$whl"
  (cd "$OUT" && "$VENV/bin/python" -c "import $pkg, $pkg._C as c; print('imported', $pkg.__name__, getattr($pkg, '__version__', '?'), 'built_with_cuda', c.built_with_cuda())")
  "$VENV/bin/python" -m pip uninstall -q -y "$(echo $pkg | tr _ -)"
done
echo "dist check passed for: $PKGS"
