#!/usr/bin/env bash
# Release build of the packages: one sdist each, and from that sdist one wheel per Python (3.10-3.13),
# kernels compiled ahead of time for sm_90a and sm_100a, checked and retagged by tools/wheelcheck.py
# (metadata, contents, RECORD, manylinux policy), then each wheel installed into a fresh virtual
# environment of its Python and imported there; the cp311 one also runs the package's CPU tests.
#   bash tools/release.sh <package>|all        (output: dist/, work files under dist/.work/)
# No torch is needed to build. The wheels' test environments get TORCH_SPEC (default torch==2.13.0+cpu,
# another torch than the GPU machine's 2.11 and CI's 2.14.1) where pip can install it for that Python;
# where it cannot, the check installs no torch and loads the package's torch-free part, its extension
# _C, and the summary says so. elastic_ep's environments also get NCCL from NVIDIA's wheel, as its
# [cu13] extra would (the extension finds libnccl.so.2 through its $ORIGIN run path, torch or not).
# The extensions are linked for COMMKIT_PLAT's glibc on whatever machine this runs (Debian 12's glibc 2.36
# here): COMMKIT_MANYLINUX (default: from COMMKIT_PLAT, 2_28; OFF links plainly, as inside the manylinux
# image itself) makes common/cmake/CommkitGlibcCompat.cmake link against stub glibc libraries of that
# version and libstdc++ statically, and fail the build on a glibc symbol newer than the target.
# Settings: PYTHONS (interpreters or versions, default 3.10 3.11 3.12 3.13 from ~/.pyenv or PATH),
# CUDAARCHS (default "90a;100a"), COMMKIT_BUILD_CUDA (default ON), COMMKIT_PLAT (target tag, default
# manylinux_2_28_x86_64), COMMKIT_MANYLINUX, RELEASE_NCCL (the NCCL headers elastic_ep compiles
# against, default nvidia-nccl-cu13==2.30.7, the one torch 2.14.1 brings; the wheel then runs on the NCCL
# loaded at run time from 2.28.9 on, as elastic_ep's README says; NCCL_HOME overrides),
# RELEASE_TESTS=0 skips the CPU tests, OUT_DIR (default dist).
# Exit status: 0 everything passed; 3 the wheels passed but need a newer manylinux policy than
# COMMKIT_PLAT (they are tagged with the one they meet); 1 a build, check, install or test failed.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
ALL="fp8_layerwise ipc_all2all elastic_ep"
[ $# = 1 ] || { echo "usage: bash tools/release.sh <package>|all   (packages: $ALL)" >&2; exit 2; }
PKGS=$1
[ "$PKGS" = all ] && PKGS=$ALL
for pkg in $PKGS; do
  [ -f "$ROOT/packages/$pkg/pyproject.toml" ] || { echo "unknown package '$pkg' (all, ${ALL// /, })" >&2; exit 2; }
done
OUT=$(mkdir -p "${OUT_DIR:-$ROOT/dist}" && cd "${OUT_DIR:-$ROOT/dist}" && pwd)
WORK=$OUT/.work
mkdir -p "$WORK/logs"
export COMMKIT_BUILD_CUDA=${COMMKIT_BUILD_CUDA:-ON} CUDAARCHS=${CUDAARCHS:-90a;100a} COMMKIT_RELOCATABLE=ON
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} PIP_DISABLE_PIP_VERSION_CHECK=1
PLAT=${COMMKIT_PLAT:-manylinux_2_28_x86_64}
if [ -z "${COMMKIT_MANYLINUX:-}" ] && [[ $PLAT =~ ^manylinux_([0-9]+_[0-9]+)_ ]]; then
  COMMKIT_MANYLINUX=${BASH_REMATCH[1]}
fi
export COMMKIT_MANYLINUX=${COMMKIT_MANYLINUX:-OFF}
LINKED="linked for glibc ${COMMKIT_MANYLINUX/_/.}"
[ "$COMMKIT_MANYLINUX" = OFF ] && LINKED="linked plainly"
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0+cpu}
RELEASE_NCCL=${RELEASE_NCCL:-nvidia-nccl-cu13==2.30.7}
if [ -z "${CUDACXX:-}" ] && ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
SUMMARY=$OUT/release-summary.md
STATUS=0
log() { echo "[release] $*"; }
bad() { echo "[release] FAILED: $*" >&2; STATUS=1; }

