"""GPU tests of the LTX drop-in (``All2All(rank, world_size, seqlen, hidden_dim, num_sms, dtype, group=...)``,
``copy_out``, ``runtime``, the methods under torch.compile), bitwise against the plain torch path.
Ranks may share a GPU (COMMKIT_TEST_SHARE_GPU=1, see tests/conftest.py): correctness only."""
from __future__ import annotations

import pytest

from tests._dist import run_workers
from tests.ipc_all2all import _ltx_workers as lw
from tests.ipc_all2all.test_gpu import _world

MULTI = pytest.mark.multigpu(2, shared_ok=True)


@pytest.mark.smoke
@MULTI
def test_ltx_constructor_with_group_and_copy_out(tmp_path):
    """The collective constructor is ready to use at once; send_recv_heads / gather_heads / allgather
    with copy_out False (views in the buffer) and True (fresh tensors), batch 1 and 2, even and uneven
    counts with a rank of no tokens, bf16 and e4m3, the copy_output spelling and runtime: all bitwise
    equal to permute -> all_to_all_single -> permute and the all-gather."""
    res = run_workers(lw.worker_ltx_api, _world(), tmp_path=tmp_path, timeout=240)
    assert res == [2 * 2 * 3 * 2] * _world(), res


@MULTI
def test_ltx_methods_under_torch_compile_fullgraph(tmp_path):
    """The methods compile with fullgraph=True to the package's custom ops, uneven shards included;
    compiled communication is bitwise the torch path's, the compiled attention block equals eager."""
    res = run_workers(lw.worker_ltx_compile, _world(), tmp_path=tmp_path, timeout=400,
                      env={"TORCHINDUCTOR_COMPILE_THREADS": "1"})
    assert res == [2] * _world(), res
