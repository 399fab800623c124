"""A peer's handle whose description claims a larger buffer than the allocation behind it (ranks sharing
one GPU).

Every rank checks the peers' descriptions (world size, layout, allocation bytes) before opening any
handle, but the description is only what the peer wrote. After opening, the mapping's real size
(commkit::allocation_bytes_from, the driver's cuMemGetAddressRange) must reach the described size,
or this rank would write past the peer's allocation: a handle of a smaller allocation with a forged
description is refused (Error naming this rank and the peer, nothing left open), and the honest
handle of the same peer opens.
"""
from __future__ import annotations

import struct

import pytest

from tests._dist import run_workers

BIG, SMALL = 64 << 20, 1 << 20  # capacity bytes of the honest buffers and of the smaller one


def forged_worker(rank, world, rdzv):
    import torch
    import torch.distributed as dist

    from ipc_all2all import _C
    from tests.ipc_all2all._references import _setup

    _setup(rank, world, rdzv)
    big = _C.Core(rank, world, BIG, 2 * world, 60.0)
    small = _C.Core(rank, world, SMALL, 2 * world, 60.0)
    handles = [None] * world
    dist.all_gather_object(handles, (big.ipc_handle(), small.ipc_handle()))
    out = None
    if rank == 0:
        own = big.ipc_handle()
        # Rank 1's description of its big buffer, with the CUDA IPC handle of its small one.
        forged = handles[1][0][:32] + handles[1][1][32:]
        assert struct.unpack_from("<q", forged, 24)[0] > big.buffer_bytes // 2  # claims the big size
        try:
            big.open_peers([own, forged])
            out = "opened"
        except Exception as e:  # noqa: BLE001 - the test names the type it expects below
            out = (type(e).__name__, str(e))
        assert not big.opened
        big.open_peers([own, handles[1][0]])  # the honest handle of the same peer opens
        assert big.opened
    torch.cuda.synchronize()
    dist.barrier()  # rank 1's allocations stay alive until rank 0 is done with them
    return out


@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.fault
def test_a_handle_of_a_smaller_allocation_is_refused(tmp_path):
    res = run_workers(forged_worker, 2, tmp_path=tmp_path, timeout=120)
    kind, msg = res[0]
    assert kind in ("CommError", "RuntimeError", "Error"), (kind, msg)
    assert "rank 1" in msg and "description says" in msg and "nothing opened" in msg, msg
