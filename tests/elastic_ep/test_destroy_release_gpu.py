"""A CUDA or NCCL release that fails in destroy() is raised, after every other resource was released
(native runtime, ranks sharing one GPU on the CUDA-IPC window).

ELASTIC_EP_TEST_FAIL_RELEASE names release steps that destroy() reports as failed although they ran
(commkit/teardown.hpp): the IPC window's cudaIpcCloseMemHandle of the peers and the runtime's
cudaFreeHost of its host workspace here. Before, the window's and the runtime's releases ignored every
CUDA result and destroy() returned as if all went well. Each rank's destroy() raises CommError naming
both steps (and no step between them: those succeeded), then a new buffer on the same ranks works.
"""
from __future__ import annotations

import pytest
import torch

from tests._dist import run_workers

H, K, T = 256, 4, 32


def failing_release_worker(rank, world, rdzv):
    import os

    from tests.elastic_ep._common import import_elastic_ep, init_ep_group, make_inputs

    ep = import_elastic_ep()
    group = init_ep_group(rank, world, rdzv, "ipc")
    E = 8 * world
    cfg = dict(num_max_tokens_per_rank=T, hidden=H, num_topk=K, backend="native", num_cpu_timeout_secs=30,
               num_gpu_timeout_secs=30, explicitly_destroy=True, window="ipc")
    buf = ep.ElasticBuffer(group, **cfg)  # the settings (and the hook) are read here
    os.environ.pop("ELASTIC_EP_TEST_FAIL_RELEASE")
    inp = make_inputs(rank, T, H, K, E, "bf16", 3, "cuda")
    buf.dispatch(inp["x"], topk_idx=inp["topk_idx"], topk_weights=inp["topk_weights"], num_experts=E)
    torch.cuda.synchronize()
    try:
        buf.destroy()
        msg = "no error"
    except Exception as e:  # noqa: BLE001 - the type and message are checked by the parent
        msg = f"{type(e).__name__}: {e}"
    again = ep.ElasticBuffer(group, **cfg)  # the device and the peers are fine
    recv, _, w, handle, _ = again.dispatch(inp["x"], topk_idx=inp["topk_idx"], topk_weights=inp["topk_weights"],
                                           num_experts=E)
    y, _, _ = again.combine(recv, handle, topk_weights=w)
    torch.cuda.synchronize()
    finite = bool(torch.isfinite(y.float()).all().item())
    again.destroy()
    return msg, finite


@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.fault
def test_a_failed_release_in_destroy_is_raised(tmp_path):
    res = run_workers(failing_release_worker, 2, tmp_path=tmp_path, timeout=180,
                      env={"ELASTIC_EP_TEST_FAIL_RELEASE": "cudaIpcCloseMemHandle(peers),cudaFreeHost(host_workspace)"})
    for rank, (msg, finite) in enumerate(res):
        assert msg.startswith("CommError") and f"destroy() on rank {rank}" in msg, msg
        assert "cudaIpcCloseMemHandle(peers) failed" in msg and "cudaFreeHost(host_workspace) failed" in msg, msg
        assert "cudaFree(window)" not in msg and "cudaEventDestroy" not in msg, msg
        assert finite, f"rank {rank}: the buffer built after the failed release gave a non-finite combine"
