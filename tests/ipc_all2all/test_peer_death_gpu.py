"""A rank's process dies (SIGKILL) while its peer waits for it in send_recv_heads (ranks sharing one GPU).

The instance's peer watch (commkit::PeerWatch, every IPC_ALL2ALL_PEER_WATCH_MS = 200 ms) notices the
dead process and ends the survivor's wait at once, long before its 60 s deadline: check() raises
CommError naming the dead rank (its ``peer`` attribute too) and the call that waited within 5 s, the CUDA context stays
usable and destroy() returns.
"""
from __future__ import annotations

import pytest
import torch

from tests._dist import run_workers


def death_worker(rank, world, rdzv):
    import os
    import signal
    import time

    import ipc_all2all
    from tests.ipc_all2all._references import _setup

    dev = _setup(rank, world, rdzv)
    H, D = 4 * world, 128
    a2a = ipc_all2all.All2All.from_group(num_tokens=64 * world, hidden_dim=H * D, tensor_dtype=torch.bfloat16,
                                         timeout_seconds=60.0)
    a2a.set_rank_tokens([16] * world)
    x = torch.ones(1, 16, H, D, dtype=torch.bfloat16, device=dev)
    a2a.gather_heads(a2a.send_recv_heads(x), copy_output=True)  # every kernel loaded, both ranks in step
    a2a.synchronize()
    if rank == 1:
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        a2a.send_recv_heads(x)  # the dead rank never enters this call
        a2a.synchronize()
        a2a.check()
        msg, peer = "no error", None
    except ipc_all2all.CommError as e:
        msg, peer = str(e), getattr(e, "peer", None)
    waited = time.monotonic() - t0
    assert "rank 1's process" in msg and "died" in msg and peer == 1, (msg, peer)
    assert "during this rank's send_recv_heads" in msg, msg  # the call that waited, the last one launched
    assert waited < 6.0, f"the survivor noticed the dead peer after {waited:.1f} s"
    assert float(torch.ones(1024, device=dev).sum().item()) == 1024.0  # the context is usable
    a2a.destroy()
    return "noticed", waited


@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.fault
def test_survivor_names_a_dead_rank_at_once(tmp_path, record_property):
    res = run_workers(death_worker, 2, tmp_path=tmp_path, timeout=120, expect_dead={1})
    assert res[0][0] == "noticed"
    record_property("detect_s", res[0][1])  # from the start of the wait, 1 s before the death