# The interpreter of a version ("3.12" -> ~/.pyenv/versions/3.12.*/bin/python, else python3.12).
find_python() {
  local v=$1 p
  if [ -x "$v" ]; then echo "$v"; return; fi
  for p in "$HOME"/.pyenv/versions/"$v".*/bin/python; do
    [ -x "$p" ] && { echo "$p"; return; }
  done
  command -v "python$v" || { echo "[release] no Python $v (set PYTHONS)" >&2; exit 1; }
}

# BUILD_VENV: a virtual environment with the build tools for interpreter $1 (made once, reused).
build_venv() {
  local py=$1 tag
  tag=$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  BUILD_VENV=$WORK/build-$tag
  if ! "$BUILD_VENV/bin/python" -c 'import scikit_build_core, pybind11, build' 2>/dev/null; then
    rm -rf "$BUILD_VENV"
    "$py" -m venv "$BUILD_VENV"
    "$BUILD_VENV/bin/pip" install -q "scikit-build-core>=1.0" "pybind11>=2.12" cmake ninja build \
      >"$WORK/logs/venv-$tag.log" 2>&1 \
      || { tail -20 "$WORK/logs/venv-$tag.log" >&2; echo "[release] could not set up $BUILD_VENV" >&2; exit 1; }
  fi
}

