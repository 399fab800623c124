# Sourced by tools/gpu_x2.sh, gpu_x2b.sh and gpu_x2c.sh (after they set OUT and ROOT): the GPU machine's
# environment, the build, and `step NAME LIMIT_S CMD...`, which runs one step from /tmp (so the
# installed packages are imported, not the sources) under its own time limit, logs it to
# OUT/NAME.log and prints its tail, so one step running out never costs the rest of the call.
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# GPU tests fail rather than skip when CUDA is unusable or a package was built without it (tests/conftest.py)
export COMMKIT_REQUIRE_GPU=${COMMKIT_REQUIRE_GPU:-1}
PY=${PYTHON:-python3}
PYTEST=($PY -m pytest -c "$ROOT/pytest.ini" --rootdir "$ROOT" -q -rfE -m "gpu or multigpu")
step() {
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s) $(date -u +%T) ==="
  (cd /tmp && timeout "$limit" "$@") > "$OUT/$name.log" 2>&1
  echo "rc=$? after $name $(date -u +%T)"
  tail -n 25 "$OUT/$name.log"
}
build_all() {  # the three packages, as tools/gpu.sh builds them
  bash "$ROOT/tools/gpu.sh" "$OUT/build" --no-tests --no-bench > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  tail -n 3 "$OUT/build.log"
}
