"""Worker bodies of the CPU multi-process tests (importable by spawned children)."""
from __future__ import annotations

import os

import torch

from tests._dist import init_gloo
from tests.ipc_all2all._stand_ins import RecordingCore


def worker_from_group_reports_every_rank(rank, world, rdzv, bad_rank):
    import ipc_all2all

    init_gloo(rank, world, rdzv)
    dtype = torch.float64 if rank == bad_rank else torch.bfloat16  # one rank passes an invalid dtype
    try:
        ipc_all2all.All2All.from_group(num_tokens=16, hidden_dim=1024, tensor_dtype=dtype)
    except (ipc_all2all.CommError, ValueError, RuntimeError) as e:
        return type(e).__name__, str(e)
    raise AssertionError("from_group succeeded where it must fail")


class CpuCore(RecordingCore):
    """The native core's interface on the CPU (no GPU), built as ``_C.Core(rank, world_size, capacity,
    num_sms, timeout_seconds)`` is: a host buffer, a handle naming the rank, slots alternating like the
    real core's; records what the Python layer asks of it. ``launch`` moves no data (the tests that
    use it check shapes, arguments and the collective plumbing)."""

    made: list = []  # every core built in this process

    def __init__(self, rank, world_size, capacity, num_sms, timeout_seconds):
        from ipc_all2all import _C

        CpuCore.made.append(self)
        self.buf = torch.zeros(_C.buffer_layout(capacity)["total"], dtype=torch.uint8)
        super().__init__(capacity, self.buf)
        self.args = (rank, world_size, capacity, num_sms, timeout_seconds)
        self.timeout_seconds = timeout_seconds
        self.rank, self.device = rank, 0
        self.opened = False
        self.handles = None

    def ipc_handle(self):
        return f"handle of rank {self.rank}".encode()

    def open_peers(self, handles):
        self.handles, self.opened = list(handles), True

    def set_timeout_seconds(self, s):
        self.timeout = s


class _HostBytes:
    """numpy's analogue of ``__cuda_array_interface__`` over a CpuCore's buffer: the array made from it
    holds this object, and so the keeper, as torch holds the real one (a view keeps the buffer)."""

    def __init__(self, keeper):
        buf = keeper.owner.buf
        self.keeper = keeper
        self.__array_interface__ = {"shape": (buf.numel(),), "typestr": "|u1", "version": 3,
                                    "data": (buf.data_ptr(), False)}


def _host_buffer_tensor(keeper, device):
    import numpy as np

    return torch.from_numpy(np.asarray(_HostBytes(keeper)))


def cpu_stand_ins():
    """Lets ``All2All(...)`` run its real constructor on a machine without a GPU: the native core is a
    :class:`CpuCore`, the buffer a host tensor, the order token and streams CPU stand-ins. Returns a
    function that undoes it (for in-process use; workers just exit)."""
    import types

    import ipc_all2all
    from ipc_all2all import _lifetime, all2all as A, ops

    saved = [(torch.cuda, "is_available"), (torch.cuda, "current_stream"), (torch.cuda, "synchronize"),
             (A, "built_with_cuda"), (A, "_device_sm_count"), (A._C, "Core"), (ops, "order_token"), (_lifetime, "_buffer_tensor")]
    saved = [(obj, name, getattr(obj, name)) for obj, name in saved]
    cpu_token = ipc_all2all.ops.order_token("cpu")
    torch.cuda.is_available = lambda: True
    torch.cuda.current_stream = lambda device=None: types.SimpleNamespace(cuda_stream=7)
    torch.cuda.synchronize = lambda device=None: None
    A.built_with_cuda = lambda: True
    A._device_sm_count = lambda: 132
    A._C.Core = CpuCore
    ops.order_token = lambda device: cpu_token
    _lifetime._buffer_tensor = _host_buffer_tensor

    def undo():
        for obj, name, value in saved:
            setattr(obj, name, value)

    return undo


def worker_ltx_constructor_with_group(rank, world, rdzv):
    """LTX's form, ``All2All(rank, world_size, seqlen, hidden_dim, num_sms, tensor_dtype, group=...)``,
    over a gloo group with CPU stand-ins for the device: the construction is collective (every rank's
    instance has opened every rank's handle, in rank order) and so is destroy(); a rank whose arguments
    do not match the group makes every rank raise, naming it."""
    import warnings

    import torch.distributed as dist

    import ipc_all2all

    group = init_gloo(rank, world, rdzv)
    cpu_stand_ins()
    out = {}
    a = ipc_all2all.All2All(rank, world, 16, 256, 8, torch.bfloat16, group=group, timeout_seconds=3)
    out["handles"] = a._core.handles
    out["core_args"] = a._core.args
    # the peer watch got every rank's process id (pid third), in rank order, and the default period
    ids, period = a._core.watched
    out["watched"] = (len(ids), ids[rank][2] == os.getpid(), period)
    out.update(collective=a.collective, group_is=a.group is group, buffer_size=a.buffer_size,
               runtime=type(a.runtime).__name__)
    a.destroy()
    # collective: the core waits for every peer's arrival word, with destroy()'s deadline
    out["destroy_args"] = a._core.destroys
    # rank 1 passes rank 0: every rank raises, naming rank 1
    try:
        ipc_all2all.All2All(0 if rank == 1 else rank, world, 16, 256, 8, torch.bfloat16, group=group)
    except (ipc_all2all.CommError, ValueError) as e:
        out["mismatch"] = (type(e).__name__, str(e))
    else:
        raise AssertionError("a rank passing another rank than the group's was accepted")
    # a rank whose slot size differs: refused on every rank before any peer memory is opened, and the
    # core each rank had built is released at once (not left to the garbage collector)
    before = len(CpuCore.made)
    try:
        ipc_all2all.All2All(rank, world, 16 * (rank + 1), 256, 8, torch.bfloat16, group=group)
    except ValueError as e:
        out["sizes"] = str(e)
    else:
        raise AssertionError("ranks with different slot sizes were paired")
    (core,) = CpuCore.made[before:]
    out["sizes_released"] = core.destroyed and not core.opened
    with warnings.catch_warnings(record=True) as caught:  # ipc_all2all 0.1.0's order: timeout seventh
        warnings.simplefilter("always")
        b = ipc_all2all.All2All(rank, world, 16, 256, 8, torch.bfloat16, 2.5)
    out["legacy"] = (b._core.args[4], b.collective, [str(w.message) for w in caught])
    b.destroy()
    dist.barrier()
    return out