# NCCL_DIR: NCCL's headers and library for elastic_ep's CUDA build, NCCL_HOME or RELEASE_NCCL (installed
# once with interpreter $1).
nccl_home() {
  if [ -n "${NCCL_HOME:-}" ]; then NCCL_DIR=$NCCL_HOME; return; fi
  local dir=$WORK/nccl/${RELEASE_NCCL//[^A-Za-z0-9.]/_}
  if [ ! -f "$dir/nvidia/nccl/include/nccl.h" ]; then
    rm -rf "$dir"
    "$1" -m pip install -q --no-deps --target "$dir" "$RELEASE_NCCL" >"$WORK/logs/nccl.log" 2>&1 \
      || { tail -20 "$WORK/logs/nccl.log" >&2; echo "[release] could not get $RELEASE_NCCL (set RELEASE_NCCL or NCCL_HOME)" >&2; exit 1; }
  fi
  NCCL_DIR=$dir/nvidia/nccl
}

# Installs wheel $2 into a fresh venv of interpreter $1 and imports it; $3 = package, $4 = version.
# Prints what was checked (the summary's last columns); non-zero when something failed.
install_and_import() {
  local py=$1 whl=$2 pkg=$3 ver=$4 tag venv torch="no torch" extra=()
  tag=$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  venv=$WORK/test-$pkg-$tag
  rm -rf "$venv"
  "$py" -m venv "$venv"
  local ilog=$WORK/logs/install-$pkg-$tag.log
  [ "$pkg" = elastic_ep ] && extra=("nvidia-nccl-cu13>=2.28.9")
  if "$venv/bin/pip" install -q "$TORCH_SPEC" >"$ilog" 2>&1; then
    torch=$("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)')
    "$venv/bin/pip" install -q "$whl" "${extra[@]}" >>"$ilog" 2>&1 || { tail -20 "$ilog" >&2; return 1; }
  else
    "$venv/bin/pip" install -q --no-deps "$whl" >>"$ilog" 2>&1 || { tail -20 "$ilog" >&2; return 1; }
    [ ${#extra[@]} = 0 ] || "$venv/bin/pip" install -q "${extra[@]}" >>"$ilog" 2>&1 || { tail -20 "$ilog" >&2; return 1; }
  fi
  # From an empty folder and without PYTHONPATH (a development shell's may name the source trees), so
  # the package cannot come from the checkout.
  mkdir -p "$WORK/empty"
  (cd "$WORK/empty" && env -u PYTHONPATH "$venv/bin/python" - "$pkg" "$ver" "$venv" <<'PY') >"$WORK/logs/import-$pkg-$tag.log" 2>&1 \
    || { cat "$WORK/logs/import-$pkg-$tag.log" >&2; return 1; }
import glob, importlib, importlib.metadata as md, importlib.util, os, sys
pkg, ver, venv = sys.argv[1:]
dist = pkg.replace("_", "-")
assert md.version(dist) == ver, f"installed {dist} is {md.version(dist)}, the sdist says {ver}"
if importlib.util.find_spec("torch") is not None:
    m = importlib.import_module(pkg)
    assert m.__version__ == ver, f"{pkg}.__version__ is {m.__version__!r}, not {ver!r}"
    assert os.path.realpath(m.__file__).startswith(os.path.realpath(venv) + "/"), m.__file__
    c = m._C
    print(f"import {pkg}", end="")
else:  # the extension alone: every package's __init__ imports torch
    site = os.path.dirname(importlib.util.find_spec("pip").submodule_search_locations[0])
    (so,) = glob.glob(os.path.join(site, pkg, "_C.*.so"))
    spec = importlib.util.spec_from_file_location(f"{pkg}._C", so)
    c = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(c)
    print(f"load {pkg}._C (torch-free)", end="")
print(f", built_with_cuda={c.built_with_cuda()}")
PY
  echo "$torch; $(tail -1 "$WORK/logs/import-$pkg-$tag.log")"
}

# The package's CPU tests from the repository, against the wheel installed in venv $1.
cpu_tests() {
  local venv=$1 pkg=$2 tag=$3 tlog=$WORK/logs/tests-$2-$3.log
  "$venv/bin/pip" install -q pytest pytest-timeout numpy matplotlib >"$tlog" 2>&1 || { tail -20 "$tlog" >&2; return 1; }
  # The repository root is on sys.path for tests/ and tools/ only: packages/<pkg>/src is not, so the
  # tests import the installed wheel (the first line of the log says from where).
  (cd "$ROOT" && env -u PYTHONPATH "$venv/bin/python" -c "import $pkg; print('testing', $pkg.__file__)" \
    && env -u PYTHONPATH "$venv/bin/python" -m pytest "tests/$pkg" -q -p no:cacheprovider -m "not gpu and not multigpu" \
         --timeout=600) >>"$tlog" 2>&1
  local rc=$?
  grep -E "passed|failed|error" "$tlog" | tail -1
  return $rc
}

# sdist -> one wheel per Python -> check + retag -> install + import (+ CPU tests on cp311).
release_package() {
  local pkg=$1 first_venv sdist ver src t0 secs raw whl tag res checked rc venv
  build_venv "${PYS[0]}"
  first_venv=$BUILD_VENV
  log "$pkg: sdist"
  rm -f "$OUT/$pkg"-*.tar.gz "$OUT/$pkg"-*.whl
  "$first_venv/bin/python" -m build --sdist --no-isolation --skip-dependency-check --outdir "$OUT" "$ROOT/packages/$pkg" \
    >"$WORK/logs/sdist-$pkg.log" 2>&1 || { tail -20 "$WORK/logs/sdist-$pkg.log" >&2; bad "$pkg sdist"; return; }
  sdist=$(ls "$OUT/$pkg"-*.tar.gz)
  ver=$(basename "$sdist" .tar.gz); ver=${ver##*-}
  "$first_venv/bin/python" "$ROOT/tools/wheelcheck.py" "$sdist" | sed 's/^/  /' || { bad "$pkg sdist check"; return; }
  # Every wheel is built from the unpacked sdist, as pip would build it on a user's machine.
  src=$WORK/src/$pkg-$ver
  rm -rf "$src" "$WORK/raw/$pkg"; mkdir -p "$WORK/src" "$WORK/raw/$pkg"
  tar xzf "$sdist" -C "$WORK/src"
  local env_nccl=()
  if [ "$pkg" = elastic_ep ]; then
    nccl_home "$first_venv/bin/python"
    env_nccl=("NCCL_HOME=$NCCL_DIR")
  fi
  for py in "${PYS[@]}"; do
    build_venv "$py"
    venv=$BUILD_VENV
    tag=$(basename "$venv"); tag=${tag#build-}
    log "$pkg $tag: wheel (CUDA $COMMKIT_BUILD_CUDA, architectures $CUDAARCHS)"
    t0=$(date +%s)
    if ! env "${env_nccl[@]}" PATH="$venv/bin:$PATH" "$venv/bin/pip" wheel -v --no-build-isolation --no-deps \
         -w "$WORK/raw/$pkg" "$src" >"$WORK/logs/build-$pkg-$tag.log" 2>&1; then
      tail -30 "$WORK/logs/build-$pkg-$tag.log" >&2; bad "$pkg $tag build"; continue
    fi
    secs=$(( $(date +%s) - t0 ))
    raw=$(ls "$WORK/raw/$pkg"/*-"$tag"-*linux_x86_64.whl)
    set +e
    res=$("$venv/bin/python" "$ROOT/tools/wheelcheck.py" "$raw" --plat "$PLAT" --allow-lower --retag "$OUT")
    rc=$?
    set -e
    echo "$res" | sed 's/^/  /'
    [ $rc = 1 ] && { bad "$pkg $tag wheel check"; continue; }
    [ $rc = 3 ] && [ $STATUS = 0 ] && STATUS=3
    whl=$(echo "$res" | sed -n 's/^  retagged: //p')
    checked="checks passed, $(echo "$whl" | grep -oE 'manylinux_[0-9_]+x86_64')"
    if ! res=$(install_and_import "$py" "$whl" "$pkg" "$ver"); then bad "$pkg $tag install/import"; continue; fi
    if [ "$tag" = cp311 ] && [ "${RELEASE_TESTS:-1}" != 0 ]; then
      local tests
      if tests=$(cpu_tests "$WORK/test-$pkg-$tag" "$pkg" "$tag"); then res="$res; CPU tests: $tests"
      else bad "$pkg $tag CPU tests ($WORK/logs/tests-$pkg-$tag.log)"; res="$res; CPU tests FAILED: $tests"; fi
    fi
    echo "| $pkg | $tag | $(basename "$whl") | $(( $(stat -c %s "$whl") / 1024 )) KiB | $secs s | $checked | $res |" >>"$SUMMARY"
    log "$pkg $tag: built in $secs s; $res"
  done
  echo "| $pkg | sdist | $(basename "$sdist") | $(( $(stat -c %s "$sdist") / 1024 )) KiB | | checks passed | |" >>"$SUMMARY"
}

PYS=()
for v in ${PYTHONS:-3.10 3.11 3.12 3.13}; do PYS+=("$(find_python "$v")"); done
{
  echo "# Release build $(date -u +%Y-%m-%dT%H:%MZ), git $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo
  echo "CUDA $COMMKIT_BUILD_CUDA ($(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p')), architectures $CUDAARCHS; target $PLAT ($LINKED on glibc $(ldd --version 2>/dev/null | sed -n '1s/.* //p')); elastic_ep against ${NCCL_HOME:-$RELEASE_NCCL}; tests with $TORCH_SPEC where installable"
  echo
  echo "| package | python | file | size | build | check | install + import |"
  echo "|---|---|---|---|---|---|---|"
} >"$SUMMARY"
T0=$(date +%s)
for pkg in $PKGS; do
  P0=$(date +%s)
  release_package "$pkg"
  log "$pkg: done in $(( $(date +%s) - P0 )) s"
  echo "| $pkg | all | | | $(( $(date +%s) - P0 )) s in all | | |" >>"$SUMMARY"
done
echo >>"$SUMMARY"
case $STATUS in
  0) echo "Passed in $(( $(date +%s) - T0 )) s." >>"$SUMMARY" ;;
  3) echo "Built and passed in $(( $(date +%s) - T0 )) s, but not for $PLAT: the wheels are tagged with the policy they meet (the check lines above name the symbols: give them a fallback in common/cmake/commkit_glibc_compat.cpp, or build inside the manylinux image for $PLAT)." >>"$SUMMARY" ;;
  *) echo "FAILED (see the messages above and $WORK/logs)." >>"$SUMMARY" ;;
esac
cat "$SUMMARY"
exit $STATUS
