"""destroy() of a native buffer whose operations wait forever (``num_gpu_timeout_secs=0``, the low-level
API's "no device deadline") is bounded (csrc/host/runtime.cpp, Runtime::quiesce): ranks sharing one GPU
on the CUDA-IPC window.

Rank 0 dispatches (no CPU sync) while rank 1, alive, makes no call: rank 0's kernels wait for rank 1's
counts without a deadline. Rank 0's destroy() gives the device the destroy barrier's deadline (30 s when
the buffer has none), then ends this rank's device waits through the timeout record and keeps the window;
it raises within a few seconds of that deadline (CommError: the device was still busy, the window kept),
the buffer marked broken for that reason, and the CUDA context stays usable. Rank 1's own destroy()
afterwards returns at once: it entered no operation on this CUDA-IPC window, so it runs no destroy
barrier (a peer that did, or any peer on an NCCL window, waits for that barrier's deadline and raises
that a peer did not reach destroy()).

``via="runtime"`` calls the native runtime's destroy() (``_C.Runtime``) first; ``via="buffer"`` calls
only the Python buffer's ``destroy()``, which bounds the whole call only when nothing in it synchronises
the device without a deadline before the native destroy().
"""
from __future__ import annotations

import time

import pytest
import torch

from tests._dist import run_workers

H, K, T = 256, 4, 32
DESTROY_DEADLINE_S = 30.0  # kDestroyDeadlineNs (runtime.cpp)


def stuck_dispatch_worker(rank, world, rdzv, via):
    import torch.distributed as dist

    from elastic_ep import _low_level as ll
    from tests.elastic_ep._common import init_ep_group
    from tests.elastic_ep.test_lowlevel_gpu import _dispatch, _inputs, _new_buffer

    init_ep_group(rank, world, rdzv, "ipc")
    E = 8 * world
    nbytes = ll.NativeRuntime.calculate_buffer_size(world, T, H, K, False, True, True)
    buf = _new_buffer(rank, world, 0, nbytes, True, gpu_timeout=0, window="ipc")
    if rank == 1:  # alive, but makes no call until rank 0's destroy() returned
        dist.barrier()
        t0 = time.monotonic()
        buf.destroy()
        return time.monotonic() - t0
    x, _, topk, w = _inputs(rank, T, H, K, E, False, False, 5)
    _dispatch(buf, x, None, topk, w, None, T, E, 1, cpu_sync=False)  # waits forever for rank 1's counts
    time.sleep(1.0)
    stuck = not buf.comm_stream.query()
    t0 = time.monotonic()
    raised = ""
    try:
        if via == "runtime":
            buf._rt.destroy()
        buf.destroy()
    except Exception as e:  # noqa: BLE001 - the report is what the test checks
        raised = str(e)
    took = time.monotonic() - t0
    broken, reason = bool(buf._rt.broken), str(buf._rt.broken_reason)
    usable = float(torch.ones(1024, device="cuda").sum().item()) == 1024.0
    torch.cuda.synchronize()  # nothing of the buffer's is left running on the device
    dist.barrier()
    return stuck, took, broken, reason, usable, raised


@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.fault
@pytest.mark.parametrize("via", ["runtime", "buffer"])
def test_destroy_is_bounded_without_a_device_deadline(tmp_path, via):
    res = run_workers(stuck_dispatch_worker, 2, via, tmp_path=tmp_path, timeout=150)
    stuck, took, broken, reason, usable, raised = res[0]
    assert stuck, "rank 0's dispatch finished although rank 1 never made the call"
    assert DESTROY_DEADLINE_S - 1.0 < took < DESTROY_DEADLINE_S + 10.0, f"rank 0's destroy() took {took:.1f} s"
    assert broken and "destroy() ended its device waits" in reason, (broken, reason)
    # Nothing else told the caller that the dispatch never finished: destroy() says so, by rank.
    assert "destroy() on rank 0" in raised and "ended this buffer's device waits" in raised and "kept" in raised, raised
    assert usable, "rank 0's CUDA context is unusable after destroy()"
    assert res[1] < 5.0, f"rank 1's destroy() took {res[1]:.1f} s"
