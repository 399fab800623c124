#!/usr/bin/env bash
# Release check of the three distributions, each on its own:
#   sdist from packages/<pkg> (must carry common/) -> wheel built FROM that sdist -> installed ALONE
#   into a fresh virtual environment -> imported from outside the checkout: _C loads and __version__
#   equals pyproject.toml's version. The sdist's and the wheel's file lists are written to
#   OUT_DIR/<pkg>/{sdist,wheel}-contents.txt, and the check fails if either carries raw results
#   (benchmarks/, *.json, *.png, *.csv, *.log, text dumps, ...): docs such as README.md,
#   BENCHMARKS.md and CHANGELOG.md may ship, measured data may not.
#   bash tools/check_dist.sh [all | pkg ...]        (default all; OUT_DIR, default build/dist-check)
# Works offline: $PYTHON (default python3) builds with --no-build-isolation, so it needs torch,
# pybind11, scikit-build-core and build. The venv sees the system's packages when $PYTHON has torch
# (TORCH_SPEC installs one into a bare venv instead); the checked package must import from the venv.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT_DIR:-$ROOT/build/dist-check}
PKGS=${*:-all}
[ "$PKGS" = all ] && PKGS="fp8_layerwise ipc_all2all elastic_ep"
for pkg in $PKGS; do
  [ -f "$ROOT/packages/$pkg/pyproject.toml" ] \
    || { echo "unknown package '$pkg' (all, fp8_layerwise, ipc_all2all or elastic_ep)" >&2; exit 2; }
done
PY=${PYTHON:-python3}
mkdir -p "$OUT"
# Raw results: anything under a benchmarks/ folder, data, plots, logs and text dumps. CMake's
# CMakeLists.txt and the wheel metadata's *.txt (entry_points.txt, top_level.txt) are not results.
RESULT_RE='(^|/)benchmarks/|[.](json|png|jpe?g|svg|gif|csv|tsv|log|npz|npy|pt|pkl|txt)$'
NOT_RESULT_RE='(^|/)CMakeLists[.]txt$|[.]dist-info/[^/]+[.]txt$'
# no_results WHAT LIST_FILE: fails, naming them, when the listed archive holds result files.
no_results() {
  local bad
  bad=$(grep -E "$RESULT_RE" "$2" | grep -vE "$NOT_RESULT_RE" || true)
  if [ -n "$bad" ]; then
    echo "$1 carries raw results (keep them out of packages/; see sdist.exclude / wheel.exclude):" >&2
    sed 's/^/  /' <<<"$bad" >&2
    exit 1
  fi
}
$PY -c "import build" 2>/dev/null || $PY -m pip install -q build
VENV="$OUT/venv"
rm -rf "$VENV"
if [ -z "${TORCH_SPEC:-}" ] && $PY -c "import torch" 2>/dev/null; then
  $PY -m venv --system-site-packages "$VENV"
  # When $PYTHON is itself a virtual environment's, --system-site-packages shows the base
  # interpreter's packages, not that environment's (where torch is): a .pth file adds them, after the
  # new venv's own site-packages, so the package under check still imports from the new venv.
  if [ "$($PY -c 'import sys; print(sys.prefix != sys.base_prefix)')" = True ]; then
    "$PY" -c 'import sysconfig; p = sysconfig.get_paths(); print(p["purelib"]); print(p["platlib"])' \
      > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_check_dist_parent.pth"
  fi
else
  $PY -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q "${TORCH_SPEC:-torch==2.14.1}"
fi
for pkg in $PKGS; do
  echo "== $pkg =="
  rm -rf "${OUT:?}/$pkg"; mkdir -p "$OUT/$pkg"
  $PY -m build --sdist --no-isolation --outdir "$OUT/$pkg" "$ROOT/packages/$pkg" >"$OUT/$pkg/sdist.log" 2>&1 \
    || { tail -30 "$OUT/$pkg/sdist.log"; exit 1; }
  sdist=$(ls "$OUT/$pkg"/*.tar.gz)
  files=$(tar tzf "$sdist")  # (not piped into grep -q: pipefail would see tar's SIGPIPE)
  for f in common/include/commkit/check.hpp common/cmake/CommkitDeps.cmake common/CMakeLists.txt; do
    grep -q "/$f\$" <<<"$files" || { echo "sdist lacks $f"; exit 1; }
  done
  sed 's|^[^/]*/||' <<<"$files" | grep -v '^$' | sort > "$OUT/$pkg/sdist-contents.txt"
  no_results "sdist $(basename "$sdist")" "$OUT/$pkg/sdist-contents.txt"
  echo "sdist: $(basename "$sdist") ($(wc -l <"$OUT/$pkg/sdist-contents.txt") files, common/ included, no results;" \
       "list: $OUT/$pkg/sdist-contents.txt)"
  # pip builds the wheel in a temporary unpacked copy, far from the checkout (no ../../common there).
  $PY -m pip wheel -q --no-build-isolation --no-deps -w "$OUT/$pkg" "$sdist" >"$OUT/$pkg/wheel.log" 2>&1 \
    || { tail -30 "$OUT/$pkg/wheel.log"; exit 1; }
  whl=$(ls "$OUT/$pkg"/*.whl)
  $PY -c 'import sys, zipfile; print("\n".join(sorted(zipfile.ZipFile(sys.argv[1]).namelist())))' "$whl" \
    > "$OUT/$pkg/wheel-contents.txt"
  no_results "wheel $(basename "$whl")" "$OUT/$pkg/wheel-contents.txt"
  echo "wheel: $(basename "$whl") ($(wc -l <"$OUT/$pkg/wheel-contents.txt") files, no results;" \
       "list: $OUT/$pkg/wheel-contents.txt)"
  "$VENV/bin/python" -m pip install -q --no-deps --force-reinstall "$whl"  # even if $PY has this version
  ver=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$ROOT/packages/$pkg/src/$pkg/__init__.py")
  (cd "$OUT" && "$VENV/bin/python" - "$pkg" "$ver" "$VENV" <<'PY')
import importlib, importlib.metadata as md, os, sys
pkg, ver, venv = sys.argv[1:]
m, c = importlib.import_module(pkg), importlib.import_module(pkg + "._C")
assert os.path.realpath(m.__file__).startswith(os.path.realpath(venv) + "/"), f"{pkg} came from {m.__file__}"
assert m.__version__ == ver == md.version(pkg.replace("_", "-")), \
    f"{pkg}.__version__ is {m.__version__!r}, its metadata {md.version(pkg.replace('_', '-'))!r}, the source {ver!r}"
print("imported", pkg, m.__version__, "built_with_cuda", c.built_with_cuda())
PY
  "$VENV/bin/python" -m pip uninstall -q -y "$(echo "$pkg" | tr _ -)"
done
echo "dist check passed for: $PKGS"
