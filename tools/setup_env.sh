# shellcheck shell=bash
# Sourced by tools/run.sh and tools/test.sh: idempotent set-up of a machine. It works offline when
# every requirement is already installed, and never installs a second torch over a working one.
#
# The Python environment, the first rule that applies (PYTHON, default python3, is "the interpreter"):
#   1. COMMKIT_VENV=DIR: that virtual environment; created when missing, seeing the interpreter's
#      packages (a venv's too, through a .pth file).
#   2. the interpreter's own environment, used as is, when it is a virtual environment's or a conda
#      environment's, or when it has torch and may install into its site-packages;
#   3. .venv at the repository root, when it exists;
#   4. a new .venv, created by the interpreter with --system-site-packages (so a torch in a system
#      site-packages that pip may not write to is still used).
# torch is installed only when none is importable: TORCH_SPEC if set; else torch==2.14.1 (the CUDA 13
# build, which brings NVIDIA's NCCL wheel 2.30.7 with the device-API headers elastic_ep compiles
# against) when the machine has an NVIDIA GPU (/dev/nvidia0 or nvidia-smi) or CUDA sources will be
# compiled (COMMKIT_BUILD_CUDA=ON, or AUTO with nvcc found: CI); else the CPU build torch==2.13.0+cpu
# (where PyPI has no +cpu wheels, add PyTorch's CPU index: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu).
# The other requirements (requirements-dev.txt, checked with their dependencies like `pip check`, and
# for elastic_ep an NCCL >= 2.28.9 with device-API headers: nvidia-nccl-cu13, unless NCCL_HOME or
# NCCL_ROOT names one) are looked up with importlib.metadata; pip runs only for what is missing.
# Then the packages are built into that environment with --no-build-isolation (COMMKIT_PACKAGES, default
# all three; COMMKIT_SKIP_BUILD=1 reuses what is installed): the build itself needs no torch, the tests
# and the main job do. CUDA sources are compiled for CUDAARCHS (default sm_90a) whenever nvcc is found
# (COMMKIT_BUILD_CUDA=ON makes nvcc mandatory, OFF skips them).
# One line says which environment and torch are used. Exports COMMKIT_ROOT, COMMKIT_PYTHON (the chosen
# interpreter, absolute) and PYTHON (the same, for tools/gpu.sh).
set -euo pipefail
COMMKIT_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$COMMKIT_ROOT"
source "$COMMKIT_ROOT/tools/env.sh"  # the one place of the environment settings (NVLink multicast off)
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
if [ -z "${CUDACXX:-}" ] && ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
COMMKIT_PACKAGES=${COMMKIT_PACKAGES:-fp8_layerwise ipc_all2all elastic_ep}

# Facts about an interpreter, one per line: executable, prefix, kind (venv|conda|system), writable
# (pip may install into its site-packages), torch version or "-" (no import: that costs seconds).
_ck_probe() {
  "$1" - <<'PY'
import importlib.metadata as md, importlib.util, os, sys, sysconfig
venv = sys.prefix != sys.base_prefix
conda = not venv and os.path.isdir(os.path.join(sys.prefix, "conda-meta"))
paths = sysconfig.get_paths()
writable = os.access(paths["purelib"], os.W_OK) and (
    venv or not os.path.exists(os.path.join(paths["stdlib"], "EXTERNALLY-MANAGED")))
spec = importlib.util.find_spec("torch")
torch = "-"
if spec is not None:  # present; its version from the metadata, or from torch/version.py (conda)
    try:
        torch = md.version("torch")
    except md.PackageNotFoundError:
        torch = "unknown"
        try:
            for line in open(os.path.join(os.path.dirname(spec.origin), "version.py")):
                if line.startswith("__version__"):
                    torch = line.split("=", 1)[1].strip().strip("'\"")
        except (OSError, TypeError):
            pass
print(sys.executable, sys.prefix, "venv" if venv else "conda" if conda else "system", int(writable), torch, sep="\n")
PY
}

# Creates virtual environment $1 with interpreter $2, seeing $2's packages.
_ck_make_venv() {
  local dir=$1 py=$2 base
  base=$("$py" -c 'import os, sys; print(os.path.join(sys.base_prefix, "bin", "python3") if sys.prefix != sys.base_prefix else sys.executable)')
  echo "[setup] creating $dir (python $base, seeing $py's packages)"
  "$base" -m venv --system-site-packages "$dir"
  if [ "$base" != "$("$py" -c 'import sys; print(sys.executable)')" ]; then
    # $py is a venv's: --system-site-packages shows the base interpreter's packages, not that
    # venv's (where torch is); a .pth file appends its site folders (those its own .pth files add
    # too) after the new venv's own site-packages.
    "$py" -c 'import os, sys, sysconfig
p = sysconfig.get_paths()
dirs = [p["purelib"], p["platlib"]] + [d for d in sys.path if os.path.basename(d) in ("site-packages", "dist-packages")]
print("\n".join(dict.fromkeys(dirs)))' \
      > "$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_commkit_parent.pth"
  fi
}

