"""DeepEP V1's normal-mode API (``elastic_ep.Buffer``) on the native backend, bitwise against the same
plain-loop reference as the CPU test (``test_v1_buffer_cpu``): every case of its matrix (BF16 / FP8 with
FP32 and int32 scales, with and without top-k, each event mode, ``num_worst_tokens``, cached dispatch,
0 / 1 / 2 biases, V1's top-k weight rule).

* EP 1 on one GPU (NCCL window).
* EP 2 with the ranks sharing one GPU (``COMMKIT_TEST_SHARE_GPU=1``): the CUDA-IPC window over gloo.
"""
import pytest

from tests._dist import run_workers
from tests.elastic_ep.test_v1_buffer_cpu import cases, v1_worker


@pytest.mark.smoke
@pytest.mark.gpu
def test_v1_native_ep1(tmp_path):
    cfg = dict(device="cuda", backend="native", window="auto")
    assert run_workers(v1_worker, 1, cfg, tmp_path=tmp_path, timeout=300) == [len(cases(1))]


@pytest.mark.multigpu(2, shared_ok=True)  # the CUDA-IPC window needs no NCCL: the ranks may share a GPU
def test_v1_native_ep2_ipc_window(tmp_path):
    cfg = dict(device="cuda", backend="native", window="ipc")
    assert run_workers(v1_worker, 2, cfg, tmp_path=tmp_path, timeout=300) == [len(cases(2))] * 2
