#!/usr/bin/env bash
# Engineer B's GPU run: build, benchmark first (so numbers come back), then the GPU tests; every stage
# is bounded so the logs always come back within the run's limit.  Usage: bash $0 OUT_DIR
set -u
R=$(pwd); O=${1:-/tmp/r}; mkdir -p "$O"
T0=$(date +%s)
left() { echo $(( 285 - ($(date +%s) - T0) )); }
export EP_REUSE_NCCL_COMM=0  # own communicator; test_native_on_torch_communicator covers torch's
export COMMKIT_REQUIRE_GPU=${COMMKIT_REQUIRE_GPU:-1}  # no GPU, or a CPU-only build: fail, not skip
timeout 150 bash tools/gpu.sh "$O" --only elastic_ep --no-tests --no-bench > "$O/gpu_sh.log" 2>&1
echo "build rc=$? after $(( $(date +%s) - T0 )) s"; tail -4 "$O/gpu_sh.log"
cd /tmp
B=$(( $(left) - 150 )); [ $B -gt 90 ] && B=90
if [ $B -gt 20 ]; then
  timeout $B python "$R/tools/bench_elastic_ep.py" --out "$O" --quick --num-sms 0,32 > "$O/bench.log" 2>&1
  echo "bench rc=$? after $(( $(date +%s) - T0 )) s"; grep -v "^ *$" "$O/bench.log" | tail -16
fi
L=$(( $(left) - 3 ))
timeout $L python -m pytest "$R/tests/elastic_ep/test_sizing.py" \
  "$R/tests/elastic_ep/test_validation_cpu.py::test_bad_inputs_native_ep1" "$R/tests/elastic_ep/test_gpu.py" -c "$R/pytest.ini" --rootdir "$R" -v -rfEsP -p no:cacheprovider \
  --junitxml="$O/junit.xml" > "$O/tests.log" 2>&1
echo "tests rc=$? after $(( $(date +%s) - T0 )) s"
grep -E "PASSED|FAILED|ERROR|SKIPPED|communicator used|failed checks|Error|error" "$O/tests.log" | head -60