_ck_py=${PYTHON:-python3}
command -v "$_ck_py" >/dev/null 2>&1 || { echo "[setup] no Python interpreter '$_ck_py' (set PYTHON)" >&2; exit 1; }
_ck_facts_of() {
  mapfile -t _ck_facts < <(_ck_probe "$1")
  [ ${#_ck_facts[@]} = 5 ] || { echo "[setup] $1 does not run as a Python >= 3.9 interpreter" >&2; exit 1; }
}
_ck_facts_of "$_ck_py"
_ck_how=""
if [ -n "${COMMKIT_VENV:-}" ]; then
  [ -x "$COMMKIT_VENV/bin/python" ] || _ck_make_venv "$COMMKIT_VENV" "$_ck_py"
  _ck_py="$COMMKIT_VENV/bin/python" _ck_how="COMMKIT_VENV"
elif [ "${_ck_facts[2]}" != system ] || { [ "${_ck_facts[4]}" != - ] && [ "${_ck_facts[3]}" = 1 ]; }; then
  _ck_py=${_ck_facts[0]} _ck_how="the interpreter's own"
elif [ -x "$COMMKIT_ROOT/.venv/bin/python" ]; then
  _ck_py="$COMMKIT_ROOT/.venv/bin/python" _ck_how="existing .venv"
else
  _ck_make_venv "$COMMKIT_ROOT/.venv" "$_ck_py"
  _ck_py="$COMMKIT_ROOT/.venv/bin/python" _ck_how="new .venv"
fi
[ "$_ck_py" = "${_ck_facts[0]}" ] || _ck_facts_of "$_ck_py"
COMMKIT_PYTHON=${_ck_facts[0]}
export COMMKIT_ROOT COMMKIT_PYTHON PYTHON="$COMMKIT_PYTHON"
if [ "${_ck_facts[2]}" != system ]; then  # its console scripts (pip, cmake, ninja, pytest) first
  PATH="$(dirname "$COMMKIT_PYTHON"):$PATH"
  export PATH
  [ "${_ck_facts[2]}" = venv ] && export VIRTUAL_ENV="${_ck_facts[1]}"
fi
_ck_pip() {
  echo "[setup] pip install $*"
  "$COMMKIT_PYTHON" -m pip install -q "$@"
}

# Builds CUDA sources: the CUDA torch build brings the NCCL wheel that elastic_ep compiles against.
_ck_cuda_build=0
case "${COMMKIT_BUILD_CUDA:-AUTO}" in
  ON) _ck_cuda_build=1 ;;
  OFF) ;;
  *) { [ -n "${CUDACXX:-}" ] || command -v nvcc >/dev/null 2>&1; } && _ck_cuda_build=1 ;;
esac
if [ "${_ck_facts[4]}" = - ]; then
  if [ -n "${TORCH_SPEC:-}" ]; then
    _ck_torch=$TORCH_SPEC
  elif [ -e /dev/nvidia0 ] || nvidia-smi -L >/dev/null 2>&1 || [ $_ck_cuda_build = 1 ]; then
    _ck_torch="torch==2.14.1"
  else
    _ck_torch="torch==2.13.0+cpu"
  fi
  echo "[setup] no torch in ${_ck_facts[1]}: installing $_ck_torch"
  _ck_pip "$_ck_torch" || {
    echo "[setup] could not install $_ck_torch. Set TORCH_SPEC to a torch pip can get here (for the CPU build" \
         "from PyPI: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu), or run with PYTHON pointing at" \
         "an interpreter that has torch." >&2
    exit 1
  }
  _ck_facts_of "$COMMKIT_PYTHON"
fi

# What is missing of requirements-dev.txt (with dependencies, as pip check would see them) and, for
# elastic_ep, the NCCL wheel. Never torch: the installed one is pinned while pip runs.
_ck_need_nccl=0
if [[ " $COMMKIT_PACKAGES " == *" elastic_ep "* ]] && [ -z "${NCCL_HOME:-}" ] && [ -z "${NCCL_ROOT:-}" ]; then
  _ck_need_nccl=1
