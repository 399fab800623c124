#!/usr/bin/env bash
# The one command on a GPU machine (H100/H200): build the packages, then run one preset; logs, junit XML, JSON and
# plots land in OUT_DIR.
#
#   bash tools/gpu.sh OUT_DIR [PRESET] [package=NAME[,NAME..]] [OPTIONS] [-- ARGS..]
#
# PRESET
#   smoke   (default) the GPU tests marked `smoke` of each package, a few minutes on one GPU:
#           pytest tests/<pkg> -m "smoke and (gpu or multigpu)"
#   full    every GPU test of each package: pytest tests/<pkg> -m "gpu or multigpu"
#   faults  the GPU part of the fault-injection suite (tests marked `fault`: a rank with other arguments,
#           dead, late or interrupted, a corrupted or forged word or handle):
#           pytest tests/<pkg> -m "fault and (gpu or multigpu)", then its counts per package (faults
#           injected, detected, failed, detection times): python tools/fault_report.py OUT_DIR/junit_*.xml
#           --out OUT_DIR/faults.json (also in OUT_DIR/report_faults.log). The CPU part runs with
#           pytest -m "fault and not (gpu or multigpu)" (and in CI with every other CPU test)
#   bench   the benchmarks, then the model blocks: python tools/bench_<pkg>.py --out OUT_DIR [--quick],
#           then python tools/block_<pkg>.py --out OUT_DIR/block_<pkg> (each package's model block against
#           its baseline: ipc_all2all's Ulysses attention, elastic_ep's DeepSeek-V3 MoE layer, fp8_layerwise's
#           prefill loop); ends with the blocks' tables, gathered in OUT_DIR/blocks.md
#   blocks  the model blocks only
# OPTIONS
#           (--preset NAME is the same as NAME)
#   package=NAMES, --only NAMES   comma-separated, from: fp8_layerwise ipc_all2all elastic_ep
#                 (default: all three, in that order)
#   --no-build    use the installed packages (an earlier call on the same machine built them)
#   --quick       bench only: the benchmarks' short runs
#   --timeout S   limit of each test suite and each benchmark in seconds (default 540, which fits
#                 with the build in a 10-minute call; 0: no limit). Each test also has pytest.ini's.
#   --dry-run     print the settings and the commands; build, run and write nothing
#   -- ARGS       passed on to pytest (smoke, full, faults) or to each benchmark script (bench)
#
# What it does, in order:
#  * sources tools/env.sh (NVLink multicast off) and sets, unless already set: COMMKIT_REQUIRE_GPU=1
#    (no usable GPU, or a GPU test skipping for anything but too few devices, fails: tests/conftest.py),
#    COMMKIT_TEST_SHARE_GPU=1 (tests marked multigpu(n, shared_ok=True) run on fewer than n GPUs with
#    ranks sharing them, correctness only; with enough GPUs nothing changes), COMMKIT_GIT_REV (the
#    revision results record; the device's copy of the tree has no .git, so pass it there),
#    COMMKIT_BUILD_CUDA=ON, CUDAARCHS=90a; PYTHON picks the interpreter (default python3);
#  * installs wheels found in .whl/ (e.g. a newer scikit-build-core) to a private path;
#  * writes OUT_DIR/env.txt (machine, GPUs, driver, python, torch, NCCL, build tools, settings);
#  * builds the chosen packages in parallel (pip --no-build-isolation --no-deps, log build_<pkg>.log);
#  * runs each suite or benchmark from /tmp (so the installed packages are imported, not the
#    sources): tests_<pkg>.log + junit_<pkg>.xml, or bench_<pkg>.log + the benchmark's own files;
#  * prints a summary (also OUT_DIR/summary.txt) and exits non-zero if a build, a test suite or a
#    benchmark failed or ran out of time (2 for a usage error).
# The full preset on one GPU takes longer than one 10-minute call: split it by package, e.g.
#   bash tools/gpu.sh OUT full package=elastic_ep
#   bash tools/gpu.sh OUT full package=ipc_all2all,fp8_layerwise --no-build
set -u
ALL_PKGS=(fp8_layerwise ipc_all2all elastic_ep)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PROG="tools/gpu.sh"

