"""PP transfers and AGRS gathers whose ranks disagree on the tensors, on the native runtime's CUDA-IPC
window (ranks may share one GPU): the workers of test_pp_agrs_mismatch_cpu.py with backend="native".

* PP: the receive kernel compares the sender's descriptor (kernels/pp.cuh) before copying: ``t`` stays
  bitwise unchanged, the slot is returned, and the receiver's next call (``pp_set_config`` here) raises
  the same ``ValueError`` as the torch runtime's, naming the field and both values; the sender raises
  at that ``pp_set_config`` (it reads the refusal the receiver left in its workspace); the pair's next
  transfer is bitwise torch's send / recv. Other dtype, numel, shape, an empty tensor; either side odd.
* AGRS: the gather-done kernel compares the gathers' records (kernels/agrs.cuh): every rank's next call
  (``destroy_agrs_session``, which still ends the session) raises naming the field, the lowest
  differing peer and both values; the session's earlier result is intact; a new session's gather is
  bitwise torch's all-gather. Other dtype, numel, shape, tensor count, a second tensor's dtype.
"""
import pytest

from tests._dist import run_workers
from tests.elastic_ep import test_pp_agrs_mismatch_cpu as cpu


@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.parametrize("odd_side", ["sender", "receiver"])
@pytest.mark.fault
def test_pp_native_refuses_a_peer_with_another_tensor(tmp_path, odd_side):
    res = run_workers(cpu.pp_worker, 2, "native", odd_side, tmp_path=tmp_path, timeout=240)
    assert res == [len(cpu.PP_CASES)] * 2


@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.fault
def test_agrs_native_refuses_ranks_with_other_tensors(tmp_path, world):
    res = run_workers(cpu.agrs_worker, world, "native", tmp_path=tmp_path, timeout=240)
    assert res == [len(cpu.AGRS_CASES)] * world
