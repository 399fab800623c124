#!/usr/bin/env bash
# elastic_ep's NCCL compatibility matrix, with the real libraries of NVIDIA's wheels (CI runs it after the
# tests; no GPU needed):
#   1. builds elastic_ep's extension against the headers of each NCCL of NCCL_MATRIX (CUDA on, kernels
#      for NCCL_MATRIX_CUDAARCHS only, run path $ORIGIN-relative as in the release wheels; no torch);
#   2. checks that every NCCL function a build links is exported by the floor's libnccl.so.2
#      (`nm -D`): newer ones must be looked up at run time, or the wheel fails to load on the floor;
#   3. loads each build's _C (RTLD_NOW, as Python imports: an undefined symbol fails) with each NCCL of
#      the matrix, found through the run path $ORIGIN/../nvidia/nccl/lib of a site-packages-like folder
#      (LD_LIBRARY_PATH and LD_PRELOAD cleared: either would win over that run path), checks from
#      /proc/self/maps and _C.nccl_version() that the intended library is the one loaded, and asks
#      _C.devcomm_abi(loaded) what the package's import check decides on: a build against 2.29+ headers
#      must serve every NCCL of the matrix; one against 2.28.x headers is refused by design on 2.29+;
#   4. loads each build once more with the floor's library in LD_PRELOAD and the run path pointing at
#      the newest: the library already loaded wins, as torch's does when it is imported first.
#   bash tools/nccl_matrix.sh        (work folder and logs: NCCL_MATRIX_DIR; summary: its summary.md)
# Settings: NCCL_MATRIX (pinned pip specs, nvidia-nccl-cu12 or -cu13 ==X.Y.Z; default the floor
# nvidia-nccl-cu13==2.28.9, the newest cu13 2.32.6 and cu12 2.32.3; its lowest version must be elastic_ep's
# NCCL_MIN_VERSION), NCCL_MATRIX_DIR (default build/nccl-matrix), NCCL_MATRIX_CACHE (where each NCCL
# wheel is installed once and reused, default NCCL_MATRIX_DIR/nccl), NCCL_MATRIX_CUDAARCHS (default 90a),
# PYTHON (the interpreter that builds and loads: needs scikit-build-core, pybind11 and cmake, no torch;
# default the one tools/setup_env.sh chose: COMMKIT_VENV's, else .venv's when present, else python3).
# A CUDA 13 build loading cu12's libnccl is checked for symbols and version only: each links its CUDA
# runtime statically, so they load side by side, but running the extension needs a driver for its own
# CUDA major version whatever the NCCL (the summary says so; a GPU machine checks the rest).
# NCCL_MATRIX_REQUIRED=1 makes NOT RUN a failure (where an index is expected: a mirror that lacks
# NVIDIA's packages answers as no index would).
# Exit status: 0 passed, or NOT RUN because an NCCL wheel could not be downloaded (no package index
# reachable, said on a "NOT RUN:" line); 1 an index answered without the pinned version, or a build or a
# check failed, or NOT RUN with NCCL_MATRIX_REQUIRED=1; 2 bad settings.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
log() { echo "[nccl-matrix] $*"; }
usage() { echo "[nccl-matrix] $*" >&2; exit 2; }
case "${1:-}" in
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  "") ;;
  *) usage "takes no arguments (settings are environment variables: bash $0 --help)" ;;
esac