usage() {
  sed -n '2,/^set -u$/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
}
die() {  # a usage error: the message, the usage line, exit 2
  echo "$PROG: $*" >&2
  echo "usage: bash $PROG OUT_DIR [smoke|full|faults|bench|blocks] [package=NAME[,NAME..]] [--no-build] [--quick]" \
       "[--timeout S] [--dry-run] [-- ARGS..]   (--help for more)" >&2
  exit 2
}

case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  "") die "OUT_DIR is missing" ;;
  -*) die "the first argument is OUT_DIR, got option $1" ;;
  smoke|full|faults|bench|blocks|package=*) die "the first argument is OUT_DIR, got '$1' (bash $PROG OUT_DIR $1 ...)" ;;
esac
OUT=$1
shift
case "$OUT" in /*) ;; *) OUT="$PWD/$OUT" ;; esac  # absolute: the suites run from /tmp

PRESET="" PKGS=() BUILD=1 QUICK=0 TIMEOUT=540 DRY=0 ARGS=()
set_pkgs() {  # set_pkgs WHERE LIST: the comma-separated package list given by WHERE
  local where=$1 list=$2 name known
  [ -n "$list" ] || die "$where: no package named (choose from: ${ALL_PKGS[*]})"
  PKGS=()
  IFS=',' read -r -a names <<< "$list"
  for name in "${names[@]}"; do
    known=0
    for k in "${ALL_PKGS[@]}"; do [ "$k" = "$name" ] && known=1; done
    [ "$known" = 1 ] || die "$where: unknown package '$name' (choose from: ${ALL_PKGS[*]})"
    [[ " ${PKGS[*]} " == *" $name "* ]] || PKGS+=("$name")
  done
}
while [ $# -gt 0 ]; do
  case "$1" in
    smoke|full|faults|bench|blocks)
      [ -z "$PRESET" ] || die "two presets given: $PRESET and $1"
      PRESET=$1; shift ;;
    --preset=*) set -- "${1#--preset=}" "${@:2}" ;;  # the same as the bare preset name
    --preset) [ $# -ge 2 ] || die "--preset needs smoke, full, faults, bench or blocks"
      case "$2" in smoke|full|faults|bench|blocks) ;; *) die "--preset: unknown preset '$2' (smoke, full, faults, bench or blocks)" ;; esac
      shift ;;
    package=*) set_pkgs "package=" "${1#package=}"; shift ;;
    --only=*) set_pkgs "--only" "${1#--only=}"; shift ;;
    --only) [ $# -ge 2 ] || die "--only needs a package list"; set_pkgs "--only" "$2"; shift 2 ;;
    --no-build) BUILD=0; shift ;;
    --quick) QUICK=1; shift ;;
    --timeout=*) TIMEOUT=${1#--timeout=}; shift ;;
    --timeout) [ $# -ge 2 ] || die "--timeout needs a number of seconds"; TIMEOUT=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; ARGS=("$@"); break ;;
    *) die "unknown argument '$1'" ;;
  esac
done
PRESET=${PRESET:-smoke}
[ ${#PKGS[@]} -gt 0 ] || PKGS=("${ALL_PKGS[@]}")
[[ "$TIMEOUT" =~ ^[0-9]+$ ]] || die "--timeout: expected whole seconds >= 0, got '$TIMEOUT'"
[ "$QUICK" = 0 ] || [ "$PRESET" = bench ] || die "--quick applies to the bench preset only"
case "$PRESET" in
  smoke) MARK="smoke and (gpu or multigpu)" ;;
  full) MARK="gpu or multigpu" ;;
  faults) MARK="fault and (gpu or multigpu)" ;;
  bench|blocks) MARK="" ;;
esac

# --- environment ------------------------------------------------------------------------------
# shellcheck source=tools/env.sh
source "$ROOT/tools/env.sh"
export COMMKIT_REQUIRE_GPU=${COMMKIT_REQUIRE_GPU:-1}
export COMMKIT_TEST_SHARE_GPU=${COMMKIT_TEST_SHARE_GPU:-1}
if [ -z "${COMMKIT_GIT_REV:-}" ]; then
  COMMKIT_GIT_REV=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
  if [ "$COMMKIT_GIT_REV" != unknown ] && [ -n "$(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null)" ]; then
    COMMKIT_GIT_REV="$COMMKIT_GIT_REV-dirty"
  fi
fi
export COMMKIT_GIT_REV
export PYTHONUNBUFFERED=1 COMMKIT_BUILD_CUDA=${COMMKIT_BUILD_CUDA:-ON} CUDAARCHS=${CUDAARCHS:-90a}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
PY=${PYTHON:-python3}
case "$PY" in /*|"") ;; */*) PY="$PWD/$PY" ;; esac  # a relative path must survive the cd to /tmp

