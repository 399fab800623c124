"""The full Python API on the torch backend with gloo (CPU, CI), checked against the plain oracle.

Every dispatch/combine mode (bf16 / FP8 with FP32 or UE8M0 scales, expand with alignment and zero
padding, CPU sync or worst-case outputs, cached mode, 0/1/2 biases, single and multiple reduction,
deterministic ordering, TMA column-major scales, strided input scales) on 2, 3 and 4 ranks with
different token counts per rank, including a rank with 0 tokens. Expanded rows are placed in a
random order inside each expert segment (as the native kernels' atomics may), so the canonical
comparison and the deterministic sort are exercised on the CPU too.
"""
import pytest

from tests._dist import run_workers
from tests.elastic_ep._common import matrix_worker

SMALL = dict(hidden=256, topk=4, experts=16, max_tokens=48, tokens=[40, 0, 48, 17])
BUFFERS = [dict(allow_multiple_reduction=True, deterministic=False),
           dict(allow_multiple_reduction=False, deterministic=True)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_matrix_torch_backend_gloo(tmp_path, world):
    shape = dict(SMALL)
    if world == 3:
        shape.update(topk=2, experts=12)  # R > K: combine slots by master lane
    cfg = dict(device="cpu", backend="torch", kind="cpu", shape=shape, buffers=BUFFERS, seed=world, shuffle=True)
    done = run_workers(matrix_worker, world, cfg, tmp_path=tmp_path, timeout=300)
    assert done == [len(BUFFERS) * 12] * world