fi
mapfile -t _ck_missing < <("$COMMKIT_PYTHON" - requirements-dev.txt "$_ck_need_nccl" <<'PY'
import importlib.metadata as md, os, re, shutil, subprocess, sys
try:
    from packaging.requirements import Requirement
except ImportError:
    try:
        from pip._vendor.packaging.requirements import Requirement
    except ImportError:  # no packaging and no pip: everything is "missing", and pip will say so
        Requirement = None


def tool_version(name):  # cmake / ninja may come from the system instead of a wheel
    exe = shutil.which(name)
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"(\d+\.\d+(\.\d+)?)", out)
    return m.group(1) if m else None


def ok(spec, seen):
    r = Requirement(spec)
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        return True
    key = re.sub(r"[-_.]+", "-", r.name).lower()
    if key in seen:
        return True
    seen.add(key)
    try:
        version = md.version(r.name)
    except md.PackageNotFoundError:
        version = None
    if version is None and key in ("cmake", "ninja"):
        v = tool_version(key)
        return v is not None and r.specifier.contains(v, prereleases=True)
    if version is None or not r.specifier.contains(version, prereleases=True):
        return False
    return all(ok(dep, seen) for dep in md.requires(r.name) or [])


reqs = [line.split("#")[0].strip() for line in open(sys.argv[1])]
reqs = [r for r in reqs if r]
if sys.argv[2] == "1":
    nccl = None
    try:
        import importlib.util
        spec = importlib.util.find_spec("nvidia.nccl")
        nccl = list(spec.submodule_search_locations)[0] if spec else None
    except (ImportError, ValueError):
        pass
    if nccl is None:  # a torch CUDA build brings one; the CPU build does not
        try:
            cuda12 = any("-cu12" in d for d in (md.requires("torch") or []))
        except md.PackageNotFoundError:
            cuda12 = False
        reqs.append("nvidia-nccl-cu12>=2.28.9" if cuda12 else "nvidia-nccl-cu13>=2.28.9")
    # An NCCL without the device API is left to the build to refuse (upgrading the NCCL wheel that
    # torch pins would change torch's own NCCL).
for spec in reqs:
    if Requirement is None or not ok(spec, set()):
        print(spec)
PY
)
if [ ${#_ck_missing[@]} -gt 0 ]; then
  _ck_pin=$(mktemp)
  [ "${_ck_facts[4]}" = - ] || [ "${_ck_facts[4]}" = unknown ] || echo "torch==${_ck_facts[4]}" >"$_ck_pin"
  _ck_pip -c "$_ck_pin" "${_ck_missing[@]}" || { rm -f "$_ck_pin"; echo "[setup] pip could not install ${_ck_missing[*]}" >&2; exit 1; }
  rm -f "$_ck_pin"
fi

# The one line: which environment and which torch.
"$COMMKIT_PYTHON" - "$_ck_how" "${_ck_facts[2]}" <<'PY' || { echo "[setup] torch is installed but does not import (above); fix or replace it, or set PYTHON / COMMKIT_VENV" >&2; exit 1; }
import sys
import torch
how, kind = sys.argv[1:]
kinds = {"venv": "virtual environment", "conda": "conda environment", "system": "system Python"}
gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
print(f"[setup] environment {sys.prefix} ({kinds[kind]}, {how}), python {sys.version.split()[0]}, "
      f"torch {torch.__version__} ({build}) from {torch.__file__.rsplit('/torch/', 1)[0]}, {gpus} GPU(s)")
PY

if [ "${COMMKIT_SKIP_BUILD:-0}" != 1 ]; then
  for pkg in $COMMKIT_PACKAGES; do
    echo "[setup] building $pkg"
    t0=$(date +%s)
    log="$COMMKIT_ROOT/build/logs/build_$pkg.log"
    mkdir -p "$(dirname "$log")"
    if ! "$COMMKIT_PYTHON" -m pip install --no-build-isolation --no-deps -v "packages/$pkg" >"$log" 2>&1; then
      tail -60 "$log"
      echo "[setup] building $pkg FAILED (full log: $log)" >&2
      exit 1
    fi
    grep -E "commkit: (CUDA|NCCL|no nvcc)" "$log" | sed 's/^ *-- /[setup]   /' || true
    echo "[setup] built $pkg in $(( $(date +%s) - t0 )) s"
  done
fi
unset _ck_py _ck_facts _ck_how _ck_cuda_build _ck_torch _ck_need_nccl _ck_missing _ck_pin