show() {  # print a command line, quoting only the words that need it
  local line="+" a
  for a in "$@"; do
    if [[ "$a" =~ ^[A-Za-z0-9_./=:,+@%-]+$ ]]; then line+=" $a"; else line+=" ${a@Q}"; fi
  done
  echo "$line"
}
settings() {
  echo "preset $PRESET, packages ${PKGS[*]}, build $([ "$BUILD" = 1 ] && echo yes || echo no)," \
       "limit per suite $([ "$TIMEOUT" = 0 ] && echo none || echo "${TIMEOUT} s")"
  echo "out $OUT"
  local v
  for v in $(sed -n 's/^export \([A-Za-z0-9_]*\)=.*/\1/p' "$ROOT/tools/env.sh") COMMKIT_REQUIRE_GPU \
           COMMKIT_TEST_SHARE_GPU COMMKIT_GIT_REV COMMKIT_BUILD_CUDA CUDAARCHS CMAKE_BUILD_PARALLEL_LEVEL; do
    echo "$v=${!v}"
  done
}
share_note() {  # share_note NGPU
  if [ "$COMMKIT_TEST_SHARE_GPU" != 0 ] && [ -n "$COMMKIT_TEST_SHARE_GPU" ]; then
    echo "$1 GPU(s), COMMKIT_TEST_SHARE_GPU=$COMMKIT_TEST_SHARE_GPU: tests marked multigpu(n, shared_ok=True)" \
         "with more ranks than GPUs run with ranks sharing a GPU (correctness only); other tests needing" \
         "more GPUs skip"
  else
    echo "$1 GPU(s), COMMKIT_TEST_SHARE_GPU=0: tests needing more GPUs than that skip"
  fi
}

if [ "$DRY" = 1 ]; then
  echo "$PROG: dry run, nothing is built, run or written"
  settings
  if command -v nvidia-smi >/dev/null 2>&1; then share_note "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')"
  else share_note "?"; fi
else
  mkdir -p "$OUT" || die "cannot create OUT_DIR $OUT"
fi

if ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
  whl=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade
       --target /tmp/commkit-site "$ROOT"/.whl/*.whl)
  if [ "$DRY" = 1 ]; then
    show "${whl[@]}"
  elif "${whl[@]}"; then
    export PYTHONPATH=/tmp/commkit-site${PYTHONPATH:+:$PYTHONPATH}
  fi
fi

if [ "$DRY" = 0 ]; then
  NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
  {
    date -u; hostname; echo "git $COMMKIT_GIT_REV"
    echo "command: bash $PROG $OUT $PRESET package=$(IFS=,; echo "${PKGS[*]}")$([ "$BUILD" = 0 ] && echo " --no-build")$([ "$QUICK" = 1 ] && echo " --quick")${ARGS[*]:+ -- ${ARGS[*]}}"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: none"
    "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', '.'.join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else '-', 'gpus', torch.cuda.device_count())" 2>&1
    "$PY" -c "import scikit_build_core, pybind11; print('scikit-build-core', scikit_build_core.__version__, 'pybind11', pybind11.__version__)" 2>&1
    settings
    share_note "$NGPU"
  } 2>&1 | tee "$OUT/env.txt"
fi

# --- steps ------------------------------------------------------------------------------------
rc=0
SUMMARY=()
record() {  # record WHAT PKG RC SECONDS
  local what=$1 pkg=$2 code=$3 secs=$4 verdict
  case "$code" in
    0) verdict="ok" ;;
    5) verdict="FAILED: selected no test" ;;
    124) verdict="FAILED: cut at the ${TIMEOUT} s limit" ;;
    137) verdict="FAILED: killed (the ${TIMEOUT} s limit, or out of memory)" ;;
    *) verdict="FAILED (rc $code)" ;;
  esac
  [ "$code" = 0 ] || rc=1
  SUMMARY+=("$(printf '%-6s %-14s %5s s  %s' "$what" "$pkg" "$secs" "$verdict")")
}
step() {  # step WHAT PKG CMD..: CMD from /tmp under the limit, to the console and OUT/<WHAT>_<PKG>.log
  local what=$1 pkg=$2 t0 code
  shift 2
  local cmd=("$@")
  [ "$TIMEOUT" = 0 ] || cmd=(timeout --kill-after=15 "$TIMEOUT" "${cmd[@]}")
  if [ "$DRY" = 1 ]; then
    show cd /tmp; show "${cmd[@]}"; echo "    (output: $OUT/${what}_$pkg.log)"
    return
  fi
  echo "=== $what: $pkg ($(date -u +%T)) ==="
  t0=$(date +%s)
  (cd /tmp && "${cmd[@]}") 2>&1 | tee "$OUT/${what}_$pkg.log"
  code=${PIPESTATUS[0]}
  record "$what" "$pkg" "$code" $(( $(date +%s) - t0 ))
}

RUN_PKGS=("${PKGS[@]}")
if [ "$BUILD" = 1 ]; then
  t0=$(date +%s)
  declare -A pid_of=()
  for p in "${PKGS[@]}"; do
    cmd=("$PY" -m pip install --no-build-isolation --no-deps -v "$ROOT/packages/$p")
    if [ "$DRY" = 1 ]; then
      show "${cmd[@]}"; echo "    (in parallel; output: $OUT/build_$p.log)"
    else
      "${cmd[@]}" > "$OUT/build_$p.log" 2>&1 &
      pid_of[$p]=$!
    fi
  done
  if [ "$DRY" = 0 ]; then
    RUN_PKGS=()
    for p in "${PKGS[@]}"; do
      if wait "${pid_of[$p]}"; then
        echo "built $p"; record build "$p" 0 $(( $(date +%s) - t0 )); RUN_PKGS+=("$p")
      else
        echo "BUILD FAILED: $p (its tests and benchmark do not run)"; tail -n 40 "$OUT/build_$p.log"
        record build "$p" 1 $(( $(date +%s) - t0 ))
      fi
    done
  fi
fi

for p in "${RUN_PKGS[@]}"; do
  if [ "$PRESET" = bench ] || [ "$PRESET" = blocks ]; then
    if [ "$PRESET" = bench ]; then
      bench=("$PY" "$ROOT/tools/bench_$p.py" --out "$OUT")
      [ "$QUICK" = 0 ] || bench+=(--quick)
      step bench "$p" "${bench[@]}" "${ARGS[@]}"
    fi
    step block "$p" "$PY" "$ROOT/tools/block_$p.py" --out "$OUT/block_$p"
  else
    step tests "$p" "$PY" -m pytest "$ROOT/tests/$p" -c "$ROOT/pytest.ini" --rootdir "$ROOT" -q -rfE \
      -m "$MARK" --junitxml="$OUT/junit_$p.xml" "${ARGS[@]}"
  fi
done

if [ "$PRESET" = faults ]; then
  # The suite's counts over the junit files the suites wrote (a suite cut at its limit may have none).
  xmls=()
  for p in "${RUN_PKGS[@]}"; do
    if [ "$DRY" = 1 ] || [ -f "$OUT/junit_$p.xml" ]; then xmls+=("$OUT/junit_$p.xml"); fi
  done
  [ ${#xmls[@]} = 0 ] || step report faults "$PY" "$ROOT/tools/fault_report.py" "${xmls[@]}" --out "$OUT/faults.json"
fi
[ "$DRY" = 1 ] && exit 0
if [ "$PRESET" = bench ] || [ "$PRESET" = blocks ]; then
  # The model blocks' own tables (each block writes its table, JSON and plot into OUT/block_<pkg>/).
  for p in "${RUN_PKGS[@]}"; do
    for f in "$OUT/block_$p"/*.md; do
      [ -f "$f" ] || continue
      echo "=== model block: $p ($f) ==="
      cat "$f"
    done
  done | tee "$OUT/blocks.md"
fi
{
  echo "=== $PROG $PRESET, git $COMMKIT_GIT_REV: summary ==="
  printf '%s\n' "${SUMMARY[@]}"
  echo "results in $OUT; exit status $rc"
} | tee "$OUT/summary.txt"
exit "$rc"
