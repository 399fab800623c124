"""In-process stand-ins for the CPU tests of ipc_all2all's Python layer (no GPU): a recording native
core, instances over it, and a recording communicator for the compiled custom ops."""
from __future__ import annotations

import types

import numpy as np
import torch

import ipc_all2all
from ipc_all2all import _C, ops


class RecordingCore:
    """The native core's interface without a GPU: records launches, alternates slots like the real one.
    ``capture`` stands for the capture id of the current stream (0: not capturing)."""

    def __init__(self, cap, buf):
        self.calls, self.destroyed, self.broken, self.cap = 0, False, False, cap
        self.dead_peer, self.watched = -1, None  # the peer watch: nobody found dead; what it was given
        self.buffer_ptr = buf.data_ptr()
        self.buffer_bytes = buf.numel()
        self.launches = []
        self.capture, self.captured_calls, self.slot_captures = 0, 0, [0, 0]
        self.released = False
        self.recorded = []  # (calls so far, stream, capturing) of each record_last_call
        self.timeout_seconds = 10.0
        self.destroys = []  # (free_buffer, timeout_seconds, collective) of each destroy()

    @property
    def next_slot(self):
        return self.calls % 2

    def slot_offset(self, i):
        return _C.buffer_layout(self.cap)["slots"][i][0]

    def capture_id(self, stream):
        return self.capture

    def slot_capture(self, slot):
        return self.slot_captures[slot]

    def launch(self, *args):
        self.launches.append(args)
        slot = self.calls % 2
        self.calls += 1
        self.captured_calls += self.capture != 0
        self.slot_captures[slot] = self.capture
        return slot

    def record_last_call(self, stream, capturing):
        self.recorded.append((self.calls, stream, capturing))

    def open_peers(self, handles):
        self.handles = handles

    def watch_peers(self, process_ids, period_ms):
        self.watched = (list(process_ids), period_ms)

    def destroy(self, free_buffer=True, timeout_seconds=30.0, collective=False):
        self.destroys.append((free_buffer, timeout_seconds, collective))
        self.destroyed = True
        self.released = self.released or free_buffer

    def release_buffer(self):
        self.released = True


def fake_current_stream(monkeypatch) -> None:
    """``torch.cuda.current_stream()`` returns a stand-in whose ``cuda_stream`` is 7."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=7))


def instance_over(core, buf, cls=ipc_all2all.All2All, **fields):
    """An ``All2All`` (rank 1 of 2, bf16, on the CPU) over ``core`` and the buffer tensor ``buf``, made
    without its constructor; ``fields`` override its attributes."""
    a = cls.__new__(cls)
    a.__dict__.update(_plans={}, rank=1, world_size=2, tensor_dtype=torch.bfloat16, itemsize=2,
                      device=torch.device("cpu"), capacity=core.cap, _core=core, _counts=None, _counts_dev=None,
                      _captured_counts={}, _group=None, _collective=False, comm_id=-1, _buf=buf, _keeper=None)
    a.__dict__.update(fields)
    return a


def recording_instance(monkeypatch, cap=1000 * 256 * 2, **fields):
    """``(instance, core, buf)``: an instance over a :class:`RecordingCore` and a host buffer of
    ``cap`` bytes per slot, with the current stream faked; not synced (its ``_buf`` is set directly)."""
    fake_current_stream(monkeypatch)
    buf = torch.zeros(_C.buffer_layout(cap)["total"], dtype=torch.uint8)
    core = RecordingCore(cap, buf)
    return instance_over(core, buf, **fields), core, buf


def synced_instance(monkeypatch, cap=1000 * 256 * 2):
    """An All2All over a recording stand-in for the native core, with a CPU stand-in for the buffer tensor
    that, like torch.as_tensor(__cuda_array_interface__), keeps its interface object alive; synced,
    counts [3, 5]. Returns ``(instance, core)``."""
    fake_current_stream(monkeypatch)
    backing = torch.zeros(_C.buffer_layout(cap)["total"], dtype=torch.uint8)

    class _HostBytes:  # numpy's analogue of __cuda_array_interface__: the array holds this object
        def __init__(self, keeper):
            self.keeper, self.backing = keeper, backing
            self.__array_interface__ = {"shape": (backing.numel(),), "typestr": "|u1", "version": 3,
                                        "data": (backing.data_ptr(), False)}

    monkeypatch.setattr(ipc_all2all._lifetime, "_buffer_tensor",
                        lambda keeper, device: torch.from_numpy(np.asarray(_HostBytes(keeper))))
    core = RecordingCore(cap, backing)
    a = instance_over(core, None, comm_id=-3, order_token=ops.order_token("cpu"))
    a.sync([b"h0", b"h1"])
    a.set_rank_tokens([3, 5])
    return a, core


class CountingComm:
    """Stands in for the native communicator of rank ``rank`` (W = 2, counts [0, 8]): records every
    collective call the compiled code makes and returns random data of the right shape."""

    def __init__(self, counts, rank):
        self.world_size, self.rank, self._counts = len(counts), rank, list(counts)
        self.comm_id = 880000 + rank
        self.order_token = ops.order_token("cpu")
        self.log = []

    @property
    def rank_tokens(self):
        return list(self._counts)

    def send_recv_heads(self, x, copy_output=False, fp8_wire=False):
        self.log.append("send_recv_heads")
        b, _, H, D = x.shape
        return torch.randn(b, sum(self._counts), H // self.world_size, D)

    def gather_heads(self, y, copy_output=False, fp8_wire=False):
        self.log.append("gather_heads")
        b, _, hpr, D = y.shape
        return torch.randn(b, self._counts[self.rank], hpr * self.world_size, D)

    def allgather(self, x, copy_output=False):
        self.log.append("allgather")
        b, _, h, d = x.shape
        return torch.randn(b, sum(self._counts), h, d)
