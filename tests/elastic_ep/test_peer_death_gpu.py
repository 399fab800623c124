"""A rank's process dies (SIGKILL) while its peer waits for it in an operation (native runtime, ranks
sharing one GPU on the CUDA-IPC window).

The runtime's peer watch (commkit::PeerWatch, every ELASTIC_EP_PEER_WATCH_MS = 200 ms) notices the dead
process and ends the survivor's waits at once through the timeout record, long before the device and
CPU deadlines (60 s here): the survivor raises CommError naming the dead rank within 5 s, its CUDA
context stays usable, and destroying its buffer returns.
"""
from __future__ import annotations

import pytest
import torch

from tests._dist import run_workers

H, K, T = 256, 4, 32


def death_worker(rank, world, rdzv, when):
    import os
    import signal
    import time

    from tests.elastic_ep._common import import_elastic_ep, init_ep_group, make_inputs

    ep = import_elastic_ep()
    group = init_ep_group(rank, world, rdzv, "ipc")
    E = 8 * world
    buf = ep.ElasticBuffer(group, num_max_tokens_per_rank=T, hidden=H, num_topk=K, backend="native",
                           num_cpu_timeout_secs=60, num_gpu_timeout_secs=60, explicitly_destroy=True, window="ipc")
    inp = make_inputs(rank, T, H, K, E, "bf16", 7, "cuda")
    if rank == 1:
        if when == "combine":  # dies between a dispatch and the combine its peer waits in
            buf.dispatch(inp["x"], topk_idx=inp["topk_idx"], topk_weights=inp["topk_weights"], num_experts=E)
            torch.cuda.synchronize()
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        recv, _, w, handle, _ = buf.dispatch(inp["x"], topk_idx=inp["topk_idx"], topk_weights=inp["topk_weights"],
                                             num_experts=E, do_cpu_sync=when != "dispatch_nosync")
        if when == "combine":
            buf.combine(recv, handle, topk_weights=w)
        torch.cuda.synchronize()
        buf.barrier()
        msg = "no error"
    except ep.CommError as e:
        msg = str(e)
    waited = time.monotonic() - t0
    assert "rank 1's process" in msg and "died" in msg, msg
    assert waited < 6.0, f"the survivor noticed the dead peer after {waited:.1f} s"
    assert float(torch.ones(1024, device="cuda").sum().item()) == 1024.0  # the context is usable
    buf.destroy()
    return "noticed"


@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.parametrize("when", ["dispatch", "dispatch_nosync", "combine"])
def test_native_survivor_names_a_dead_rank_at_once(tmp_path, when):
    res = run_workers(death_worker, 2, when, tmp_path=tmp_path, timeout=120, expect_dead={1})
    assert res[0] == "noticed"
