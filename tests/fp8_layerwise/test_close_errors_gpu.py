"""close() of a CUDA-backend transport raises the releases that failed, after releasing everything
(FP8_LAYERWISE_TEST_FAIL_RELEASE reports the named steps as failed although they ran): the copy
backend's cudaFreeHost of its staging memory and cudaStreamDestroy, here. The CPU path is in
test_close_errors_cpu.py."""
import pytest

import fp8_layerwise as F
from tests._dist import run_workers

pytestmark = pytest.mark.skipif(not F.built_with_cuda(), reason="built without CUDA")

NB = [4096, 512, 2048, 256]


def failing_release_worker(rank, world, rdzv):
    import os

    import torch

    os.environ["FP8_LAYERWISE_TEST_FAIL_RELEASE"] = "cudaFreeHost(staging),cudaStreamDestroy"
    t = F.Transport(0, 1, 4, NB, num_slots=2, backend="cuda", exchange=lambda o: [o])  # small kinds: staged
    del os.environ["FP8_LAYERWISE_TEST_FAIL_RELEASE"]
    try:
        t.close()
        msg = "no error"
    except F.TransportError as e:
        msg = str(e)
    again = F.Transport(0, 1, 4, NB, num_slots=2, backend="cuda", exchange=lambda o: [o])
    again.close()  # nothing injected: a clean close
    torch.cuda.synchronize()
    return msg, t.closed


@pytest.mark.gpu
@pytest.mark.fault
def test_a_failed_release_of_the_cuda_backend_is_raised(tmp_path):
    msg, closed = run_workers(failing_release_worker, 1, tmp_path=tmp_path, timeout=120)[0]
    assert closed
    assert "cudaFreeHost(staging) failed" in msg and "cudaStreamDestroy failed" in msg, msg
    assert "cudaEventDestroy" not in msg, msg  # the steps in between ran and succeeded