MATRIX=${NCCL_MATRIX:-nvidia-nccl-cu13==2.28.9 nvidia-nccl-cu13==2.32.6 nvidia-nccl-cu12==2.32.3}
WORK=${NCCL_MATRIX_DIR:-$ROOT/build/nccl-matrix}
WORK=$(mkdir -p "$WORK" && cd "$WORK" && pwd)
CACHE=${NCCL_MATRIX_CACHE:-$WORK/nccl}
CACHE=$(mkdir -p "$CACHE" && cd "$CACHE" && pwd)
ARCHS=${NCCL_MATRIX_CUDAARCHS:-90a}
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -n "${COMMKIT_VENV:-}" ]; then PY=$COMMKIT_VENV/bin/python
elif [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python
else PY=python3; fi
SUMMARY=$WORK/summary.md
mkdir -p "$WORK/logs"
export PIP_DISABLE_PIP_VERSION_CHECK=1

# The settings, checked before anything is downloaded or built.
SPECS=() CODES=() LABELS=()
for spec in $MATRIX; do
  [[ $spec =~ ^nvidia-nccl-(cu1[23])==([0-9]+)\.([0-9]+)\.([0-9]+)$ ]] \
    || usage "NCCL_MATRIX entry '$spec' is not nvidia-nccl-cu12==X.Y.Z or nvidia-nccl-cu13==X.Y.Z"
  SPECS+=("$spec")
  CODES+=($(( BASH_REMATCH[2] * 10000 + BASH_REMATCH[3] * 100 + BASH_REMATCH[4] )))
  LABELS+=("${BASH_REMATCH[2]}.${BASH_REMATCH[3]}.${BASH_REMATCH[4]} ${BASH_REMATCH[1]}")
done
[ ${#SPECS[@]} -gt 0 ] || usage "NCCL_MATRIX is empty"
N=${#SPECS[@]}
FLOOR=0 NEWEST=0
for ((i = 1; i < N; i++)); do
  [ "${CODES[i]}" -lt "${CODES[FLOOR]}" ] && FLOOR=$i
  [ "${CODES[i]}" -gt "${CODES[NEWEST]}" ] && NEWEST=$i
done
MIN=$(sed -n 's/^NCCL_MIN_VERSION = \([0-9]*\).*/\1/p' "$ROOT/packages/elastic_ep/src/elastic_ep/_nccl.py")
[ -n "$MIN" ] || { echo "[nccl-matrix] no NCCL_MIN_VERSION in elastic_ep/_nccl.py" >&2; exit 1; }
[ "${CODES[FLOOR]}" = "$MIN" ] \
  || usage "NCCL_MATRIX's lowest NCCL is ${SPECS[FLOOR]}, not elastic_ep's floor (NCCL_MIN_VERSION $MIN): add it"
command -v nm >/dev/null || { echo "[nccl-matrix] needs nm (binutils)" >&2; exit 1; }
if [ -z "${CUDACXX:-}" ] && ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
"$PY" -c 'import scikit_build_core, pybind11' 2>/dev/null || {
  echo "[nccl-matrix] $PY lacks scikit-build-core or pybind11 (set PYTHON, or run tools/setup_env.sh)" >&2; exit 1; }
CUDA_VER=$(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p')
safe() { echo "${1//[^A-Za-z0-9.]/_}"; }
lib_of() { echo "$CACHE/$(safe "${SPECS[$1]}")/nvidia/nccl/lib/libnccl.so.2"; }  # matrix entry $1's library
T0=$(date +%s)
STATUS=0
bad() { echo "[nccl-matrix] FAILED: $*" >&2; STATUS=1; }

# 1. The NCCL wheels, each installed once into CACHE (into a temporary folder first, so an interrupted
# or concurrent run never leaves half a library there).
NOT_RUN=() NO_INDEX=""
NET_ERRORS="NewConnectionError|Failed to establish|Temporary failure in name resolution|Name or service not known"
NET_ERRORS+="|Network is unreachable|ConnectTimeout|ReadTimeout|ProxyError|Max retries exceeded"
fetch() {
  local spec=$1 dir flog tmp t0
  dir=$CACHE/$(safe "$spec")
  if [ -f "$dir/nvidia/nccl/include/nccl.h" ] && [ -f "$dir/nvidia/nccl/lib/libnccl.so.2" ]; then
    log "$spec: cached"; return
  fi
  if [ -n "$NO_INDEX" ]; then NOT_RUN+=("$spec ($NO_INDEX)"); return; fi
  flog=$WORK/logs/fetch-$(safe "$spec").log
  tmp=$(mktemp -d "$CACHE/.fetch.XXXXXX")
  log "$spec: downloading"
  t0=$(date +%s)
  # Few retries and a short timeout: on a machine without network each retry would wait in vain.
  if "$PY" -m pip install --no-deps --retries 1 --timeout 30 --target "$tmp" "$spec" >"$flog" 2>&1 \
     && [ -f "$tmp/nvidia/nccl/lib/libnccl.so.2" ]; then
    rm -rf "$dir" && mv "$tmp" "$dir"
    log "$spec: installed in $(( $(date +%s) - t0 )) s"; return
  fi
  rm -rf "$tmp"
  # The names are NVIDIA's (checked above), so an index that sees no version of them at all is none;
  # one that lists other versions but not this one answered: the spec is wrong, unless pip also failed
  # to reach another index (an offline machine's local mirror).
  if grep -q "(from versions: none)" "$flog"; then
    NO_INDEX="no package index"
  elif grep -qE "$NET_ERRORS" "$flog"; then
    NO_INDEX="no package index: unreachable"
  else
    tail -5 "$flog" >&2; bad "could not install $spec (log: $flog)"; return
  fi
  NOT_RUN+=("$spec ($NO_INDEX)")
}
for spec in "${SPECS[@]}"; do fetch "$spec"; done
if [ ${#NOT_RUN[@]} -gt 0 ]; then
  for what in "${NOT_RUN[@]}"; do echo "[nccl-matrix] NOT RUN: could not download $what"; done
  log "the matrix needs every NCCL of NCCL_MATRIX: give pip an index, or set NCCL_MATRIX_CACHE to a folder"
  log "where a run with one installed them"
  # A mirror without NVIDIA's packages reads as no index too: where one is expected, NOT RUN is a failure.
  if [ "${NCCL_MATRIX_REQUIRED:-0}" = 1 ]; then log "NCCL_MATRIX_REQUIRED=1: failing"; exit 1; fi
  exit $STATUS
fi
[ $STATUS = 0 ] || exit 1

# 2. One build per NCCL's headers, into its own folder (never the checkout's packages/*/build).
SOS=() TIMES=() LINKS=()
build() {
  local i=$1 spec=${SPECS[$1]} name blog t0 so
  name=$(safe "$spec")
  blog=$WORK/logs/build-$name.log
  rm -rf "$WORK/ext/$name"
  log "$spec: building elastic_ep (sm_$ARCHS)"
  local again=""  # a kept work folder rebuilds incrementally: its time says so
  [ -f "$WORK/build/$name/CMakeCache.txt" ] && again=" (incremental)"
  t0=$(date +%s)
  if ! env NCCL_HOME="$CACHE/$name/nvidia/nccl" CUDAARCHS="$ARCHS" COMMKIT_BUILD_CUDA=ON COMMKIT_RELOCATABLE=ON \
       COMMKIT_MANYLINUX=OFF "$PY" -m pip install -v --no-build-isolation --no-deps --target "$WORK/ext/$name" \
       -C "build-dir=$WORK/build/$name" "$ROOT/packages/elastic_ep" >"$blog" 2>&1; then
    tail -30 "$blog" >&2; bad "$spec: build (log: $blog)"; return
  fi
  TIMES[i]="$(( $(date +%s) - t0 )) s$again"
  so=$(ls "$WORK/ext/$name"/elastic_ep/_C.*.so 2>/dev/null | head -1) || true
  if [ -z "$so" ]; then bad "$spec: the build installed no elastic_ep/_C.*.so (log: $blog)"; return; fi
  SOS[i]=$so
  log "$spec: built in ${TIMES[i]}"
  # Every NCCL function the build links must be one the floor exports.
  local used missing
  used=$(nm -D --undefined-only "$so" | awk '{print $NF}' | sed 's/@.*//' | grep '^nccl' | LC_ALL=C sort -u || true)
  missing=$(LC_ALL=C comm -23 <(echo "$used") \
            <(nm -D --defined-only "$(lib_of "$FLOOR")" | awk '{print $NF}' | sed 's/@.*//' | LC_ALL=C sort -u))
  if [ -z "$used" ]; then
    LINKS[i]="FAILED: links no NCCL function"; bad "$spec: the build links no NCCL (not a CUDA build?)"
  elif [ -n "$missing" ]; then
    missing=$(echo $missing)
    LINKS[i]="FAILED: not in ${LABELS[FLOOR]}: $missing"; bad "$spec: links NCCL functions the floor lacks: $missing"
  else
    LINKS[i]="$(echo "$used" | wc -l) functions, all in ${LABELS[FLOOR]}"
  fi
}

# 3./4. Loads build $1's _C from a site-packages-like folder whose nvidia/ is NCCL $2's, with LD_PRELOAD
# $3 (may be empty) and the library of NCCL $4 expected; prints the summary cell, non-zero on failure.
probe() {
  local b=$1 l=$2 pre=$3 want=$4 site out rc=0 env_pre=()
  site=$WORK/site/$(safe "${SPECS[b]}")/$(safe "${SPECS[l]}")
  rm -rf "$site"; mkdir -p "$site/elastic_ep"
  ln -f "${SOS[b]}" "$site/elastic_ep/" 2>/dev/null || cp "${SOS[b]}" "$site/elastic_ep/"
  ln -s "$CACHE/$(safe "${SPECS[l]}")/nvidia" "$site/nvidia"
  [ -n "$pre" ] && env_pre=("LD_PRELOAD=$pre")
  out=$(cd "$WORK" && env -u LD_LIBRARY_PATH -u LD_PRELOAD -u PYTHONPATH ${env_pre[@]+"${env_pre[@]}"} "$PY" "$WORK/probe.py" \
        "$site/elastic_ep/$(basename "${SOS[b]}")" "$(lib_of "$want")" "${CODES[want]}" 2>&1) || rc=$?
  if [ $rc != 0 ]; then echo "FAILED: $(echo "$out" | tail -1)"; return 1; fi
  local built got abi gin
  read -r built got abi gin <<<"$(echo "$out" | tail -1)"
  if [ "$built" != "${CODES[b]}" ]; then echo "FAILED: built against $built, not ${CODES[b]}"; return 1; fi
  if [ "$abi" = unsupported ]; then
    # The package's import check refuses this pair; by design only for 2.28.x headers on a 2.29+ library
    # (2.29 put a version header in front of the device-API structures).
    if [ "$built" -lt 22900 ] && [ "$got" -ge 22900 ]; then
      echo "loads; import refuses by design (rebuild with 2.29+ headers)"; return 0
    fi
    echo "FAILED: devcomm_abi($got) = unsupported"; return 1
  fi
  echo "ok: $abi, GIN $gin"
}

# What probe() runs in a fresh process: prints "build_code loaded_code abi gin_abi"; exit 1 when _C does
# not load, 2 when another libnccl than the expected one was loaded.
cat >"$WORK/probe.py" <<'PY'
import importlib.util, os, sys
so, want_lib, want_code = sys.argv[1], os.path.realpath(sys.argv[2]), int(sys.argv[3])
spec = importlib.util.spec_from_file_location("elastic_ep._C", so)
try:
    c = importlib.util.module_from_spec(spec)  # dlopen with RTLD_NOW: every undefined symbol resolved now
    spec.loader.exec_module(c)
except ImportError as e:
    print("import failed:", str(e).replace(so + ": ", ""))
    sys.exit(1)
if not c.built_with_cuda():
    print("not a CUDA build")
    sys.exit(1)
libs = set()
for line in open("/proc/self/maps"):
    parts = line.split(maxsplit=5)
    if len(parts) == 6 and os.path.basename(parts[5].strip()) == "libnccl.so.2":
        libs.add(parts[5].strip())
loaded = c.nccl_version()
print(f"{c.nccl_build_version()} {loaded} {c.devcomm_abi(loaded, False)} {c.devcomm_abi(loaded, True)}")
if libs != {want_lib} or loaded != want_code:
    print(f"loaded {sorted(libs)} (NCCL {loaded}), not {want_lib} ({want_code})")
    sys.exit(2)
PY

for ((i = 0; i < N; i++)); do build "$i"; done
declare -A CELL
for ((b = 0; b < N; b++)); do
  [ -n "${SOS[b]:-}" ] || continue
  for ((l = 0; l < N; l++)); do
    CELL[$b,$l]=$(probe "$b" "$l" "" "$l") \
      || bad "${SPECS[b]} build with ${SPECS[l]}'s library: ${CELL[$b,$l]#FAILED: }"
    log "${SPECS[b]} build, ${LABELS[l]} loaded: ${CELL[$b,$l]}"
  done
  CELL[$b,pre]=$(probe "$b" "$NEWEST" "$(lib_of "$FLOOR")" "$FLOOR") \
    || bad "${SPECS[b]} build with ${SPECS[FLOOR]} preloaded: ${CELL[$b,pre]#FAILED: }"
  log "${SPECS[b]} build, ${LABELS[FLOOR]} preloaded over ${LABELS[NEWEST]}'s run path: ${CELL[$b,pre]}"
done

# The summary: one row per build, one column per loaded library.
{
  echo "# elastic_ep NCCL matrix $(date -u +%Y-%m-%dT%H:%MZ), git $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo
  echo "CUDA $CUDA_VER, sm_$ARCHS, $("$PY" -c 'import sys; print("python", sys.version.split()[0])'); a cell is"
  echo "_C.devcomm_abi(loaded, use_gin=False), then GIN: its use_gin=True answer."
  echo
  head="| build against | build time | NCCL functions linked |"
  rule="|---|---|---|"
  for ((l = 0; l < N; l++)); do head+=" ${LABELS[l]} loaded |"; rule+="---|"; done
  echo "$head ${LABELS[FLOOR]} preloaded |"
  echo "$rule---|"
  for ((b = 0; b < N; b++)); do
    row="| ${SPECS[b]} | ${TIMES[b]:-FAILED} | ${LINKS[b]:-} |"
    for ((l = 0; l < N; l++)); do row+=" ${CELL[$b,$l]:-} |"; done
    echo "$row ${CELL[$b,pre]:-} |"
  done
  echo
  for ((l = 0; l < N; l++)); do
    [[ ${SPECS[l]} == nvidia-nccl-cu12* ]] || continue
    echo "${SPECS[l]}'s library loads into these CUDA ${CUDA_VER%%.*} builds (each links its CUDA runtime"
    echo "statically); running them still needs a driver for CUDA ${CUDA_VER%%.*}, whatever the NCCL: not checked here."
    break
  done
  if [ $STATUS = 0 ]; then echo "Passed in $(( $(date +%s) - T0 )) s."
  else echo "FAILED in $(( $(date +%s) - T0 )) s (see the messages above and $WORK/logs)."; fi
} >"$SUMMARY"
cat "$SUMMARY"
exit $STATUS
