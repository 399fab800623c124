"""GPU fault test, in its own file so that it runs after every other test (gpu.sh uses -x)."""
import pytest

import fp8_layerwise as F
from tests._dist import run_workers
from tests.fp8_layerwise import _fault_workers as FW
from tests.fp8_layerwise._timing import fast_bound

pytestmark = pytest.mark.skipif(not F.built_with_cuda(), reason="built without CUDA")


@pytest.mark.smoke
@pytest.mark.multigpu(2, shared_ok=True)  # no NCCL between ranks: they may share a GPU
@pytest.mark.fault
def test_gpu_sigkill_consumer(tmp_path, record_property):
    try:
        res = run_workers(FW.kill_consumer, 2, str(tmp_path), "cuda", tmp_path=tmp_path, timeout=240,
                          expect_dead={1})
    except Exception as exc:
        faults = "".join(p.read_text() for p in sorted(tmp_path.glob("fault.*.txt")))
        raise AssertionError(f"{exc}\nfaulthandler output:\n{faults}") from None
    r0 = res[0]
    assert r0["type"] == "PeerDied" and r0["rank"] == 1, r0
    # detected by the liveness check, not by the timeout
    assert r0["t_exc"] - r0["t0"] < fast_bound(FW.LIVENESS_MS / 1000, FW.DEAD_PEER_TIMEOUT_MS / 1000), r0
    record_property("detect_s", r0["t_exc"] - r0["t0"])
